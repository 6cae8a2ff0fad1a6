"""`dapo-mesh compare`: runs grouped into arms by their config.json (seed and run_dir aside), the arms' means and
standard errors, Welch's difference, wall time and time to gain, the keys that differ; runs made before config.json;
the checked-in DAPO-vs-GRPO runs give ablate.json's numbers; the command line."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest

from mesh.compare import NotARun, flatten, response_lengths, truncated_fractions
from mesh.compare_report import compare

DOCS = Path(__file__).resolve().parents[3] / "docs"
CONFIGS = DOCS.parent / "configs"
START = 1_000.0  # unix time the synthetic runs start


def write_run(
    run_dir: Path,
    evals: list[tuple[int, float, float]],  # (version, avg@k, pass@k), every 2 versions: 10 minutes apart
    *,
    config: dict[str, Any] | None = None,
    preset: str | None = "configs/dapo.toml",
    wall_s: float | None = None,
    stamped: bool = True,
    entropy: float = 0.0,
    truncated: bool = False,
) -> Path:
    """A run as the mesh writes it: metrics.jsonl (train rows: token entropy 2 − 0.4·step + `entropy`, 10 + step
    response tokens per sample, in batches of the config's 32 or, with `truncated`, of a recorded 16 samples, a share
    0.1·(4 − step) of them cut at the length bound; eval rows stamped
    with eval_at unless not `stamped`), config.json when `config`, cpu.json when `wall_s`."""
    run_dir.mkdir(parents=True)
    rows: list[dict[str, Any]] = [
        {"kind": "train", "step": v, "policy_version": v, "reward_mean": v / 10, "seconds": 10.0}
        | {"entropy": 2.0 - 0.4 * v + entropy, "samples_trained": 32.0 * (v + 1)}
        | {"response_tokens": (16.0 if truncated else 32.0) * (10 + v)}
        | ({"truncated_frac": 0.1 * (4 - v), "batch_samples": 16.0} if truncated else {})
        for v in (1, 2, 3, 4)
    ]
    for v, acc, pass_k in evals:  # the first evaluation takes 60 s from the start; then one every 10 minutes
        stamp = {"eval_at": START + 60 + v * 300 - (60 if v else 0)} if stamped else {}
        rows.append(
            {
                "kind": "eval",
                "step": v,
                "policy_version": v,
                "eval_acc": acc,
                "eval_pass_at_k": pass_k,
                "eval_k": 4,
                "eval_seconds": 60.0,
                **stamp,
            }
        )
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if config is not None:
        (run_dir / "config.json").write_text(json.dumps({"preset": preset, "config": config}))
    if wall_s is not None:
        (run_dir / "cpu.json").write_text(json.dumps({"wall_s": wall_s, "orchestrator_s": 1.0}))
    return run_dir


def config(run_dir: Path, seed: int, clip_high: float) -> dict[str, Any]:
    return {
        "steps": 4,
        "seed": seed,
        "run_dir": str(run_dir),
        "lr": 1e-6,
        "batch_size": 4,  # groups of n_samples: 32 samples a batch (what the lengths of runs before batch_samples use)
        "n_samples": 8,
        "dataset": "reasoning_gym:chain_sum",
        "learner": {"clip_high": clip_high, "clip_low": 0.2},
        "buffer": {"max_staleness": 1},
        "rollout": {"replica_id": f"host-{1000 + seed}"},  # as config.json holds it: a new one every run
    }


ARM_A = {1: (0.25, 0.40, 0.5), 2: (0.31, 0.44, 0.6), 3: (0.38, 0.36, 0.7)}  # seed: (avg@k at v2, final, final pass@k)
ARM_B = {1: (0.20, 0.30, 0.4), 2: (0.22, 0.34, 0.5)}


def synthetic(root: Path, preset: str | None = "configs/dapo.toml") -> list[Path]:
    """Arm A (clip_high 0.28, seeds 1-3, cpu.json), arm B (clip_high 0.2, seeds 1-2, no cpu.json), and an old run
    without config.json or timestamps."""
    runs = []
    for arm, clip, seeds in (("a", 0.28, ARM_A), ("b", 0.2, ARM_B)):
        for seed, (mid, final, pass_k) in seeds.items():
            d = root / f"{arm}-seed{seed}"
            evals = [(0, 0.10, 0.2), (2, mid, 0.3), (4, final, pass_k)]
            wall = 1200 + 60 * seed if arm == "a" else None
            shift = 0.1 * seed if arm == "a" else 0.0
            cfg, cut = config(d, seed, clip), arm == "a"
            runs.append(write_run(d, evals, config=cfg, preset=preset, wall_s=wall, entropy=shift, truncated=cut))
    runs.append(
        write_run(root / "old-seed7", [(0, 0.1, 0.2), (2, 0.15, 0.2), (4, 0.2, 0.3)], wall_s=120, stamped=False)
    )
    return runs


def test_arms_their_means_standard_errors_welch_and_times(tmp_path: Path) -> None:
    c = compare(synthetic(tmp_path / "runs"), tmp_path / "out", gain=0.2)
    a, b, old = c.arms
    assert [x.label for x in c.arms] == ["dapo (learner.clip_high=0.28)", "dapo (learner.clip_high=0.2)", "old"]
    assert a.seeds == [1, 2, 3] and b.seeds == [1, 2] and old.seeds == [7]
    assert a.final == pytest.approx((0.40, 0.04 / math.sqrt(3)))  # std of .40 .44 .36 = 0.04
    assert b.final == pytest.approx((0.32, 0.02))  # std of .30 .34 = 0.0283, /√2
    assert a.best == pytest.approx(
        (statistics.fmean([0.40, 0.44, 0.38]), statistics.stdev([0.40, 0.44, 0.38]) / 3**0.5)
    )
    assert a.pass_at_k == pytest.approx((0.6, 0.1 / math.sqrt(3)))
    assert a.diff is None and b.diff == pytest.approx((-0.08, math.sqrt(0.04**2 / 3 + 0.02**2 * 2 / 2)))
    assert old.diff is not None and math.isnan(old.final[1]) and math.isnan(old.diff[1])  # one seed: no spread
    # wall: cpu.json's (1260, 1320, 1380 s); without it, the evaluations' span from the first one's start
    assert a.wall_min == pytest.approx(22.0) and b.wall_min == pytest.approx(20.0) and old.wall_min == 2.0
    # +0.20 over 0.10: seed 1 at v4 (20 min), seeds 2 and 3 at v2 (10 min); B's 0.30 - 0.10 counts (floats: 0.19999…)
    assert (a.to_gain_min, a.reached) == (pytest.approx(40 / 3), 3) and (b.to_gain_min, b.reached) == (20.0, 2)
    assert (old.to_gain_min, old.reached) == (None, 0) and a.versions == (4, 4)
    # the old run has no timestamps: the learner's 10 s per step stretched to 120 s of wall time, 3x
    assert [e.minutes for e in old.runs[0].evals] == pytest.approx([0.0, 1.0, 2.0]) and old.runs[0].clock == "scaled"
    assert c.differs == {"learner.clip_high": [0.28, 0.2, "?"]}  # seed and run_dir differ too, within arms
    md = (tmp_path / "out" / "compare.md").read_text()
    assert (
        "| learner.clip_high | 0.28 | 0.2 | ? |" in md and "| final held-out avg@4 (mean ± se) | 0.400 ± 0.023 |" in md
    )
    assert "| final − dapo (learner.clip_high=0.28) (± Welch se) | — | -0.080 ± 0.031 | -0.200 ± — |" in md
    assert "| time to +0.20 avg@4 over the first eval | 13.3 min (3 of 3) | 20.0 min (2 of 2) | not reached |" in md
    # token entropy 1.6, 1.2, 0.8, 0.4 over steps 1-4, thirds [1] [2 3] [4], arm A's seeds shifted by 0.1, 0.2, 0.3
    assert [x for pair in a.entropy_thirds for x in pair] == pytest.approx(
        [1.8, 0.1 / 3**0.5, 1.2, 0.1 / 3**0.5, 0.6, 0.1 / 3**0.5]
    )
    assert b.runs[0].entropy_thirds == pytest.approx((1.6, 1.0, 0.4))
    assert "| token entropy in each third of the steps | 1.80 / 1.20 / 0.60 | 1.60 / 1.00 / 0.40 |" in md
    # 11-14 response tokens per sample over steps 1-4 (A over batch_samples, B over its config's 4 x 8, never over
    # the buffer's running count): thirds 11, 12.5, 14; the old run has neither; cut at the bound only where recorded
    assert a.runs[0].length_thirds == b.runs[0].length_thirds == pytest.approx((11.0, 12.5, 14.0))
    assert old.runs[0].length_thirds == ()
    rows = [{"response_tokens": 320.0}]  # groups of variable size and no batch_samples: no length, not a wrong one
    assert response_lengths(rows, {"batch_size": 4, "n_samples": 8, "buffer.sampling_rule": "signal"}) == ()
    assert response_lengths(rows, {"batch_size": 4, "n_samples": 8, "buffer.sampling_rule": "fixed"}) == (10.0,)
    assert [m for m, _ in a.truncated_thirds] == pytest.approx([0.3, 0.15, 0.0]) and b.runs[0].truncated_thirds == ()
    assert "| response tokens per trained sample, each third | 11 / 12 / 14 | 11 / 12 / 14 | — |" in md
    assert "| trained samples cut at the length bound, each third | 0.300 / 0.150 / 0.000 | — |" in md
    saved = json.loads((tmp_path / "out" / "compare.json").read_text())
    assert saved["arms"][1]["diff"] == pytest.approx({"mean": -0.08, "se": 0.030550504633})
    assert saved["arms"][2]["final"]["se"] is None and saved["arms"][0]["runs"][0]["minutes_to_gain"] == 20.0
    assert (tmp_path / "out" / "compare.png").stat().st_size > 10_000


def test_time_to_gain_from_a_base_every_run_shares(tmp_path: Path) -> None:
    """--base: the gain counts from one held-out value, not each run's first evaluation (which, run beside training,
    holds later versions' tokens): +0.30 over 0 is the first evaluation at 0.30 or more."""
    runs = synthetic(tmp_path / "runs")
    c = compare(runs, tmp_path / "out", gain=0.30, base=0.0)
    a, b, old = c.arms
    # 0.30 or more: A's seed 1 at v4 (20 min; 0.25 at v2), seeds 2 and 3 at v2 (10 min: 0.31, 0.38); B's at v4
    assert [r.minutes_to(0.30, 0.0) for r in a.runs] == [20.0, 10.0, 10.0]
    assert (a.to_gain_min, a.reached) == (pytest.approx(40 / 3), 3) and (b.to_gain_min, b.reached) == (20.0, 2)
    assert (old.to_gain_min, old.reached) == (None, 0) and c.base == 0.0
    # from each run's first evaluation (0.10) the same +0.30 waits for 0.40: seed 3 (best 0.38) never gets there
    assert [r.minutes_to(0.30) for r in a.runs] == [20.0, 20.0, None]
    md = (tmp_path / "out" / "compare.md").read_text()
    assert "| time to +0.30 avg@4 over 0 |" in md
    assert json.loads((tmp_path / "out" / "compare.json").read_text())["base"] == 0.0


def test_labels_without_a_preset_say_what_differs_and_one_arm_has_nothing_to(tmp_path: Path) -> None:
    c = compare(synthetic(tmp_path / "runs", preset=None)[:5], None, gain=0.5)
    assert [a.label for a in c.arms] == ["learner.clip_high=0.28", "learner.clip_high=0.2"]
    assert c.arms[0].to_gain_min is None and not (tmp_path / "out").exists()
    one = compare(synthetic(tmp_path / "one")[:3], None, gain=0.2)
    assert [a.label for a in one.arms] == ["dapo"] and one.differs == {}


def test_the_presets_resolved_configs_differ_in_what_the_presets_set(tmp_path: Path) -> None:
    from mesh.config import MeshConfig

    runs = []
    for preset in ("dapo", "grpo"):  # config.json as `dapo-mesh up` writes it (Mesh.write_config)
        for seed in (1, 2):
            cfg = MeshConfig.from_preset(CONFIGS / f"{preset}.toml", run_dir=tmp_path / f"{preset}{seed}", seed=seed)
            dump = cfg.model_dump(mode="json", exclude={"redis_url"})
            runs.append(write_run(cfg.run_dir, [(0, 0.1, 0.2)], config=dump, preset=f"configs/{preset}.toml"))
    c = compare(runs, None)
    assert [a.label for a in c.arms] == ["dapo", "grpo"] and c.differs["learner.clip_high"] == [0.28, 0.2]
    assert "buffer.dynamic_sampling" in c.differs and not {"seed", "run_dir", "steps"} & set(c.differs)


def test_a_run_made_before_a_setting_existed_ran_as_its_default(tmp_path: Path) -> None:
    """A setting added since a run was made is absent from its config.json: the run is the same arm as one made
    after with that setting at its default (new settings keep the old behaviour), another arm than one without."""
    from mesh.config import MeshConfig

    runs = []
    for name, seed, give_up_by in (("old", 1, None), ("new", 2, "history"), ("cost", 1, "cost")):
        cfg = MeshConfig.from_preset(CONFIGS / "dapo.toml", run_dir=tmp_path / f"{name}-seed{seed}", seed=seed)
        dump = cfg.model_dump(mode="json", exclude={"redis_url"})
        if give_up_by is None:  # as written before the setting existed
            del dump["buffer"]["sampling_give_up_by"], dump["buffer"]["sampling_explore"]
        else:
            dump["buffer"]["sampling_give_up_by"] = give_up_by
        runs.append(write_run(cfg.run_dir, [(0, 0.1, 0.2)], config=dump, preset="configs/dapo.toml"))
    c = compare(runs, None)
    assert [a.seeds for a in c.arms] == [[1, 2], [1]]
    assert c.differs == {"buffer.sampling_give_up_by": ["history", "cost"]}


def test_flatten_and_a_directory_that_is_not_a_run(tmp_path: Path) -> None:
    assert flatten({"seed": 1, "learner": {"clip_high": 0.28, "x": {"y": [1]}}}) == {
        "seed": 1,
        "learner.clip_high": 0.28,
        "learner.x.y": [1],
    }
    with pytest.raises(NotARun, match=str(tmp_path)):
        compare([tmp_path], None)


def test_the_checked_in_ablation_gives_ablate_json_numbers(tmp_path: Path) -> None:
    runs = [DOCS / "ablate" / f"{p}-seed{s}" for p in ("dapo", "grpo") for s in (1, 2, 3)]
    c = compare(runs, tmp_path, gain=0.2)
    table = json.loads((DOCS / "ablate" / "ablate.json").read_text())
    for arm in c.arms:
        finals = [r["final"] for r in table if r["preset"] == arm.label]
        assert arm.seeds == [1, 2, 3] and arm.final == pytest.approx(
            (statistics.fmean(finals), statistics.stdev(finals) / 3**0.5)
        )
        assert arm.best[0] == pytest.approx(statistics.fmean(r["best"] for r in table if r["preset"] == arm.label))
    assert [a.label for a in c.arms] == ["dapo", "grpo"] and c.arms[1].diff == pytest.approx(
        (-0.039167, 0.026), abs=5e-4
    )
    assert c.arms[0].wall_min == pytest.approx(28.93, abs=0.01) and c.arms[0].versions == (45, 45)
    assert (tmp_path / "compare.png").stat().st_size > 10_000


def test_the_command_line(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from mesh.cli import app

    runs = [str(p) for p in synthetic(tmp_path / "runs")]
    r = CliRunner().invoke(app, ["compare", *runs, "--out", str(tmp_path / "out"), "--gain", "0.25", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["gain"] == 0.25 and [a["reached"] for a in data["arms"]] == [3, 0, 0]
    assert (tmp_path / "out" / "compare.md").exists()
    r = CliRunner().invoke(app, ["compare", *runs[:2]])
    assert r.exit_code == 0 and "learner.clip_high" not in r.output and "0.420 ± 0.020" in " ".join(r.output.split())
    r = CliRunner().invoke(app, ["compare", runs[0], str(tmp_path)])
    assert r.exit_code == 2 and "no metrics.jsonl" in " ".join(w for w in r.output.split() if w != "│")


def test_generated_per_trained_whole_and_after_the_first_pass() -> None:
    """From the buffer's sample counts (groups sampled in rounds differ in size), else from its group counts; after
    the first pass: from the first step the dispatch cursor was in epoch 1."""
    from mesh.compare import generated_per_trained

    rows = [
        {"samples_generated": 100, "samples_trained": 32, "groups_received": 50, "groups_kept": 4, "epoch": 0},
        {"samples_generated": 200, "samples_trained": 64, "groups_received": 90, "groups_kept": 8, "epoch": 1},
        {"samples_generated": 260, "samples_trained": 96, "groups_received": 99, "groups_kept": 12, "epoch": 1},
    ]
    assert generated_per_trained(rows) == (260 / 96, 60 / 32)
    old = [{k: v for k, v in r.items() if not k.startswith("samples")} for r in rows]
    assert generated_per_trained(old) == (99 / 12, 9 / 4)
    assert all(math.isnan(x) for x in generated_per_trained([{"groups_received": 5}]))
    assert all(math.isnan(x) for x in generated_per_trained([]))
    one_pass = generated_per_trained(rows[:1])
    assert one_pass[0] == 100 / 32 and math.isnan(one_pass[1])  # never past the first pass


def test_generated_tokens_per_trained_token() -> None:
    """The replicas' generated tokens at the last step that knows them, over every trained response token up to it;
    NaN for a run from before the count."""
    from mesh.compare import generated_tokens_per_trained

    rows = [
        {"response_tokens": 1000.0, "tokens_generated": 2500.0},
        {"response_tokens": 800.0, "tokens_generated": 5400.0},
        {"response_tokens": 700.0},  # the replicas' scrape missed this step
    ]
    assert generated_tokens_per_trained(rows) == 5400.0 / 1800.0
    assert math.isnan(generated_tokens_per_trained([{"response_tokens": 10.0}]))
    assert math.isnan(generated_tokens_per_trained([]))


def test_generated_per_trained_in_each_third_of_the_steps() -> None:
    """The same steps of two runs side by side: each span's growth in samples generated over samples trained."""
    from mesh.compare import generated_per_trained_by_part

    gen = [30, 60, 80, 120, 170, 230]
    rows = [{"samples_generated": g, "samples_trained": 10 * (i + 1)} for i, g in enumerate(gen)]
    assert generated_per_trained_by_part(rows, 3) == (60 / 20, 60 / 20, 110 / 20)
    old = [{"groups_received": g, "groups_kept": 4 * (i + 1)} for i, g in enumerate(gen)]
    assert generated_per_trained_by_part(old, 2) == (80 / 12, 150 / 12)
    assert generated_per_trained_by_part(rows[:2], 3) == () and generated_per_trained_by_part([], 3) == ()


def test_the_mean_of_each_part_cuts_where_the_thirds_of_the_steps_are_cut() -> None:
    from mesh.compare import parts_mean

    assert parts_mean([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 3) == (1.5, 3.5, 5.5)
    assert parts_mean([3.0, 1.0, 2.0, 6.0, 5.0], 2) == (2.0, 13 / 3)  # cuts at round(2.5) = 2: [3 1] [2 6 5]
    assert parts_mean([1.0, 2.0], 3) == ()


def test_each_runs_machine_is_named_so_that_times_are_compared_within_one(tmp_path: Path) -> None:
    from mesh.compare_report import markdown

    runs = synthetic(tmp_path / "runs")[:2]
    cost = json.loads((runs[0] / "cpu.json").read_text())
    cost["machine"] = {"cpu": "AMD EPYC", "cores": 2, "bf16": ["avx512_bf16"]}
    (runs[0] / "cpu.json").write_text(json.dumps(cost))
    c = compare(runs, None)
    assert [r.machine for r in c.arms[0].runs] == ["AMD EPYC, 2 cores, avx512_bf16", None]
    line = next(x for x in markdown(c).splitlines() if x.startswith("Machines"))
    assert "AMD EPYC, 2 cores, avx512_bf16: a-seed1" in line and "not recorded" in line and "a-seed2" in line
    assert not any(x.startswith("Machines") for x in markdown(compare(synthetic(tmp_path / "old"), None)).splitlines())


def test_the_truncated_share_is_left_out_unless_every_step_recorded_it() -> None:
    """A run resumed across the day the learner began recording `truncated_frac` would split only its later steps
    into thirds, as if they were the whole run: it reads `—` instead."""
    steps = [{"step": s} | ({"truncated_frac": 0.5} if s > 3 else {}) for s in range(1, 7)]
    assert truncated_fractions(steps) == ()
    assert truncated_fractions([r | {"truncated_frac": 0.25} for r in steps]) == (0.25,) * 6
    assert truncated_fractions([]) == ()


def test_one_part_of_a_mixtures_held_out_split(tmp_path: Path) -> None:
    """--task: the held-out numbers of one part (eval_acc/<task>), its time to gain, the labels say which; a task
    the evaluations do not name is refused with the ones they do."""
    from typer.testing import CliRunner

    from mesh.cli import app

    runs = []
    for seed, (easy, hard) in {1: (0.5, 0.0), 2: (0.7, 0.02)}.items():  # the final evaluation's two parts
        d = write_run(tmp_path / f"mix-seed{seed}", [(0, 0.05, 0.2), (2, 0.2, 0.3), (4, (easy + hard) / 2, 0.4)])
        rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
        parts = {0: (0.1, 0.0), 2: (0.4, 0.0), 4: (easy, hard)}
        for r in rows:
            if r["kind"] == "eval":
                e, h = parts[r["policy_version"]]
                r |= {"eval_acc/reasoning_gym/basic_arithmetic": e, "eval_acc/reasoning_gym/chain_sum": h}
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        runs.append(d)
    whole = compare(runs, None, gain=0.25)
    assert whole.arms[0].final == pytest.approx((0.305, 0.055)) and whole.arms[0].reached == 1  # seed 2 at v4
    part = compare(runs, tmp_path / "out", gain=0.25, task="reasoning_gym/basic_arithmetic")
    a = part.arms[0]
    assert a.final == pytest.approx((0.6, 0.1)) and a.best == pytest.approx((0.6, 0.1))
    assert math.isnan(a.pass_at_k[0]) and a.reached == 2 and a.to_gain_min == pytest.approx(10.0)  # 0.4 at v2
    assert compare(runs, None, gain=0.25, task="reasoning_gym/chain_sum").arms[0].reached == 0
    md = (tmp_path / "out" / "compare.md").read_text()
    assert "final held-out avg@4 of reasoning_gym/basic_arithmetic" in md
    assert json.loads((tmp_path / "out" / "compare.json").read_text())["task"] == "reasoning_gym/basic_arithmetic"
    with pytest.raises(NotARun, match="basic_arithmetic, reasoning_gym/chain_sum"):
        compare(runs, None, task="reasoning_gym/leg_counting")
    r = CliRunner().invoke(app, ["compare", *map(str, runs), "--task", "reasoning_gym/leg_counting"])
    assert r.exit_code == 2 and "no held-out accuracy" in " ".join(w for w in r.output.split() if w != "│")
