"""`dapo-mesh replay`: train a run's recorded batches again, offline, in the same order, and write the weights.

    dapo-mesh replay --batches RUN_DIR --model-dir M --out OUT [--nproc N] [--zero-stage K] [--dtype fp32]

RUN_DIR is a learner's run dir (or a mesh run dir: its learner/) whose learner ran with --record-batches
(learner/record.py); M is the model the run started from (for a run recorded from version v > 0: the snapshot
of version v; a LoRA run's replay starts at version 0 from the base model, the adapter drawn from the recorded
--seed). Each batch is trained at the version it was trained at in the run (the LR schedule, the mini-batch
shuffle and the gap metrics depend on it) with the recorded update settings; with the same dtype, ZeRO stage and
threads the weights come out as the run's (tested: bit for bit on one process). A run can thus be reproduced,
bisected (`--until V`), and its updates debugged with the recorded inputs. The HF snapshot goes to OUT/hf/v<last>.

`--nproc N` trains on N data-parallel ranks (torchrun, gloo on CPUs; learner/parallel.py): the same updates as one
rank up to the order of float sums (tested within 1e-5 in fp32 at ZeRO 0 and 3).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from learner import checkpoint
from learner.parallel import barrier, check_ranks, exit_rank, shutdown, world
from learner.record import batches_dir, load_batch, read_settings, recorded
from learner.settings import LearnerSettings
from services.ledger import read_ledger
from services.snapshots import latest_snapshot


def replay(
    batches: Path,
    model_dir: Path,
    out: Path,
    *,
    zero_stage: int | None = None,
    dtype: str | None = None,
    until: int | None = None,
    nproc: int = 1,
    say: Callable[[str], None] = print,
) -> Path:
    """Train the recorded batches (those trained at versions < `until`, if given); the final HF snapshot's path."""
    d = batches_dir(batches)
    found = [(v, p) for v, p in recorded(d) if until is None or v < until]
    if not found:
        raise ValueError(f"no recorded batch before version {until}")
    settings = read_settings(d)
    if settings.get("lora_rank") and found[0][0] > 0:
        raise ValueError(
            f"the recording starts at version {found[0][0]} of a LoRA run: a replay trains a fresh adapter from the "
            "base model, so it needs the batches from version 0"
        )
    first = load_batch(found[0][1])
    size = nproc if world()[1] == 1 else world()[1]
    check_ranks(sum(len(g.samples) for g in first.groups), int(settings["minibatches"]), size)
    if size > 1 and world()[1] == 1:  # start the ranks; each runs this function inside its world
        return _launch(batches, model_dir, out, nproc, zero_stage=zero_stage, dtype=dtype, until=until)
    return _train(d, found, settings, model_dir, out, zero_stage=zero_stage, dtype=dtype, say=say)


def _train(
    d: Path,
    found: list[tuple[int, Path]],
    settings: dict[str, Any],
    model_dir: Path,
    out: Path,
    *,
    zero_stage: int | None,
    dtype: str | None,
    say: Callable[[str], None],
) -> Path:
    from learner.trainer import Trainer

    given: dict[str, Any] = {"model_dir": model_dir, "run_dir": out, "weight_sync": "none", "hf_export": False}
    given |= {k: v for k, v in (("zero_stage", zero_stage), ("dtype", dtype)) if v is not None}
    s = LearnerSettings.model_validate(settings | given)
    logged = {e.version: e.metrics for e in read_ledger(d.parent)}  # the last training of each version
    trainer = Trainer(s)
    if trainer.rank != 0:
        say = _quiet
    say(
        f"replaying {len(found)} batches (versions {found[0][0]}..{found[-1][0]}) from {d} on {model_dir}"
        + (f", {trainer.world} ranks" if trainer.world > 1 else "")
    )
    for version, path in found:
        m = trainer.train(load_batch(path), version=version)
        was = logged.get(version + 1, {}).get("loss")
        run = "" if was is None else f" (in the run: {was:.6f})"
        say(f"version {version} -> {version + 1}: loss {m.get('loss', 0.0):.6f}{run}, {m['seconds']:.1f} s")
    return checkpoint.export_hf(
        trainer.engine, out / "hf", found[-1][0] + 1, tokenizer=trainer.tokenizer, adapter=trainer.adapter
    )


def _quiet(_: str) -> None:
    pass


def _launch(batches: Path, model_dir: Path, out: Path, nproc: int, **options: Any) -> Path:
    """torchrun with `nproc` ranks on this machine, each running `python -m learner.replay`."""
    from services.child_process import ROOT, child_env

    args = ["--batches", str(batches), "--model-dir", str(model_dir), "--out", str(out)]
    args += [a for k, v in options.items() if v is not None for a in (f"--{k.replace('_', '-')}", str(v))]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "learner.replay",
        *args,
    ]
    done = subprocess.run(cmd, env=child_env(), cwd=ROOT, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the replay's ranks failed (exit {done.returncode})")
    newest = latest_snapshot(out / "hf")
    if newest is None:
        raise RuntimeError(f"the replay's ranks exported no snapshot under {out / 'hf'}")
    return newest.path


def main(argv: list[str] | None = None) -> None:
    """One rank of a multi-rank replay (started by `_launch` under torchrun)."""
    p = argparse.ArgumentParser(prog="python -m learner.replay")
    p.add_argument("--batches", type=Path, required=True)
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--zero-stage", type=int)
    p.add_argument("--dtype")
    p.add_argument("--until", type=int)
    a = p.parse_args(argv)
    from learner.trainer import init_distributed

    init_distributed()
    try:
        replay(a.batches, a.model_dir, a.out, zero_stage=a.zero_stage, dtype=a.dtype, until=a.until)
        barrier()  # rank 0 exports last: no rank tears down while another still works
    finally:
        shutdown()
    exit_rank()


if __name__ == "__main__":
    main()
