"""Checkpoints that make every batch count exactly once.

A checkpoint is DeepSpeed's (weights, optimizer, LR schedule) plus our `LearnerState`: the policy
version, the optimizer step, and the ids of every batch whose update the weights contain (the
ledger). The learner acknowledges a batch only once a checkpoint holds it, so after a crash the
restarted learner reclaims exactly the batches the checkpoint lacks and trains those.

    state = load(engine, run_dir) or LearnerState()
    save(engine, run_dir, state, keep=2)
    export_hf(engine, run_dir / "hf", state.version, tokenizer=tok)   # after every batch (weight transport)

Files under run_dir: checkpoints/<tag>/ (DeepSpeed; `latest` names the newest complete one),
state.json (the newest state, for people and audits), hf/v<version>/ (safetensors that transformers
and vLLM load; with LoRA, PEFT's adapter folder) with hf/latest naming the newest export.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from learner.parallel import barrier
from services import adapters, snapshots
from services.adapters import AdapterInfo

log = logging.getLogger(__name__)
TRAINABLE = "dapo-trainable.json"  # beside each checkpoint: the names and shapes of the tensors it trained


@dataclass
class LearnerState:
    version: int = 0  # policy version: batches trained into the weights
    step: int = 0  # optimizer steps
    trained: list[int] = field(default_factory=list)  # batch ids in the weights, in training order
    digests: list[str] = field(default_factory=list)  # their content digests (TrainBatch.digest): the identity

    def advance(self, batch_id: int, steps: int, digest: str) -> None:
        self.trained.append(batch_id)
        self.digests.append(digest)
        self.version += 1
        self.step += steps

    def keys(self) -> list[str]:
        """One identity per trained batch: its digest, or "#<id>" for batches trained before digests were kept."""
        legacy = len(self.trained) - len(self.digests)
        return [f"#{b}" for b in self.trained[:legacy]] + self.digests


def save(engine: Any, run_dir: Path, state: LearnerState, *, keep: int = 2) -> str:
    ckpt_dir = run_dir / "checkpoints"
    tag = f"v{state.version:06d}"
    # LoRA: the adapter and its optimizer state only (the frozen base is the model folder, unchanged)
    engine.save_checkpoint(
        str(ckpt_dir), tag=tag, client_state={"dapo": asdict(state)}, exclude_frozen_parameters=has_frozen(engine)
    )
    barrier()  # N ranks: every rank's shard is written before rank 0 names the checkpoint (and acknowledges)
    if engine.global_rank != 0:
        return tag
    (ckpt_dir / tag / TRAINABLE).write_text(json.dumps(trainable_names(engine)))
    snapshots.write_atomic(run_dir / "state.json", json.dumps(asdict(state) | {"tag": tag}))
    tags = sorted(p.name for p in ckpt_dir.iterdir() if p.is_dir() and p.name.startswith("v"))
    for old in tags[:-keep]:
        shutil.rmtree(ckpt_dir / old, ignore_errors=True)
    return tag


def has_frozen(engine: Any) -> bool:
    """Some parameters do not train (LoRA: the base): checkpoints leave them out."""
    return any(not p.requires_grad for p in engine.module.parameters())


def trainable_names(engine: Any) -> list[str]:
    """The names of the parameters that train (every one, or a LoRA adapter's), with their shapes: what a resume must
    find again."""
    return [
        f"{n}{list(getattr(p, 'ds_shape', p.shape))}" for n, p in engine.module.named_parameters() if p.requires_grad
    ]


def check_trainable(engine: Any, tag_dir: Path) -> None:
    """Before DeepSpeed loads: the checkpoint trained the tensors this learner trains (a LoRA checkpoint is loaded
    non-strictly, and a resume with another --lora-rank or --lora-targets would fail obscurely or load the optimizer
    state onto other tensors). Checkpoints written before the file existed are not checked."""
    path = tag_dir / TRAINABLE
    if not path.exists():
        return
    saved, mine = json.loads(path.read_text()), trainable_names(engine)
    if saved != mine:
        raise RuntimeError(
            f"the checkpoint {tag_dir} trained {len(saved)} tensors ({', '.join(saved[:2])}, ...), this learner trains "
            f"{len(mine)} ({', '.join(mine[:2])}, ...): resume with the run's --lora-rank and --lora-targets, or "
            "start a new --run-dir"
        )


def read_state(run_dir: Path) -> LearnerState | None:
    """The newest checkpoint's state from state.json, without DeepSpeed (for the audit); None before the first."""
    path = run_dir / "state.json"
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    data.pop("tag", None)
    return LearnerState(**data)


def load(engine: Any, run_dir: Path) -> LearnerState | None:
    ckpt_dir = run_dir / "checkpoints"
    if not (ckpt_dir / "latest").exists():
        return None
    check_trainable(engine, ckpt_dir / (ckpt_dir / "latest").read_text().strip())
    # LoRA: saved without the frozen base, so the module's load is not strict (check_trainable is)
    path, client_state = engine.load_checkpoint(str(ckpt_dir), load_module_strict=not has_frozen(engine))
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load the checkpoint named in {ckpt_dir / 'latest'}")
    state = LearnerState(**client_state["dapo"])
    log.info("resumed from %s: version %d, %d batches trained", path, state.version, len(state.trained))
    return state


def export_hf(
    engine: Any,
    hf_dir: Path,
    version: int,
    *,
    tokenizer: Any = None,
    keep: int = 2,
    adapter: AdapterInfo | None = None,
) -> Path:
    """The current weights as an HF safetensors folder (gathered first under ZeRO-3: every rank calls this; rank 0
    writes). LoRA (`adapter`): PEFT's adapter folder (peft's save_pretrained of the PeftModel) and its description
    (services/adapters.py), which `dapo-mesh merge` merges into the base."""
    import deepspeed

    out = snapshots.snapshot_dir(hf_dir, version)
    tmp = hf_dir / f".tmp-{out.name}"
    module = engine.module
    # LoRA: the adapter alone is written, so only it is gathered (not a 70B base on every rank)
    params = [p for p in module.parameters() if adapter is None or p.requires_grad]
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=engine.zero_optimization_stage() == 3):
        if engine.global_rank != 0:
            return out
        hf_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        module.save_pretrained(tmp, safe_serialization=True)
        if adapter is not None:
            adapters.write_info(tmp, adapter)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    snapshots.write_latest(hf_dir, out)
    exports = snapshots.snapshot_folders(hf_dir)
    for old in exports[:-keep]:
        shutil.rmtree(hf_dir / old, ignore_errors=True)
    return out
