"""The continuously batching vLLM engine (rollout/engines/continuous.py) on a tiny random Llama: weights loaded while
sequences are in flight, the version of every token, and log-probs checked against transformers for each update
mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from learner.loss import token_logprobs
from learner.tiny import tiny_llama
from services.child_process import ROOT

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
]
TOLERANCE = 1e-3  # fp32 kernels, vLLM vs transformers (tests/integration/test_rollout_engines.py)

SCRIPT = """
import json, sys
if __name__ == "__main__":
    from rollout.engines import SamplingParams, encode_prompt
    from rollout.engines.continuous import ContinuousEngine
    from rollout.engines.vllm_chunked import VllmEngine
    old, new, mode = sys.argv[1:4]
    engine = ContinuousEngine(VllmEngine(old, kv_cache_gib=1, max_model_len=512), update=mode, seed=5)
    prompt = (encode_prompt(engine.tokenizer, "What is 2 + 3?") * 40)[:300]  # two full KV blocks: cacheable
    params = SamplingParams(max_tokens=40)
    engine.submit("a", prompt, 4, params)
    done = []
    for _ in range(8):
        done += engine.step()
    boundary = {int(rid.split("#")[1]): n for rid, n in engine.tokens_so_far().items()}  # vLLM's count
    engine.load_weights(new, 1)                       # sequences in flight
    engine.submit("b", prompt, 2, params)             # after the load: the new weights only
    while engine.in_flight():
        done += engine.step()
    out = {key: [c.__dict__ for c in cs] for key, cs in done}
    from vllm.platforms import current_platform
    sched = engine.core.vllm_config.scheduler_config
    resolved, sched.async_scheduling = sched.async_scheduling, True
    try:  # an engine that would return the step before's tokens is refused
        ContinuousEngine(engine.vllm)
        refused = False
    except RuntimeError:
        refused = True
    cuda = current_platform.is_cuda()
    print("RESULT " + json.dumps({"prompt": prompt, "boundary": boundary, "out": out, "loads": engine.loads,
                                  "async_scheduling": resolved, "refused": refused, "cuda": cuda}))
"""


def run_script(tmp_path: Path, old: Path, new: Path, mode: str) -> dict:  # type: ignore[type-arg]
    script = tmp_path / "continuous.py"
    script.write_text(SCRIPT)
    env = os.environ | {"PYTHONPATH": str(ROOT), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                        "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache"), "TMPDIR": str(tmp_path)}  # fmt: skip
    r = subprocess.run([sys.executable, str(script), str(old), str(new), mode], env=env, capture_output=True,
                       text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(next(line for line in r.stdout.splitlines() if line.startswith("RESULT "))[7:])  # type: ignore[no-any-return]


def load(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def fresh(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> list[float]:
    """The model's log-probs of `tokens` after `prompt`, every position computed by this model."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        return token_logprobs(model(ids).logits.float(), ids)[0, len(prompt) :].tolist()  # type: ignore[no-any-return]


def continued(old: torch.nn.Module, new: torch.nn.Module, prompt: list[int], tokens: list[int], b: int) -> list[float]:
    """`keep`: the K/V of the prompt and of the first b-1 tokens as the OLD model computed them (the b-th was
    sampled, not yet encoded, when the load happened), the rest by the NEW one; the log-probs of tokens[b:]."""
    ids = torch.tensor([prompt + tokens])
    cut = len(prompt) + b - 1
    with torch.no_grad():
        past = old(ids[:, :cut], use_cache=True).past_key_values
        logits = new(ids[:, cut:], past_key_values=past, use_cache=True).logits.float()
    lp = logits[0, :-1].log_softmax(-1).gather(-1, ids[0, cut + 1 :].unsqueeze(-1)).squeeze(-1)
    return lp.tolist()  # type: ignore[no-any-return]


def worst(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)


CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
)


@pytest.mark.parametrize("device", ["any", CUDA])
@pytest.mark.parametrize("mode", ["keep", "recompute"])
def test_a_sequence_spans_an_update_at_the_load(model_dir: Path, tmp_path: Path, mode: str, device: str) -> None:
    """Every token is labelled with the version that sampled it, at the token where the load happened. On CUDA
    (the gpu case), where vLLM would turn asynchronous scheduling on and a step would return the step before's
    tokens, the engine runs with it off and says so."""
    new_dir = tiny_llama(tmp_path / "new", hidden=256, tokenizer=True, seed=1)
    data = run_script(tmp_path, model_dir, new_dir, mode)
    assert data["async_scheduling"] is False and data["refused"] is True
    assert data["cuda"] is (device == "cuda") or device == "any"
    old, new = load(model_dir), load(new_dir)
    prompt, boundary = data["prompt"], {int(k): v for k, v in data["boundary"].items()}
    assert data["loads"] == 1 and len(data["out"]["a"]) == 4 and len(data["out"]["b"]) == 2  # none lost, none twice
    spanning = 0
    for j, c in enumerate(data["out"]["a"]):
        tokens, lps, runs = c["token_ids"], c["logprobs"], c["versions"]
        if j not in boundary:  # it finished (an end-of-sequence token) before the load: one version
            assert runs == [[0, len(tokens)]]
            continue
        b = boundary[j]
        assert runs == [[0, b], [1, len(tokens) - b]], runs  # two versions, the boundary where the load happened
        assert worst(lps[:b], fresh(old, prompt, tokens)[:b]) < TOLERANCE  # before: the old weights
        after = lps[b:]
        if mode == "recompute":  # the prefix re-encoded: exactly the new weights' log-probs
            assert worst(after, fresh(new, prompt, tokens)[b:]) < TOLERANCE
        else:  # the new weights on the old weights' K/V of the prefix, and so not the new weights' fresh ones
            assert worst(after, continued(old, new, prompt, tokens, b)) < TOLERANCE
            assert worst(after, fresh(new, prompt, tokens)[b:]) > 10 * TOLERANCE
        spanning += 1
    assert spanning >= 2  # 8 steps of 40 tokens: most samples were in flight at the load
    for c in data["out"]["b"]:  # submitted after the load: never continued from the old weights' cached prompt
        assert c["versions"] == [[1, len(c["token_ids"])]]
        assert worst(c["logprobs"], fresh(new, prompt, c["token_ids"])) < TOLERANCE
