"""`dapo-mesh replay`: train a run's recorded batches again, offline, in the same order, and write the weights.

    dapo-mesh replay --batches RUN_DIR --model-dir M --out OUT [--zero-stage K] [--dtype fp32]

RUN_DIR is a learner's run dir (or a mesh run dir: its learner/) whose learner ran with --record-batches
(learner/record.py); M is the model the run started from (for a run recorded from version v > 0: the snapshot
of version v). Each batch is trained at the version it was trained at in the run (the LR schedule, the mini-batch
shuffle and the gap metrics depend on it) with the recorded update settings; with the same dtype, ZeRO stage and
threads the weights come out as the run's (tested: bit for bit on one process). A run can thus be reproduced,
bisected (`--until V`), and its updates debugged with the recorded inputs. The HF snapshot goes to OUT/hf/v<last>.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from learner import checkpoint
from learner.record import batches_dir, load_batch, read_settings, recorded
from learner.settings import LearnerSettings
from services.common.ledger import read_ledger


def replay(batches: Path, model_dir: Path, out: Path, *, zero_stage: int | None = None, dtype: str | None = None,
           until: int | None = None, say: Callable[[str], None] = print) -> Path:  # fmt: skip
    """Train the recorded batches (those trained at versions < `until`, if given); the final HF snapshot's path."""
    from learner.trainer import Trainer

    d = batches_dir(batches)
    found = [(v, p) for v, p in recorded(d) if until is None or v < until]
    if not found:
        raise ValueError(f"no recorded batch before version {until}")
    given: dict[str, Any] = {"model_dir": model_dir, "run_dir": out, "weight_sync": "none", "hf_export": False}
    given |= {k: v for k, v in (("zero_stage", zero_stage), ("dtype", dtype)) if v is not None}
    s = LearnerSettings.model_validate(read_settings(d) | given)
    logged = {e.version: e.metrics for e in read_ledger(d.parent)}  # the last training of each version
    trainer = Trainer(s)
    say(f"replaying {len(found)} batches (versions {found[0][0]}..{found[-1][0]}) from {d} on {model_dir}")
    for version, path in found:
        m = trainer.train(load_batch(path), version=version)
        was = logged.get(version + 1, {}).get("loss")
        run = "" if was is None else f" (in the run: {was:.6f})"
        say(f"version {version} -> {version + 1}: loss {m.get('loss', 0.0):.6f}{run}, {m['seconds']:.1f} s")
    return checkpoint.export_hf(trainer.engine, out / "hf", found[-1][0] + 1, tokenizer=trainer.tokenizer)
