"""The compute dtype of the learner and the rollout engines: bf16 where the hardware has it, fp32 otherwise.

    dtype = resolve_dtype(settings.dtype, log)   # "auto" | "bf16" | "fp32" -> "bf16" or "fp32", one log line

bf16 needs a CUDA device that supports it, or a CPU with AMX-BF16 or AVX512-BF16 (measured on these machines:
a 2048x576 @ 576x1536 matmul runs ~3.7x faster in bf16 than in fp32 with AMX). Without either, torch emulates
bf16 on CPUs, slower than fp32: "auto" then means fp32, and an explicit "bf16" is refused with one line and runs
fp32 — a service never crashes for want of a kernel. Log-softmax, the loss, the advantages and the IS ratios are
fp32 whatever the dtype (learner/logprobs.py upcasts each chunk of logits).
"""

from __future__ import annotations

import logging
import os
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

DtypeChoice = Literal["auto", "bf16", "fp32"]
Dtype = Literal["bf16", "fp32"]
CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_info(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ("model name", "flags", ...); {} where it cannot be read."""
    fields: dict[str, str] = {}
    try:
        text = cpuinfo.read_text()
    except OSError:
        return fields
    for line in text.splitlines():
        if not line.strip():
            break  # the first processor's block ends
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    return fields


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    return set(cpu_info(cpuinfo).get("flags", "").split())


def machine(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, object]:
    """What a timing was measured on, as run records keep it: the CPU's model, its cores, its bf16 kernels."""
    info = cpu_info(cpuinfo)
    flags = set(info.get("flags", "").split())
    return {
        "cpu": info.get("model name", "unknown"),
        "cores": os.cpu_count(),
        "bf16": sorted(flags & set(CPU_BF16_FLAGS)),  # [] : none (emulated); amx_bf16: AMX
    }


@cache
def bf16_support() -> tuple[bool, str]:
    """(supported, why): CUDA's own answer on a GPU, the CPU flags otherwise."""
    import torch

    if torch.cuda.is_available():
        ok = torch.cuda.is_bf16_supported()
        return ok, f"CUDA device {torch.cuda.get_device_name()} {'supports' if ok else 'does not support'} bf16"
    have = sorted(cpu_flags() & set(CPU_BF16_FLAGS))
    if have:
        return True, f"CPU has {', '.join(have)}"
    return False, f"CPU has none of {', '.join(CPU_BF16_FLAGS)} (bf16 would be emulated, slower than fp32)"


def resolve_dtype(
    choice: DtypeChoice, log: logging.Logger | None = None, support: tuple[bool, str] | None = None
) -> Dtype:
    """The dtype to run in; `support` overrides the machine's own answer (tests)."""
    ok, why = support if support is not None else bf16_support()
    if choice == "fp32":
        return "fp32"
    if ok:
        if log:
            log.info("dtype bf16 (%s)", why)
        return "bf16"
    if log and choice == "bf16":
        log.warning("dtype fp32: bf16 was asked for but %s", why)
    elif log:
        log.info("dtype fp32 (%s)", why)
    return "fp32"


def torch_dtype(dtype: Dtype) -> torch.dtype:
    import torch

    return torch.bfloat16 if dtype == "bf16" else torch.float32
