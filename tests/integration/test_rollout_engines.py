"""Engines on a tiny random Llama: G samples per prompt; behaviour log-probs equal a transformers forward."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from learner.loss import token_logprobs
from learner.tiny import tiny_llama
from rollout.engines import Completion, SamplingParams, encode_prompt
from rollout.engines.hf import HFEngine
from services.child_process import ROOT
from services.dtype import torch_dtype

# worst |log-prob difference| allowed between an engine and transformers on the same weights: fp32 kernels agree to
# rounding; bf16 ones round each matmul to 8 bits of mantissa, in a different order in vLLM's kernels and in torch's
# (measured on the tiny model: 8e-3). A stale tied lm_head after a reload is off by up to 1.5 in either dtype.
TOLERANCE = {"fp32": 1e-3, "bf16": 0.05}
TOL_HF = {"fp32": 1e-4, "bf16": 0.05}  # generate() (a KV cache, one position at a time) vs one forward


def reference_logprobs(
    model_dir: Path, prompt: list[int], c: Completion, temperature: float = 1.0, dtype: str = "fp32"
) -> list[float]:
    """transformers' log-probs of the completion's tokens at the sampling temperature (what the learner computes),
    the model in `dtype`, the log-softmax in fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype(dtype)).eval()  # type: ignore[arg-type]
    ids = torch.tensor([prompt + c.token_ids])
    with torch.no_grad():
        lp = token_logprobs(model(ids).logits.float() / temperature, ids)[0, len(prompt) :]
    return lp.tolist()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_hf_engine_samples_and_logprobs(model_dir: Path, dtype: str) -> None:
    engine = HFEngine(model_dir, dtype=dtype)  # type: ignore[arg-type]
    assert next(engine.model.parameters()).dtype == torch_dtype(dtype)  # type: ignore[arg-type]
    prompts = [encode_prompt(engine.tokenizer, "What is 2 + 3?"), encode_prompt(engine.tokenizer, "Hi")]
    assert engine.tokenizer.decode(prompts[1]) == "<user>Hi\n<assistant>"  # the chat template wraps the prompt
    outs = engine.generate(prompts, [4, 2], SamplingParams(max_tokens=12, seed=7))
    assert [len(o) for o in outs] == [4, 2]
    for prompt, o in zip(prompts, outs, strict=True):
        for c in o:
            assert 1 <= len(c.token_ids) <= 12 and len(c.logprobs) == len(c.token_ids)
            assert c.finish_reason == ("length" if len(c.token_ids) == 12 and 1 not in c.token_ids else "stop")
            assert c.logprobs == pytest.approx(reference_logprobs(model_dir, prompt, c, dtype=dtype), abs=TOL_HF[dtype])
    assert len({tuple(c.token_ids) for c in outs[0]}) > 1  # G different samples
    again = engine.generate(prompts, [4, 2], SamplingParams(max_tokens=12, seed=7))
    assert [[c.token_ids for c in o] for o in again] == [[c.token_ids for c in o] for o in outs]  # seeded
    cool = engine.generate(prompts[:1], 2, SamplingParams(temperature=0.7, max_tokens=12, seed=7))
    for c in cool[0]:  # behaviour log-probs at the sampling temperature
        assert c.logprobs == pytest.approx(reference_logprobs(model_dir, prompts[0], c, 0.7, dtype), abs=TOL_HF[dtype])


VLLM_CHECK = """
import json, sys
if __name__ == "__main__":
    from rollout.engines.vllm_chunked import VllmEngine
    from rollout.engines import SamplingParams, encode_prompt
    e = VllmEngine(sys.argv[1], kv_cache_gib=1, max_model_len=512, dtype=sys.argv[3])
    prompts = [encode_prompt(e.tokenizer, "What is 2 + 3?"), encode_prompt(e.tokenizer, "Hi")]
    prompts.append((prompts[0] * 40)[:300])  # two full KV blocks (128 tokens on CPU): their prefix gets cached
    outs = e.generate(prompts, [4, 2, 2], SamplingParams(max_tokens=12, seed=7))
    print("RESULT " + json.dumps({"prompts": prompts, "outs": [[c.__dict__ for c in o] for o in outs]}))
    e.load_weights(sys.argv[2], version=3)  # other weights, in place
    outs = e.generate(prompts, [4, 2, 2], SamplingParams(max_tokens=12, seed=7))
    print("RELOADED " + json.dumps({"version": e.version, "outs": [[c.__dict__ for c in o] for o in outs]}))
    outs = e.generate(prompts[:2], 2, SamplingParams(temperature=0.7, max_tokens=12, seed=7))
    print("COOL " + json.dumps({"outs": [[c.__dict__ for c in o] for o in outs]}))
"""


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_vllm_engine_samples_and_logprobs(model_dir: Path, tmp_path: Path, dtype: str) -> None:
    script = tmp_path / "check.py"
    script.write_text(VLLM_CHECK)
    env = os.environ | {"PYTHONPATH": str(ROOT), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                        "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache"), "TMPDIR": str(tmp_path)}  # fmt: skip
    other = tiny_llama(tmp_path / "other", hidden=256, tokenizer=True, seed=1)
    r = subprocess.run([sys.executable, str(script), str(model_dir), str(other), dtype], env=env, capture_output=True,
                       text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    import json

    data = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("RESULT "))[7:])
    outs = [[Completion(**c) for c in o] for o in data["outs"]]
    assert [len(o) for o in outs] == [4, 2, 2]
    worst = 0.0
    for prompt, o in zip(data["prompts"], outs, strict=True):
        for c in o:
            assert len(c.logprobs) == len(c.token_ids) >= 1
            ref = reference_logprobs(model_dir, prompt, c, dtype=dtype)
            worst = max(worst, max(abs(a - b) for a, b in zip(c.logprobs, ref, strict=True)))
    print(f"vLLM vs transformers ({dtype}): max |log-prob difference| = {worst:.2e}")
    assert worst < TOLERANCE[dtype], f"vLLM behaviour log-probs differ from transformers by up to {worst}"

    reloaded = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("RELOADED "))[9:])
    assert reloaded["version"] == 3
    worst = 0.0
    for prompt, o in zip(data["prompts"], reloaded["outs"], strict=True):
        for c in (Completion(**x) for x in o):
            ref = reference_logprobs(other, prompt, c, dtype=dtype)  # the NEW weights, tied lm_head included
            worst = max(worst, max(abs(a - b) for a, b in zip(c.logprobs, ref, strict=True)))
    # (the long prompt's cached prefix was computed with the OLD weights: it must not be reused)
    print(f"after the reload ({dtype}): max |log-prob difference| = {worst:.2e}")
    assert worst < TOLERANCE[dtype], f"after an in-place reload vLLM log-probs differ from the new weights by {worst}"

    cool = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("COOL "))[5:])
    worst = 0.0
    for prompt, o in zip(data["prompts"][:2], cool["outs"], strict=True):
        for c in (Completion(**x) for x in o):
            ref = reference_logprobs(
                other, prompt, c, 0.7, dtype=dtype
            )  # at the sampling temperature, the reloaded weights
            worst = max(worst, max(abs(a - b) for a, b in zip(c.logprobs, ref, strict=True)))
    assert worst < TOLERANCE[dtype], f"vLLM log-probs at temperature 0.7 differ from transformers' by {worst}"
