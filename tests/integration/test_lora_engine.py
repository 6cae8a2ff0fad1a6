"""vLLM serving the learner's LoRA adapter (issue 31), on a tiny random Llama: log-probs under an adapter equal the
merged model's (peft's, tests/integration/test_lora_learner.py), an adapter replaced while sequences are in flight
gives each token the version that sampled it (keep and recompute, as full weights do), and an adapter of another
base model is refused with the reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from learner.tiny import tiny_llama
from services.adapters import AdapterInfo, fingerprint, merge, write_info
from services.child_process import ROOT
from tests.integration.test_continuous_engine import TOLERANCE, continued, fresh, load, worst

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

SCRIPT = """
import json, sys
if __name__ == "__main__":
    from rollout.engines import SamplingParams, encode_prompt
    from rollout.engines.continuous import ContinuousEngine
    from rollout.engines.vllm_chunked import VllmEngine
    from services.adapters import read_adapter
    base, first, second, foreign, mode, serving = sys.argv[1:7]
    vllm = VllmEngine(base, kv_cache_gib=1, max_model_len=512, lora_max_rank=8, lora_serving=serving)
    engine = ContinuousEngine(vllm, update=mode, seed=5)
    prompt = (encode_prompt(engine.tokenizer, "What is 2 + 3?") * 40)[:300]  # two full KV blocks: cacheable
    params = SamplingParams(max_tokens=40)
    engine.submit("z", prompt, 2, params)             # before any adapter: the base model, version 0
    done = []
    for _ in range(4):
        done += engine.step()
    engine.load_weights(first, 1)                     # the filesystem transport: the learner's adapter folder
    engine.submit("a", prompt, 4, params)
    for _ in range(8):
        done += engine.step()
    boundary = {int(rid.split("#")[1]): n for rid, n in engine.tokens_so_far().items()}
    info, tensors = read_adapter(second)
    engine.load_tensors(iter(tensors.items()), 2, adapter=info)   # a broadcast round, sequences in flight
    engine.submit("b", prompt, 2, params)
    while engine.in_flight():
        done += engine.step()
    try:
        engine.load_weights(foreign, 3)
        refused = ""
    except ValueError as e:
        refused = str(e)
    out = {key: [c.__dict__ for c in cs] for key, cs in done}
    print("RESULT " + json.dumps({"prompt": prompt, "boundary": boundary, "out": out, "refused": refused,
                                  "version": engine.version}))
"""


def adapter(base: Path, out: Path, seed: int) -> Path:
    """A random (non-zero) rank-8 PEFT adapter of `base`, as the learner exports it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=list(TARGETS), init_lora_weights=False)
    peft = get_peft_model(model, config)
    with torch.no_grad():  # peft's random B is large for a tiny model: a change the test sees, not noise
        for name, p in peft.named_parameters():
            if ".lora_B." in name:
                p.mul_(0.3)
    peft.save_pretrained(out)
    write_info(out, AdapterInfo(fingerprint(base), 8, 16.0, TARGETS))
    return out


@pytest.mark.parametrize(("mode", "serving"), [("keep", "vllm"), ("recompute", "merge")])
def test_an_adapter_replaced_in_flight(model_dir: Path, tmp_path: Path, mode: str, serving: str) -> None:
    """`vllm` serving (vLLM's LoRA layers) and `merge` serving (merged into the replica's base weights) give the
    same log-probs and versions; a sequence started before the first adapter (on the base model, version 0)
    continues under it like any other."""
    first, second = adapter(model_dir, tmp_path / "a1", 1), adapter(model_dir, tmp_path / "a2", 2)
    other = tiny_llama(tmp_path / "other", hidden=256, tokenizer=True, seed=7)  # same shapes, other weights
    foreign = adapter(other, tmp_path / "foreign", 3)
    script = tmp_path / "lora.py"
    script.write_text(SCRIPT)
    env = os.environ | {"PYTHONPATH": str(ROOT), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                        "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache"), "TMPDIR": str(tmp_path)}  # fmt: skip
    args = [str(p) for p in (model_dir, first, second, foreign)]
    r = subprocess.run([sys.executable, str(script), *args, mode, serving], env=env, capture_output=True, text=True,
                       timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("RESULT "))[7:])

    assert "another base model" in data["refused"] and data["version"] == 2  # refused before anything loaded
    old = load(merge(model_dir, first, tmp_path / "m1"))
    new = load(merge(model_dir, second, tmp_path / "m2"))
    prompt, boundary = data["prompt"], {int(k): v for k, v in data["boundary"].items()}
    assert len(data["out"]["a"]) == 4 and len(data["out"]["b"]) == 2 and len(data["out"]["z"]) == 2
    assert worst(fresh(old, prompt, prompt[:1]), fresh(new, prompt, prompt[:1])) > 10 * TOLERANCE  # they differ
    spanning = 0
    for j, c in enumerate(data["out"]["a"]):
        tokens, lps, runs = c["token_ids"], c["logprobs"], c["versions"]
        if j not in boundary:
            assert runs == [[1, len(tokens)]]
            assert worst(lps, fresh(old, prompt, tokens)) < TOLERANCE
            continue
        b = boundary[j]
        assert runs == [[1, b], [2, len(tokens) - b]], runs
        assert worst(lps[:b], fresh(old, prompt, tokens)[:b]) < TOLERANCE  # the first adapter, as peft merges it
        if mode == "recompute":
            assert worst(lps[b:], fresh(new, prompt, tokens)[b:]) < TOLERANCE
        else:
            assert worst(lps[b:], continued(old, new, prompt, tokens, b)) < TOLERANCE
        spanning += 1
    assert spanning >= 2
    base = load(model_dir)
    for c in data["out"]["z"]:  # submitted before any adapter: the base's tokens until the load, the first
        tokens, runs = c["token_ids"], c["versions"]  # adapter's after, as for full weights (both servings)
        b = runs[0][1]
        assert runs[0][0] == 0 and b < len(tokens) and runs[1][0] == 1, runs
        assert worst(c["logprobs"][:b], fresh(base, prompt, tokens)[:b]) < TOLERANCE
        n = runs[1][1]  # the first adapter's tokens (the second may load while it still runs)
        want = fresh(old, prompt, tokens)[b:] if mode == "recompute" else continued(base, old, prompt, tokens, b)
        assert worst(c["logprobs"][b : b + n], want[:n]) < TOLERANCE
    for c in data["out"]["b"]:  # after the load: the second adapter only, never the first's cached prompt
        assert c["versions"] == [[2, len(c["token_ids"])]]
        assert worst(c["logprobs"], fresh(new, prompt, c["token_ids"])) < TOLERANCE


def test_what_vllm_cannot_serve_is_refused_before_anything_starts(model_dir: Path, tmp_path: Path) -> None:
    """`dapo-mesh up` asks this before it starts a service (mesh/up.py): a rank vLLM does not serve, a target the
    model has no weight for, an architecture vLLM has no LoRA for. vLLM is imported, no engine is started."""
    import shutil

    from rollout.engines.lora import check_servable, served_rank

    check_servable(model_dir, 8, list(TARGETS))
    assert [served_rank(r) for r in (1, 4, 8, 9, 32, 100, 512)] == [1, 8, 8, 16, 32, 128, 512]
    with pytest.raises(ValueError, match="up to rank 512"):
        check_servable(model_dir, 600)
    with pytest.raises(ValueError, match=r"no 2-d weight named \['lm_head'\]"):  # tied: the embedding's weight
        check_servable(model_dir, 8, ["q_proj", "lm_head"])
    bogus = tmp_path / "bogus"
    shutil.copytree(model_dir, bogus)
    config = json.loads((bogus / "config.json").read_text()) | {"architectures": ["NoSuchModelForCausalLM"]}
    (bogus / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no model class"):
        check_servable(bogus, 8)
