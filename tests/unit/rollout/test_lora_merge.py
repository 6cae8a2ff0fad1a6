"""Merged adapters keep their small updates (the doors issue's "also fix"): a bf16 base checkpoint and an adapter
whose update is a few parts in ten thousand of a weight — what the first steps of a LoRA run make. Merged in the
checkpoint's dtype (bf16), the update rounded away and the replica served the base; the merged copy is fp32 now, and
merged adapters run in an fp32 engine (an explicit bf16 is refused with why)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from learner.tiny import tiny_llama
from rollout.engines.lora import MergedAdapter, served_dtype
from services.adapters import PREFIX, AdapterInfo, fingerprint


def test_a_small_update_survives_the_merge_on_a_bf16_base(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    fp32 = tiny_llama(tmp_path / "fp32")
    base = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(fp32, dtype=torch.float32).to(torch.bfloat16).save_pretrained(base)
    merger = MergedAdapter(base, max_rank=8)
    module = "model.layers.0.self_attn.q_proj"
    w = merger.weights[module + ".weight"]
    assert w.dtype == torch.float32  # the base held in fp32
    torch.manual_seed(0)
    a = torch.randn(4, w.shape[1])
    b = torch.randn(w.shape[0], 4) * 1e-4 * w.abs().mean() / a.abs().mean()  # ~1e-4 of a weight: below bf16's step
    delta = 2.0 * (b @ a)  # alpha / r = 8 / 4
    assert ((w + delta).to(torch.bfloat16) == w.to(torch.bfloat16)).float().mean() > 0.9  # bf16 would lose it
    info = AdapterInfo(fingerprint(base), 4, 8.0, ("q_proj",))
    tensors = {}
    for name in merger.weights:  # every layer's q_proj: zero but for the first layer's
        if name.endswith("q_proj.weight"):
            m = name[: -len(".weight")]
            tensors[f"{PREFIX}{m}.lora_A.weight"] = a if m == module else torch.zeros_like(a)
            tensors[f"{PREFIX}{m}.lora_B.weight"] = b if m == module else torch.zeros_like(b)
    merged = dict(merger.merged(info, iter(tensors.items())))
    got = merged[module + ".weight"]
    assert got.dtype == torch.float32
    assert torch.allclose(got - w, delta, rtol=1e-3, atol=1e-8)  # the update, all of it (to fp32 rounding)
    untouched = "model.layers.0.self_attn.k_proj.weight"
    assert torch.equal(merged[untouched], merger.weights[untouched])


def test_merged_adapters_run_in_fp32() -> None:
    assert served_dtype("merge", "bf16", "auto") == "fp32"
    assert served_dtype("vllm", "bf16", "auto") == "bf16"  # vLLM's LoRA layers add the adapter beside the weight
    assert served_dtype("merge", "fp32", "fp32") == "fp32"
    with pytest.raises(ValueError, match="loses the adapter's small updates"):
        served_dtype("merge", "bf16", "bf16")
