"""The shipped presets: every key exists and validates; DAPO and GRPO differ in exactly the paper's switches;
the ablation files climb Table 1 one technique at a time and end at configs/dapo.toml."""

from __future__ import annotations

from pathlib import Path

import pytest

from mesh.config import MeshConfig, PresetError, load_preset, read_preset, to_flags

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
SWITCHES = {  # DAPO's techniques, as (section, key): GRPO value, DAPO value
    ("learner", "clip_high"): (0.2, 0.28),
    ("learner", "loss_agg"): ("seq-mean-token-mean", "token-mean"),
    ("buffer", "dynamic_sampling"): (False, True),
    ("reward", "overlong_shaping"): (False, True),
}
LADDER = ["2-overlong-filter", "3-clip-higher", "4-soft-overlong", "5-token-loss", "6-dynamic-sampling"]


def flat(path: Path) -> dict[tuple[str, str], object]:
    return {(sec, k): v for sec, values in read_preset(path).items() for k, v in values.items()}


@pytest.mark.parametrize("path", sorted(CONFIGS.rglob("*.toml")), ids=lambda p: p.name)
def test_every_preset_loads_and_validates(path: Path) -> None:
    preset = load_preset(path)
    cfg = MeshConfig.from_preset(path, run_dir=Path("/tmp/x"))
    assert cfg.steps == preset.mesh["steps"]
    for name, values in preset.services.items():  # every section as the file says, typed by its service's class
        assert cfg.section(name) == values, name  # type: ignore[arg-type]
        assert all(getattr(getattr(cfg, name), k) == v for k, v in values.items())


def test_dapo_and_grpo_differ_in_exactly_the_papers_switches() -> None:
    dapo, grpo = flat(CONFIGS / "dapo.toml"), flat(CONFIGS / "grpo.toml")
    assert set(dapo) == set(grpo)
    differ = {k for k in dapo if dapo[k] != grpo[k]}
    assert differ == set(SWITCHES)
    for key, (g, d) in SWITCHES.items():
        assert (grpo[key], dapo[key]) == (g, d), key
    assert grpo[("learner", "clip_low")] == grpo[("learner", "clip_high")]  # no clip-higher: eps_high = eps_low
    assert dapo[("learner", "overlong_filter")] is False  # soft punishment took over from filtering


def test_the_ablation_ladder_adds_one_technique_per_file_and_ends_at_dapo() -> None:
    prev = flat(CONFIGS / "grpo.toml")
    for name in LADDER:
        cur = flat(CONFIGS / "ablations" / f"{name}.toml")
        changed = {k for k in cur if cur[k] != prev.get(k)}
        assert 1 <= len(changed) <= 2, (name, changed)  # row 4 also switches filtering off
        prev = cur
    assert prev == flat(CONFIGS / "dapo.toml")


def test_flags_are_what_the_services_parse() -> None:
    from buffer.settings import BufferSettings
    from learner.settings import LearnerSettings
    from services.settings import load_settings

    flags = to_flags({"clip_high": 0.2, "loss_agg": "seq-mean-token-mean", "overlong_filter": True})
    s = load_settings(LearnerSettings, flags)
    assert (s.clip_high, s.loss_agg, s.overlong_filter) == (0.2, "seq-mean-token-mean", True)
    b = load_settings(BufferSettings, to_flags({"dynamic_sampling": False, "dataset_config": {"chain_sum": {}}}))
    assert b.dynamic_sampling is False and b.dataset_config == {"chain_sum": {}}


def test_mistakes_are_named(tmp_path: Path) -> None:
    def fails(text: str, match: str) -> None:
        p = tmp_path / "p.toml"
        p.write_text(text)
        with pytest.raises(PresetError, match=match):
            load_preset(p)

    fails("[learner]\nclip_hihg = 0.3\n", r"\[learner\] has no setting \['clip_hihg'\]")
    fails("[learner]\nloss_agg = 'mean'\n", r"\[learner\] loss_agg")
    fails("[mesh]\nstep = 3\n", r"\[mesh\] has no setting")
    fails("[trainer]\nlr = 1\n", "unknown sections")
    fails('base = "p.toml"\n', "loops back")
    fails('base = "missing.toml"\n', "missing.toml")
    fails("base = []\n", "a file name or a list of them")
    fails('base = ["p.toml"]\n', "loops back")


def test_a_list_of_bases_merges_in_order(tmp_path: Path) -> None:
    """A row of an ablation on another task: the row's chain, then the task; the file's own keys last."""
    (tmp_path / "row.toml").write_text("[learner]\nclip_high = 0.28\nclip_low = 0.2\n[buffer]\ndataset_size = 400\n")
    (tmp_path / "task.toml").write_text('[mesh]\ndataset = "reasoning_gym:chain_sum"\n[buffer]\ndataset_size = 100\n')
    (tmp_path / "p.toml").write_text('base = ["row.toml", "task.toml"]\n[learner]\nclip_low = 0.1\n')
    merged = read_preset(tmp_path / "p.toml")
    assert merged["learner"] == {"clip_high": 0.28, "clip_low": 0.1}
    assert merged["buffer"] == {"dataset_size": 100} and merged["mesh"] == {"dataset": "reasoning_gym:chain_sum"}
