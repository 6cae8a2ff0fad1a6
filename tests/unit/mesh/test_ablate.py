"""The ablation's bookkeeping: runs read from their metrics.jsonl, means, deviations, the difference and its
standard error, the table; a complete run is not run again. And the seeds a mesh config hands its services."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from mesh.ablate import RunResult, ablate, markdown, read_run, run_dir_of, summarize
from mesh.config import MeshConfig
from mesh.layout import RunLayout
from rollout.engines import SamplingParams
from rollout.replica import seeded

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def write_metrics(run_dir: Path, evals: list[tuple[int, float]]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    rows = [{"kind": "train", "step": 1, "policy_version": 1, "reward_mean": 0.0}]
    rows += [{"kind": "eval", "step": v, "policy_version": v, "eval_acc": a} for v, a in evals]
    RunLayout(run_dir).metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_read_run(tmp_path: Path) -> None:
    assert read_run(tmp_path) is None
    write_metrics(tmp_path, [(9, 0.3), (0, 0.1), (18, 0.25)])
    assert read_run(tmp_path) == (0.25, 0.3, 18)  # final = the newest version's, best over all


def test_summary_and_the_difference_with_its_standard_error() -> None:
    runs = [RunResult("dapo", s, f, f + 0.05, 45) for s, f in ((1, 0.40), (2, 0.44), (3, 0.36))]
    runs += [RunResult("grpo", s, f, f, 45) for s, f in ((1, 0.30), (2, 0.31), (3, 0.35))]
    rows, diffs = summarize(runs)
    assert [r.preset for r in rows] == ["dapo", "grpo"] and rows[0].seeds == [1, 2, 3]
    assert rows[0].final_mean == pytest.approx(0.40) and rows[0].final_std == pytest.approx(0.04)
    assert rows[1].final_mean == pytest.approx(0.32) and rows[0].best_mean == pytest.approx(0.45)
    s2 = ((0.30 - 0.32) ** 2 + (0.31 - 0.32) ** 2 + (0.35 - 0.32) ** 2) / 2
    assert diffs[0].diff == pytest.approx(0.08) and diffs[0].stderr == pytest.approx(math.sqrt(0.04**2 / 3 + s2 / 3))
    table = markdown(runs)
    assert "| **dapo** | mean ± std over 3 | **0.400 ± 0.040** |" in table and "dapo − grpo: +0.080 ±" in table


def test_ablate_runs_what_is_missing_and_resumes(tmp_path: Path) -> None:
    presets = [CONFIGS / "dapo.toml", CONFIGS / "grpo.toml"]
    ran: list[tuple[str, int | None, int]] = []

    def fake_run(cfg: MeshConfig) -> None:  # the mesh is not under test here: it writes what a run writes
        ran.append((cfg.run_dir.name, cfg.seed, cfg.steps))
        write_metrics(cfg.run_dir, [(0, 0.1), (cfg.steps, [0.0, 0.21, 0.22][cfg.seed or 0])])

    write_metrics(run_dir_of(tmp_path, presets[0], 1), [(0, 0.1), (4, 0.5)])  # already complete
    results = ablate(presets, [1, 2], tmp_path, steps=4, say=lambda _: None, run=fake_run)
    assert ran == [("dapo-seed2", 2, 4), ("grpo-seed1", 1, 4), ("grpo-seed2", 2, 4)]
    assert [(r.preset, r.seed, r.final) for r in results] == [("dapo", 1, 0.5), ("dapo", 2, 0.22), ("grpo", 1, 0.21),
                                                              ("grpo", 2, 0.22)]  # fmt: skip
    assert (tmp_path / "ablate.md").read_text().startswith("| preset | seed |")
    assert (tmp_path / "ablate.png").stat().st_size > 10_000  # every run's held-out curve, each preset's mean
    assert len(json.loads((tmp_path / "ablate.json").read_text())) == 4
    compared = (tmp_path / "compare.md").read_text()  # and `dapo-mesh compare` of the four runs
    assert "| seeds | 1, 2 | 1, 2 |" in compared and (tmp_path / "compare.png").stat().st_size > 10_000


def test_seeded_sampling_is_repeatable_per_call() -> None:
    p = SamplingParams(temperature=1.0, max_tokens=8)
    assert seeded(p, None, ["a"]) is p
    a, b = seeded(p, 7, ["t1", "t2"]), seeded(p, 7, ["t1", "t2"])
    assert a == b and a.seed is not None and 0 <= a.seed < 2**31
    assert seeded(p, 7, ["t1", "t3"]).seed != a.seed and seeded(p, 8, ["t1", "t2"]).seed != a.seed


def test_waste_over_the_run_and_after_the_first_pass(tmp_path: Path) -> None:
    from mesh.ablate import read_waste

    assert read_waste(tmp_path) is None
    rows = [{"kind": "train", "groups_received": 10, "groups_kept": 3, "epoch": 0},
            {"kind": "train", "groups_received": 40, "groups_kept": 10, "epoch": 1},  # the first pass is over
            {"kind": "eval", "eval_acc": 0.3},
            {"kind": "train", "groups_received": 60, "groups_kept": 25, "epoch": 2},
            {"kind": "train", "groups_received": float("nan"), "groups_kept": 26}]  # fmt: skip
    tmp_path.mkdir(exist_ok=True)
    RunLayout(tmp_path).metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    w = read_waste(tmp_path)
    assert w is not None
    assert w.filtered == pytest.approx(1 - 25 / 60) and w.generated_per_trained == pytest.approx(60 / 25)
    assert w.later_filtered == pytest.approx(1 - 15 / 20) and w.later_generated_per_trained == pytest.approx(20 / 15)
    table = markdown([RunResult("curriculum", 1, 0.4, 0.45, 45, w)])
    assert "58% (25%)" in table and "2.40 (1.33)" in table
