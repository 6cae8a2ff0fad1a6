"""Generation engines: G samples per prompt, with the behaviour log-prob of every sampled token.

    engine = load_engine(model_dir, "vllm", kv_cache_gib=2)                       # vLLM, called in chunks
    engine = load_engine(model_dir, "hf")                                         # transformers, in chunks
    engine = load_engine(model_dir, "vllm", batching="continuous", update="keep") # continuous batching

    base.py           the Engine and ContinuousBatching protocols, SamplingParams, Completion, encode_prompt
    hf.py             HFEngine: transformers `generate`
    vllm_chunked.py   VllmEngine: vLLM, each call runs its prompts to the end, weights load between calls
    continuous.py     ContinuousEngine: vLLM stepped one step at a time, weights load with sequences in flight

`load_engine` is the one place an implementation is chosen, and it imports them lazily: vLLM and torch stay
unimported until an engine is built (`python -m rollout --help` is instant, and vLLM is an optional extra).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, overload

from rollout.engines.base import (
    UPDATE_MODES,
    Batching,
    Completion,
    ContinuousBatching,
    Engine,
    FinishReason,
    RequestRefused,
    SamplingParams,
    UpdateMode,
    encode_prompt,
)
from services.dtype import Dtype

__all__ = [
    "UPDATE_MODES",
    "Batching",
    "Completion",
    "ContinuousBatching",
    "Engine",
    "FinishReason",
    "RequestRefused",
    "SamplingParams",
    "UpdateMode",
    "encode_prompt",
    "load_engine",
]


@overload
def load_engine(
    model_dir: Path,
    kind: str,
    *,
    dtype: Dtype = ...,
    batching: Literal["chunked"] = ...,
    update: UpdateMode = ...,
    seed: int | None = ...,
    **vllm_kw: Any,
) -> Engine: ...


@overload
def load_engine(
    model_dir: Path,
    kind: str,
    *,
    dtype: Dtype = ...,
    batching: Literal["continuous"],
    update: UpdateMode = ...,
    seed: int | None = ...,
    **vllm_kw: Any,
) -> ContinuousBatching: ...


def load_engine(
    model_dir: Path,
    kind: str,
    *,
    dtype: Dtype = "fp32",
    batching: Batching = "chunked",
    update: UpdateMode = "keep",
    seed: int | None = None,
    **vllm_kw: Any,
) -> Engine | ContinuousBatching:
    """`kind`: vllm or hf. `dtype`: resolved already (services.dtype.resolve_dtype), bf16 or fp32. `batching`:
    chunked (engine calls), or continuous (vLLM only: `update` says what a weight load does to the sequences in
    flight, `seed` seeds its sampling once). `vllm_kw`: VllmEngine's options (kv_cache_gib, eager, cpu_cores...).
    Without a seed the engine samples from fresh randomness: torch's generator starts from a fixed seed in every
    process and vLLM seeds it with 0, so two unseeded runs would otherwise sample the same texts."""
    if kind not in ("vllm", "hf"):
        raise ValueError(f"unknown engine {kind!r}: use vllm or hf")
    if batching == "continuous" and kind != "vllm":
        raise ValueError(f"continuous batching needs the vllm engine, not {kind!r}")
    engine: Engine | ContinuousBatching
    if kind == "hf":
        from rollout.engines.hf import HFEngine

        engine = HFEngine(model_dir, dtype=dtype)
    else:
        from rollout.engines.vllm_chunked import VllmEngine

        engine = VllmEngine(model_dir, dtype=dtype, **vllm_kw)
        if batching == "continuous":
            from rollout.engines.continuous import ContinuousEngine

            engine = ContinuousEngine(engine, update=update, seed=seed)
    if seed is None:
        import torch

        torch.seed()  # from the operating system's randomness: a fresh random stream in every run
    return engine
