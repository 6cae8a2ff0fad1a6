"""LoRA adapters as the mesh moves them: on the wire, on disk, and merged. Written by the learner (peft), read by the
replicas (vLLM's LoRA), `dapo-mesh merge` and the tests; so, like the weight wire, it lives in the ground.

    info = AdapterInfo(base=fingerprint(model_dir), rank=8, alpha=16.0, targets=("q_proj", "v_proj"))
    check_adapter(info, [(name, shape), ...], model_specs(model_dir), fingerprint(model_dir), max_rank=32)
    info, tensors = read_adapter(folder)            # a snapshot folder the learner exported (PEFT's layout)
    merge(base_dir, folder, out_dir)                # an HF model folder vLLM loads without LoRA

An adapter is PEFT's: a folder with adapter_config.json and adapter_model.safetensors, whose tensors are named
`base_model.model.<module>.lora_A.weight` ([r, in]) and `….lora_B.weight` ([out, r]); the module's weight is
W + (alpha / r) · B · A. Beside them the learner writes `dapo-adapter.json` (AdapterInfo): the rank, alpha and
targets, and the fingerprint of the base model the adapter was trained on. A replica refuses an adapter whose base
fingerprint is not its own model's: an adapter applied to another base is a different policy, silently.

The fingerprint is a SHA-256 over the base model's safetensors headers (every name, dtype, shape and offset) and the
first and last 64 KiB of each file's data: two models of the same architecture with different weights differ there,
and it costs milliseconds on a 140 GB model (not a hash of every byte: it tells models apart, it does not prove
integrity — the weight sync's MACs and checksums do that for what travels).
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_INFO = "dapo-adapter.json"
PREFIX = "base_model.model."
EDGE = 64 * 1024


@dataclass(frozen=True)
class AdapterInfo:
    base: str  # fingerprint() of the base model
    rank: int
    alpha: float
    targets: tuple[str, ...]  # module names (q_proj, ...), as peft's target_modules

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"targets": list(self.targets)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AdapterInfo:
        try:
            return cls(str(d["base"]), int(d["rank"]), float(d["alpha"]), tuple(str(t) for t in d["targets"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not an adapter description (base, rank, alpha, targets): {d!r}") from e


def fingerprint(model_dir: Path) -> str:
    """What tells this base model from another (see the module's docstring): 16 hex digits."""
    h = hashlib.sha256()
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    for f in files:
        with open(f, "rb") as fh:
            raw = fh.read(8)
            (n,) = struct.unpack("<Q", raw)
            header = fh.read(n)
            h.update(raw + header)
            h.update(fh.read(EDGE))
            size = f.stat().st_size
            fh.seek(max(8 + n, size - EDGE))
            h.update(fh.read(EDGE))
    return h.hexdigest()[:16]


def module_of(name: str) -> tuple[str, str]:
    """`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` -> ("model.layers.0.self_attn.q_proj", "A")."""
    if not name.startswith(PREFIX) or not name.endswith((".lora_A.weight", ".lora_B.weight")):
        raise ValueError(f"{name!r} is not a LoRA tensor ({PREFIX}<module>.lora_A.weight or .lora_B.weight)")
    stem = name[len(PREFIX) : -len(".lora_A.weight")]
    return stem, name[-len("A.weight")]


def check_adapter(
    info: AdapterInfo,
    params: list[tuple[str, tuple[int, ...]]],
    expected: dict[str, tuple[int, ...]],
    base: str,
    max_rank: int,
) -> None:
    """The adapter fits this base model (its fingerprint `base`, its parameter shapes `expected`) and a server of
    rank `max_rank`: every tensor a LoRA factor of one of the model's 2-d weights, A and B of each, of the stated
    rank. ValueError naming the first difference."""
    if info.base != base:
        raise ValueError(
            f"the adapter was trained on another base model (fingerprint {info.base}, this replica's is {base}): "
            "serve the learner's base model"
        )
    if not 0 < info.alpha < float("inf"):
        raise ValueError(f"the adapter's alpha {info.alpha} is not a positive number")
    if not 0 < info.rank <= max_rank:
        raise ValueError(f"the adapter's rank {info.rank} is not in 1..{max_rank} (this replica's --lora-max-rank)")
    factors: dict[str, set[str]] = {}
    for name, shape in params:
        module, ab = module_of(name)
        weight = expected.get(module + ".weight")
        if weight is None or len(weight) != 2:
            raise ValueError(f"{name}: this model has no 2-d weight {module}.weight to adapt")
        want = (info.rank, weight[1]) if ab == "A" else (weight[0], info.rank)
        if tuple(shape) != want:
            raise ValueError(f"{name}: shape {tuple(shape)}, {want} expected for rank {info.rank} on {weight}")
        factors.setdefault(module, set()).add(ab)
    if not factors:
        raise ValueError("the adapter has no LoRA tensor")
    if half := sorted(m for m, ab in factors.items() if ab != {"A", "B"}):
        raise ValueError(f"the adapter has lora_A or lora_B alone for {half[:3]}")
    # every module its targets name (peft's rule: the name or a dotted suffix of it), and no other: a module left
    # out would run the base weights there, another policy served silently
    targeted = {n[: -len(".weight")] for n, s in expected.items() if len(s) == 2 and n.endswith(".weight")}
    targeted = {m for m in targeted if any(m == t or m.endswith("." + t) for t in info.targets)}
    if set(factors) != targeted:
        missing, extra = sorted(targeted - set(factors)), sorted(set(factors) - targeted)
        raise ValueError(
            f"the adapter does not cover its targets {list(info.targets)}: lacks {missing[:3]}, "
            f"has {extra[:3]} beyond them"
        )


def is_adapter(folder: Path) -> bool:
    return (Path(folder) / ADAPTER_WEIGHTS).exists()


def write_info(folder: Path, info: AdapterInfo) -> None:
    (Path(folder) / ADAPTER_INFO).write_text(json.dumps(info.to_dict(), indent=1))


def read_adapter(folder: Path) -> tuple[AdapterInfo, dict[str, Any]]:
    """A snapshot folder the learner exported: its description and its tensors (peft's names)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    path = folder / ADAPTER_INFO
    if not path.exists():
        raise ValueError(f"{folder} has no {ADAPTER_INFO}: not an adapter the learner exported")
    info = AdapterInfo.from_dict(json.loads(path.read_text()))
    return info, load_file(str(folder / ADAPTER_WEIGHTS))


def merge(base_dir: Path, adapter_dir: Path, out_dir: Path, *, check: bool = True) -> Path:
    """base + adapter -> an HF model folder (fp32 safetensors, the base's tokenizer), loadable without LoRA.
    `check`: refuse an adapter trained on another base (its dapo-adapter.json's fingerprint)."""
    import shutil

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if not is_adapter(adapter_dir):
        raise ValueError(f"{adapter_dir} holds no {ADAPTER_WEIGHTS}: not a LoRA snapshot")
    if check and (Path(adapter_dir) / ADAPTER_INFO).exists():
        info, _ = read_adapter(adapter_dir)
        if info.base != (mine := fingerprint(base_dir)):
            raise ValueError(f"{adapter_dir} was trained on base {info.base}; {base_dir} is {mine}")
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(out_dir, safe_serialization=True)
    weights = (".safetensors", ".bin", ".pt", ".pth", ".index.json", ".gguf")
    for f in Path(base_dir).iterdir():  # the tokenizer and generation config, as the base has them; no weights
        if f.is_file() and not f.name.endswith(weights) and not (out_dir / f.name).exists():
            shutil.copy2(f, out_dir / f.name)
    return Path(out_dir)
