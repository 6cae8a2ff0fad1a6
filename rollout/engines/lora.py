"""How a vLLM engine serves the learner's LoRA adapter, replaced at each version: `vllm` serving, through vLLM's LoRA
support (`AdapterSlot`: vLLM's `LoRARequest(load_inplace=True)`, the same adapter id, new weights), or `merge`
serving (`MergedAdapter`: merged into the replica's copy of the base and loaded like full weights; the default on
CPUs, where vLLM's LoRA kernels cost 2.6-3.3x in tokens/s). The rest of this docstring is about `vllm` serving.

    slot = AdapterSlot(llm, model_dir, max_rank=32)
    slot.load(info, named_tensors)     # a broadcast round: AdapterInfo from its manifest, tensors in PEFT's names
    slot.load_folder(snapshot)         # the filesystem transport: the learner's adapter folder
    llm.generate(..., lora_request=slot.request)

One adapter id for the whole run, loaded at start as a zero adapter (the base model exactly): every request carries
it, so sequences in flight read the new adapter from their next token (what the engine's `keep` mode means;
`recompute` re-encodes them, `drain` waits — rollout/engines/continuous.py, unchanged), and the policy version of
each token is counted as for full weights. New requests carry a cache salt of their version and the prefix cache is
reset after a load unless running sequences keep their K/V (rollout/engines/vllm_chunked.py): no K/V an older
adapter computed is served to a request of a newer version.

vLLM loads an adapter from a folder: the tensors go to a private folder in memory (/dev/shm where there is one), a
few MB, then `add_lora(load_inplace=True)` reads them there. An adapter is checked against this base model first
(services/adapters.py): another base's adapter, or a rank above --lora-max-rank, is refused with the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from services.adapters import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    PREFIX,
    AdapterInfo,
    check_adapter,
    fingerprint,
    module_of,
    read_adapter,
)
from services.dtype import Dtype
from services.weight_wire import model_specs

ADAPTER_ID = 1  # vLLM's lora_int_id of the learner's adapter: one id, replaced in place
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM 0.32 accepts


def served_rank(rank: int) -> int:
    """vLLM's max_lora_rank for adapters up to `rank`: the smallest it accepts that holds them."""
    if rank > VLLM_RANKS[-1]:
        raise ValueError(f"LoRA rank {rank}: vLLM serves adapters up to rank {VLLM_RANKS[-1]}")
    return min(r for r in VLLM_RANKS if r >= rank)


def resolve_serving(serving: str) -> str:
    """auto: vLLM's LoRA layers on GPUs, merged weights on CPUs (where vLLM's LoRA kernels cost 2.6-3.3x)."""
    if serving != "auto":
        return serving
    from vllm.platforms import current_platform

    return "vllm" if current_platform.is_cuda_alike() else "merge"


def check_servable(model_dir: Path, rank: int, targets: list[str] | None = None, serving: str = "vllm") -> None:
    """Before anything starts: these target modules are 2-d weights of the model (checked against its safetensors)
    and, served by vLLM's LoRA layers, vLLM serves adapters of this rank on this architecture. ValueError says why
    not."""
    weights = {n.rsplit(".", 2)[-2] for n, shape in model_specs(model_dir).items() if len(shape) == 2}
    if targets and (missing := sorted(set(t.rsplit(".", 1)[-1] for t in targets) - weights)):
        raise ValueError(f"{model_dir}: no 2-d weight named {missing} to adapt; it has {sorted(weights)}")
    if resolve_serving(serving) == "merge":
        return
    served_rank(rank)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    archs = config.get("architectures") or []
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_lora

    cls = ModelRegistry._try_load_model_cls(archs[0]) if archs else None  # noqa: SLF001 -- no public lookup by name
    if cls is None:
        raise ValueError(f"{model_dir}: vLLM has no model class for architectures {archs}")
    if not supports_lora(cls):
        raise ValueError(
            f"{model_dir}: vLLM serves no LoRA adapter on {archs[0]}: serve it merged ([rollout] lora_serving = "
            '"merge") or train full weights'
        )


def served_dtype(serving: str, dtype: Dtype, choice: str) -> Dtype:
    """The engine's dtype for adapters served this way: `merge` runs fp32 (MergedAdapter: a merged bf16 weight
    loses the adapter's small updates) — an explicit bf16 is refused with why; `vllm` serving keeps `dtype`."""
    if serving != "merge" or dtype == "fp32":
        return dtype
    if choice == "bf16":
        raise ValueError(
            "dtype bf16 with merged adapters: a merged bf16 weight loses the adapter's small updates (the replica "
            'would serve the base); use dtype "fp32" or "auto" (fp32 for merged adapters), or lora_serving "vllm"'
        )
    return "fp32"


def scratch_dir() -> Path:
    shm = Path("/dev/shm")
    where = str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix="dapo-adapter-", dir=where))


class Served:
    """What both servings check an adapter against: this base model (its parameter shapes and fingerprint) and the
    replica's --lora-max-rank (services/adapters.py check_adapter)."""

    def __init__(self, model_dir: Path, max_rank: int):
        self.max_rank = max_rank
        self.expected = model_specs(model_dir)
        self.base = fingerprint(model_dir)

    def check(self, info: AdapterInfo, tensors: dict[str, Any]) -> None:
        check_adapter(info, [(n, tuple(t.shape)) for n, t in tensors.items()], self.expected, self.base, self.max_rank)


class AdapterSlot(Served):
    """`vllm` serving: vLLM's LoRA layers apply the adapter at every step (its punica kernels on GPUs)."""

    def __init__(self, llm: Any, model_dir: Path, max_rank: int):
        super().__init__(model_dir, max_rank)
        self.llm = llm
        self.folder = scratch_dir()
        weakref.finalize(self, shutil.rmtree, self.folder, True)
        self.request: Any = None  # the LoRARequest every request carries
        self._write(*self.zero_adapter())  # from the start: no request runs without the adapter's id (below)

    def zero_adapter(self) -> tuple[AdapterInfo, dict[str, Any]]:
        """A rank-1 adapter with B = 0 on one weight: the base model exactly, under the adapter's id. Loaded before any
        request, so that every request carries the id and reads each new adapter in place: a request without one
        is not reliably the base model in a batch where an adapter is active (seen with vLLM 0.32's CPU kernels: its
        log-probs moved by 0.7 once an adapter loaded beside it)."""
        import torch

        weights = sorted(n for n, shape in self.expected.items() if len(shape) == 2 and ".layers.0." in n)
        name = next((n for n in weights if n.endswith("q_proj.weight")), weights[0] if weights else None)
        if name is None:
            raise ValueError("no 2-d weight in the first layer to put a LoRA adapter on")
        module, (out, inp) = name[: -len(".weight")], self.expected[name]
        tensors = {
            f"{PREFIX}{module}.lora_A.weight": torch.zeros(1, inp),
            f"{PREFIX}{module}.lora_B.weight": torch.zeros(out, 1),
        }
        return AdapterInfo(self.base, 1, 1.0, (module.rsplit(".", 1)[-1],)), tensors

    def load(self, info: AdapterInfo, named: Iterator[tuple[str, Any]]) -> None:
        """Replace the adapter with these tensors (they may be views into the broadcast's buckets: copied)."""
        tensors = {name: t.detach().clone() for name, t in named}
        self.check(info, tensors)
        self._write(info, tensors)

    def load_folder(self, folder: Path) -> None:
        info, tensors = read_adapter(folder)
        self.check(info, tensors)
        self._write(info, tensors)

    def _write(self, info: AdapterInfo, tensors: dict[str, Any]) -> None:
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        config = {
            "peft_type": "LORA",
            "r": info.rank,
            "lora_alpha": info.alpha,
            "target_modules": list(info.targets),
            "bias": "none",
            "task_type": "CAUSAL_LM",
        }
        save_file(tensors, str(self.folder / ADAPTER_WEIGHTS))
        (self.folder / ADAPTER_CONFIG).write_text(json.dumps(config))
        path = str(self.folder)
        self.llm.llm_engine.add_lora(LoRARequest("policy", ADAPTER_ID, path, load_inplace=True))
        self.request = LoRARequest("policy", ADAPTER_ID, path)


class MergedAdapter(Served):
    """`merge` serving: the replica merges each version's adapter into its own copy of the base weights, W0 +
    (alpha / r) · B · A in fp32, and loads the result in place like full weights (the same reload, lm_head re-tie,
    prefix-cache and version rules). The network still carries the adapter alone; the engine runs at the base
    model's speed. Measured on this machine's CPU kernels (docs/results/lora.md): vLLM's LoRA layers cost 2.6-3.3x in
    tokens/s at rank 32, a merged reload ~0.3 s per version for a 135M model.

    The merged copy is fp32 whatever the checkpoint's dtype, and so must the engine be (`served_dtype`): bf16 keeps 8
    bits of a weight, and an adapter's first updates, a few parts in a thousand of a weight, round away in it — the
    replica would serve about the base while the learner trains the adapter (vLLM's LoRA layers add the adapter
    beside the weight instead, in any dtype)."""

    def __init__(self, model_dir: Path, max_rank: int):
        import torch
        from safetensors.torch import load_file

        super().__init__(model_dir, max_rank)
        self.weights: dict[str, Any] = {}  # the base model's own tensors in fp32, merged into at each version
        for f in sorted(Path(model_dir).glob("*.safetensors")):
            for name, t in load_file(str(f)).items():
                self.weights[name] = t.to(torch.float32) if t.is_floating_point() else t

    def merged(self, info: AdapterInfo, named: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """Every base weight, the adapted ones merged: checked first (nothing is yielded for a refused adapter)."""
        import torch

        tensors = dict(named)
        self.check(info, tensors)
        scale = info.alpha / info.rank
        factors = {module_of(n)[0]: n for n in tensors if n.endswith(".lora_A.weight")}
        merged = {}
        for module, a in factors.items():
            b = a[: -len("lora_A.weight")] + "lora_B.weight"
            w = self.weights[module + ".weight"]
            delta = tensors[b].to(torch.float32) @ tensors[a].to(torch.float32)
            merged[module + ".weight"] = w + scale * delta  # fp32: the delta is kept (class docstring)
        return iter([(name, merged.get(name, w)) for name, w in self.weights.items()])

    def merged_folder(self, folder: Path) -> Iterator[tuple[str, Any]]:
        info, tensors = read_adapter(folder)
        return self.merged(info, iter(tensors.items()))
