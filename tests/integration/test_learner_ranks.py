"""Data-parallel learner ranks (learner/parallel.py): N ranks take the step one rank takes.

Real DeepSpeed on CPU (gloo), real torchrun: the same recorded batches replayed with 1 and with 2 ranks give the
same weights within 1e-5 (fp32) at ZeRO 0 and ZeRO 3. The batches are ragged (4 prompt lengths, 4 response
lengths) and a mini-batch's 3 micro-batches split 2 + 1 over the ranks, so the ranks hold different token counts
and one of them runs a zero-weighted micro-batch: a rank normalising by its own tokens, not the mini-batch's (the
count every rank has, since each holds the whole batch), moves the weights ~1e-2 away (checked), and a missing
x world size halves every update."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from learner.record import record_batch, record_settings
from learner.settings import LearnerSettings
from learner.tiny import group, tiny_llama
from services.common.launch import ROOT, child_env
from services.common.schemas import TrainBatch


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("ranks")
    model = tiny_llama(root / "model")
    s = LearnerSettings(model_dir=model, run_dir=root / "run", minibatches=2, micro_batch_size=3, micro_batch_tokens=0,
                        lr=1e-3, warmup_batches=0, dtype="fp32", seed=3, off_policy="token-tis")  # fmt: skip
    record_settings(root / "run", s)
    for b in range(3):  # 4 groups x 4 samples: 8 rows per mini-batch, micro-batches of 3, 3, 2 rows
        groups = [group(b * 10 + i, [1.0, -1.0, 1.0, -0.5], prompt_len=3 + 2 * i, resp_len=4 + 5 * i) for i in range(4)]
        record_batch(root / "run", b, TrainBatch.assemble(b, groups))
    return model, root / "run"


def replay(model: Path, run: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "services.mesh", "replay", "--batches", str(run), "--model-dir", str(model),
           "--out", str(out), *extra]  # fmt: skip
    return subprocess.run(cmd, env=child_env(OMP_NUM_THREADS="1"), cwd=ROOT, capture_output=True, text=True,
                          timeout=300)  # fmt: skip


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "hf" / "v000003" / "model.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize("zero", ["0", "3"])
def test_two_ranks_take_the_step_of_one(recorded_run: tuple[Path, Path], tmp_path: Path, zero: str) -> None:
    model, run = recorded_run
    one = replay(model, run, tmp_path / "one", "--zero-stage", zero)
    two = replay(model, run, tmp_path / "two", "--zero-stage", zero, "--nproc", "2")
    assert one.returncode == 0, one.stdout + one.stderr
    assert two.returncode == 0, two.stdout + two.stderr
    assert "2 ranks" in two.stdout
    losses = [line.split("loss ")[1].split(",")[0] for line in one.stdout.splitlines() if "loss" in line]
    assert len(losses) == 3 and losses == [ln.split("loss ")[1].split(",")[0] for ln in two.stdout.splitlines()
                                           if "loss" in ln]  # fmt: skip  # the loss metric is the whole batch's
    a, b, base = weights(tmp_path / "one"), weights(tmp_path / "two"), load_file(model / "model.safetensors")
    assert a.keys() == b.keys()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
    assert max(float((a[k] - base[k]).abs().max()) for k in base) > 1e-3  # the updates moved the weights


def test_more_ranks_than_samples_per_minibatch_is_a_clear_error(recorded_run: tuple[Path, Path],
                                                                tmp_path: Path) -> None:  # fmt: skip
    model, run = recorded_run
    done = replay(model, run, tmp_path / "out", "--nproc", "9")
    assert done.returncode == 2, done.stdout + done.stderr
    text = " ".join((done.stdout + done.stderr).split())
    assert "9 learner ranks but 8 samples per mini-batch" in text and "minibatches" in text
    assert not (tmp_path / "out").exists()  # refused before any rank started
