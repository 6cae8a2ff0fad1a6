"""What `dapo-mesh up` starts, read without starting anything: a preset in, each service's command line out,
parsed back by that service's own settings class; and a mesh config that cannot work is refused by name."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from buffer.settings import BufferSettings
from learner.settings import LearnerSettings
from mesh.cli import app, mesh_config
from mesh.commands import (
    DIST_PORT,
    SYNC_PORT,
    ServiceCommand,
    service_commands,
    service_names,
    service_values,
    split_cores,
)
from mesh.config import MESH_SETS, LearnerSection, MeshConfig, PresetError, load_preset
from mesh.layout import RunLayout
from reward_server.settings import RewardSettings
from rollout.settings import RolloutSettings
from services.settings import load_settings

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
MODEL = Path("/models/m")
URL = "redis://:pw@127.0.0.1:6390/0"
SETTINGS = {"reward": RewardSettings, "buffer": BufferSettings, "learner": LearnerSettings, "rollout": RolloutSettings}


@pytest.fixture(autouse=True)
def no_dapo_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in [k for k in os.environ if k.startswith("DAPO_")]:
        monkeypatch.delenv(k)


def ports(cfg: MeshConfig) -> dict[str, int]:
    return {name: 9000 + i for i, name in enumerate([*service_names(cfg), SYNC_PORT, DIST_PORT])}


def parsed(cmd: ServiceCommand):  # type: ignore[no-untyped-def]
    return load_settings(SETTINGS[cmd.service], list(cmd.args))


def test_the_dapo_preset_becomes_these_command_lines(tmp_path: Path) -> None:
    cfg = MeshConfig.from_preset(CONFIGS / "dapo.toml", run_dir=tmp_path, replicas=2)
    p = ports(cfg)
    cmds = {c.name: c for c in service_commands(cfg, MODEL, URL, p)}
    assert list(cmds) == ["reward", "buffer", "learner", "rollout-0", "rollout-1"]  # the start order
    modules = ("reward_server", "buffer", "learner", "rollout", "rollout")
    assert [c.argv("py")[:3] for c in cmds.values()] == [["py", "-m", m] for m in modules]
    for c in cmds.values():
        assert c.env == {"DAPO_REDIS_URL": URL, "OMP_NUM_THREADS": "1"} and URL not in " ".join(c.args)  # not in `ps`
        assert parsed(c).port == p[c.name]
    paths = RunLayout(tmp_path)

    learner = parsed(cmds["learner"])
    assert (learner.model_dir, learner.run_dir, learner.max_batches) == (MODEL, paths.learner, 45)
    assert (learner.minibatches, learner.lr, learner.weight_sync) == (4, 2e-5, "broadcast")
    assert (learner.sync_port, learner.dist_port) == (p["sync"], p["dist"])  # picked by `up`, apart from the rest
    assert (learner.clip_high, learner.loss_agg, learner.warmup_batches, learner.hold_after_max) == (
        0.28, "token-mean", 2, True)  # fmt: skip  # from the preset's [learner]
    # one staleness bound, checked by the buffer when it batches and by the learner at the update
    assert (learner.max_staleness, learner.stale_groups, learner.off_policy) == (1, "reweight", "token-tis")

    buffer = parsed(cmds["buffer"])
    assert (buffer.dataset, buffer.n_samples, buffer.batch_size, buffer.run_dir) == (
        "reasoning_gym:basic_arithmetic", 8, 4, paths.buffer)  # fmt: skip
    assert buffer.max_staleness == 1
    assert buffer.dataset_size == 400 and buffer.dataset_config["basic_arithmetic"]["operators"] == ["+", "*"]

    assert parsed(cmds["reward"]).overlong_shaping is True and parsed(cmds["reward"]).workers == 1
    r0, r1 = parsed(cmds["rollout-0"]), parsed(cmds["rollout-1"])
    for i, r in enumerate((r0, r1)):
        assert (r.replica_id, r.engine, r.model_dir, r.max_response_tokens) == (f"rollout-{i}", "vllm", MODEL, 96)
        assert r.reward_url == f"http://127.0.0.1:{p['reward']}" and r.weights_dir == paths.snapshots
        assert r.sync_broadcast is True
    # only rollout-0 evaluates, on the file the buffer writes
    assert (r0.eval_every, r0.eval_data, r0.eval_size, r0.eval_k) == (9, str(paths.eval_items), 100, 4)
    assert r1.eval_every is None


def test_dtype_and_core_placement_reach_the_learner_and_every_replica(tmp_path: Path) -> None:
    cfg = MeshConfig(run_dir=tmp_path, replicas=2, dtype="fp32")
    cmds = {c.name: parsed(c) for c in service_commands(cfg, MODEL, URL, ports(cfg))}
    assert cmds["learner"].dtype == cmds["rollout-0"].dtype == cmds["rollout-1"].dtype == "fp32"
    assert MeshConfig(run_dir=tmp_path).dtype == "auto"  # bf16 where the hardware has it
    learner_cores, replica_cores = split_cores() or (None, None)
    assert cmds["learner"].cpu_cores == learner_cores  # split by default: the first half of the cores
    assert cmds["rollout-0"].cpu_cores == cmds["rollout-1"].cpu_cores == replica_cores
    shared = MeshConfig(run_dir=tmp_path, placement="shared")
    for c in service_commands(shared, MODEL, URL, ports(shared)):
        assert "--cpu-cores" not in c.args
    assert split_cores({0, 1, 2, 3}) == ("0,1", "2,3") and split_cores({5, 7}) == ("5", "7")
    assert split_cores({3}) is None  # one core: nothing to split


def test_a_section_reaches_its_service_and_cannot_set_what_the_mesh_sets(tmp_path: Path) -> None:
    cfg = MeshConfig(run_dir=tmp_path, lr=1e-3, learner={"clip_high": 0.3}, reward={"workers": 3})  # type: ignore[arg-type]
    cmds = {c.name: parsed(c) for c in service_commands(cfg, MODEL, URL, ports(cfg))}
    assert (cmds["learner"].lr, cmds["learner"].clip_high, cmds["reward"].workers) == (1e-3, 0.3, 3)
    # one value, one place: what [mesh] decides is set there (the message names the field), the wiring is the
    # mesh's, and a secret is given in the environment, never in a preset
    refused = (
        ("learner", "lr", 5e-4, "lr: set \\[mesh\\] lr"),
        ("learner", "ranks", 2, "ranks: set \\[mesh\\] learner_ranks"),
        ("buffer", "batch_size", 2, "batch_size: set \\[mesh\\] batch_size"),
        ("rollout", "reward_url", "http://x", "reward_url: the mesh's wiring"),
        ("rollout", "reward_token", "t", "reward_token: a secret, given in the environment \\(DAPO_REWARD_TOKEN\\)"),
        ("learner", "auth_token", "t", "auth_token: a secret"),
    )
    for section, key, value, why in refused:
        with pytest.raises(ValidationError, match=rf"\[{section}\] sets \['{key}'\], which the mesh sets: {why}"):
            MeshConfig(run_dir=tmp_path, **{section: {key: value}})
    with pytest.raises(
        ValidationError, match=r"\[learner\] has no setting \['clip_hihg'\]; did you mean \[.*'clip_high'"
    ):
        MeshConfig(learner={"clip_hihg": 0.3})  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="clip_hihg"):  # a section built alone refuses a typo too
        LearnerSection(clip_hihg=0.3)  # type: ignore[call-arg]


def test_every_name_the_mesh_sets_is_a_setting_of_that_service(tmp_path: Path) -> None:
    cfg = MeshConfig(run_dir=tmp_path, replicas=2, seed=1, eval_every=2)
    values = service_values(cfg, MODEL, ports(cfg))
    for name, settings in values.items():
        service = name.split("-")[0]
        assert set(settings) <= set(SETTINGS[service].model_fields), name
        # what the mesh sets is refused in a preset section, except a few defaults a preset may change
        assert set(settings) - MESH_SETS[service] <= {
            "workers",
            "seed",
            "shuffle_seed",
            "cpu_cores",
            "record_episodes",
            "eval_record_samples",
        }, name


def test_tiny_with_a_preset_takes_its_sections_and_says_what_it_changes(tmp_path: Path) -> None:
    cfg = mesh_config(tmp_path, CONFIGS / "grpo.toml", True, {}, ["learner.clip_high=0.25", "mesh.eval_size=8"])
    assert cfg.tiny and cfg.engine == "hf" and cfg.steps == 3  # the tiny mesh's scale
    assert cfg.learner.loss_agg == "seq-mean-token-mean" and cfg.learner.clip_high == 0.25  # grpo, then --set
    assert cfg.dataset == "reasoning_gym:basic_arithmetic" and cfg.eval_size == 8
    assert cfg.buffer.dataset_size == 400 and cfg.buffer.dynamic_sampling is False  # a random model needs it off
    r = CliRunner().invoke(app, ["up", "--tiny", "--config", str(CONFIGS / "dapo.toml"), "--run-dir", str(tmp_path),
                                 "--set", "learner.clip_hihg=1"])  # fmt: skip
    assert r.exit_code == 2 and "[learner] has no setting ['clip_hihg']" in " ".join(r.output.split())
    out = " ".join(w for w in CliRunner().invoke(app, ["up", "--help"]).output.split() if w != "│")
    assert "Data-parallel learner processes" in out  # the option's help is its MeshConfig field's description


def test_options_left_out_keep_the_presets_values(tmp_path: Path) -> None:
    preset = tmp_path / "p.toml"
    preset.write_text('base = "%s"\n[mesh]\nreplicas = 2\nengine = "hf"\ntransport = "filesystem"\n'
                      % (CONFIGS / "dapo.toml"))  # fmt: skip
    cfg = mesh_config(tmp_path, preset, False, {"seed": 3}, [])
    assert (cfg.replicas, cfg.engine, cfg.transport, cfg.seed, cfg.steps) == (2, "hf", "filesystem", 3, 45)


def test_a_seed_reaches_every_sampler(tmp_path: Path) -> None:
    cfg = MeshConfig(run_dir=tmp_path, replicas=2, seed=5)
    cmds = {c.name: c for c in service_commands(cfg, MODEL, URL, ports(cfg))}
    assert [parsed(cmds[f"rollout-{i}"]).seed for i in (0, 1)] == [5, 6]  # replicas must not repeat each other
    assert parsed(cmds["learner"]).seed == 5 and parsed(cmds["buffer"]).shuffle_seed == 5
    unseeded = {c.name: c for c in service_commands(MeshConfig(run_dir=tmp_path), MODEL, URL, ports(cfg))}
    assert parsed(unseeded["rollout-0"]).seed is None


def test_filesystem_transport_turns_the_broadcast_off_on_both_ends(tmp_path: Path) -> None:
    cfg = MeshConfig.tiny_preset(tmp_path).model_copy(update={"transport": "filesystem"})
    cmds = {c.name: c for c in service_commands(cfg, MODEL, URL, ports(cfg))}
    assert parsed(cmds["learner"]).weight_sync == "none"
    assert parsed(cmds["rollout-0"]).sync_broadcast is False and parsed(cmds["rollout-0"]).engine == "hf"
    assert parsed(cmds["buffer"]).dynamic_sampling is False  # the tiny preset's extra flag
    assert "--eval-every" not in cmds["rollout-0"].args  # evaluation off unless asked


def test_a_wrong_choice_is_named_with_the_allowed_ones(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match=r"transport\n  Input should be 'broadcast' or 'filesystem'"):
        MeshConfig(transport="filesytem")  # type: ignore[arg-type]
    cfg = MeshConfig()
    with pytest.raises(ValidationError, match=r"engine\n  Input should be 'vllm' or 'hf'"):
        cfg.engine = "trt"  # type: ignore[assignment]
    with pytest.raises(ValidationError, match=r"replicas\n  Input should be greater than or equal to 1"):
        MeshConfig(replicas=0)
    with pytest.raises(ValidationError, match=r"\[mesh\] has no setting \['trainer'\]"):
        MeshConfig(trainer={"lr": 1})  # type: ignore[call-arg]
    preset = tmp_path / "p.toml"
    preset.write_text('[mesh]\ntransport = "nccl"\n')
    with pytest.raises(PresetError, match=r"\[mesh\] transport: Input should be 'broadcast' or 'filesystem'"):
        load_preset(preset)
    preset.write_text("[mesh]\nstesp = 3\n")
    with pytest.raises(PresetError, match=r"\[mesh\] has no setting \['stesp'\]; did you mean \['steps'\]"):
        load_preset(preset)


def test_up_refuses_a_wrong_transport_before_starting_anything(tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["up", "--tiny", "--run-dir", str(tmp_path), "--transport", "nccl"])
    assert r.exit_code == 2
    assert "transport: Input should be 'broadcast' or 'filesystem'" in " ".join(r.output.split())
    assert not any(tmp_path.iterdir())  # no model, no Redis, no logs


def test_learner_ranks_reach_the_learner_and_too_many_are_refused_by_name(tmp_path: Path) -> None:
    cfg = MeshConfig.tiny_preset(tmp_path).model_copy(update={"learner_ranks": 2})
    cmds = {c.name: c for c in service_commands(cfg, MODEL, URL, ports(cfg))}
    assert parsed(cmds["learner"]).ranks == 2 and parsed(cmds["rollout-0"]).replica_id == "rollout-0"
    with pytest.raises(ValidationError, match=r"learner_ranks 9 > 8 samples per mini-batch \(batch_size 4 x n_samples"):
        MeshConfig(batch_size=4, n_samples=4, minibatches=2, learner_ranks=9)
    result = CliRunner().invoke(app, ["up", "--tiny", "--learner-ranks", "9", "--run-dir", str(tmp_path / "r")])
    assert result.exit_code == 2 and "learner_ranks 9" in " ".join(result.output.split())
    assert not (tmp_path / "r").exists()  # refused before anything started


def test_the_cli_docstring_lists_every_command() -> None:
    import typer.main

    import mesh.cli

    commands = set(typer.main.get_command(app).commands)  # type: ignore[attr-defined]
    listed = {w for line in (mesh.cli.__doc__ or "").splitlines() if line.startswith("dapo-mesh ")
              for w in line.split("#")[0].split()[1:] if w.isidentifier() or "-" in w}  # fmt: skip
    assert commands == listed - {"RUN_DIR", "--check"}, commands ^ listed


def test_up_reads_the_data_before_it_starts_anything(tmp_path: Path) -> None:
    rows = tmp_path / "rows.jsonl"  # rows in the verl schema, without a verifier (none named for the file either)
    rows.write_text(
        "\n".join(f'{{"prompt": "{i} + 1?", "reward_model": {{"ground_truth": "{i + 1}"}}}}' for i in range(8))
    )
    r = CliRunner().invoke(app, ["up", "--tiny", "--run-dir", str(tmp_path / "run"), "--set",
                                 f"mesh.dataset=reasoning_gym:basic_arithmetic; file:{rows}"])  # fmt: skip
    out = " ".join(r.output.split())
    assert r.exit_code == 2 and "row 0: no verifier" in out, out
    assert not (tmp_path / "run" / "redis").exists() and not RunLayout(tmp_path / "run").logs.exists()  # nothing ran


def test_eval_tasks_reach_the_evaluating_replica_and_a_task_the_dataset_lacks_is_refused(tmp_path: Path) -> None:
    mixture = "reasoning_gym:basic_arithmetic=1; reasoning_gym:chain_sum=3"
    cfg = mesh_config(tmp_path, CONFIGS / "budgets" / "reach-most.toml", False, {"replicas": 2},
                      ['mesh.eval_tasks=["reasoning_gym/basic_arithmetic"]'])  # fmt: skip
    assert cfg.dataset == mixture
    cmds = {c.name: parsed(c) for c in service_commands(cfg, MODEL, URL, ports(cfg))}
    assert cmds["rollout-0"].eval_tasks == ["reasoning_gym/basic_arithmetic"]
    assert cmds["rollout-1"].eval_tasks == [] and cmds["rollout-1"].eval_every is None  # only rollout-0 evaluates
    with pytest.raises(ValidationError, match=r"eval_tasks \['basic_arithmetic'\]: the dataset's tasks are"):
        MeshConfig(run_dir=tmp_path, dataset=mixture, eval_tasks=["basic_arithmetic"])
    r = CliRunner().invoke(app, ["up", "--tiny", "--run-dir", str(tmp_path / "run"), "--set",
                                 'mesh.eval_tasks=["env/calculator"]'])  # fmt: skip
    assert r.exit_code == 2 and "the dataset's tasks are" in " ".join(r.output.split()), r.output
    assert not RunLayout(tmp_path / "run").logs.exists()  # refused before anything started


def test_the_code_preset_starts_the_sandbox_and_points_the_reward_server_at_it(tmp_path: Path) -> None:
    from sandbox.settings import SandboxSettings

    cfg = MeshConfig.from_preset(CONFIGS / "code.toml", run_dir=tmp_path, sandbox={"workers": 3})
    p = ports(cfg)
    cmds = {c.name: c for c in service_commands(cfg, MODEL, URL, p)}
    assert list(cmds) == ["sandbox", "reward", "buffer", "learner", "rollout-0"]  # the sandbox first: the reward
    sandbox = load_settings(SandboxSettings, list(cmds["sandbox"].args))  # server sends it the answers
    assert (sandbox.port, sandbox.workers) == (p["sandbox"], 3)
    assert parsed(cmds["reward"]).sandbox_url is not None
    assert str(parsed(cmds["reward"]).sandbox_url).rstrip("/") == f"http://127.0.0.1:{p['sandbox']}"
    assert parsed(cmds["buffer"]).prompt_template == "none"
    assert "sandbox" not in service_names(MeshConfig.from_preset(CONFIGS / "dapo.toml", run_dir=tmp_path))
    with pytest.raises(PresetError, match="sandbox_url"):  # the mesh's wiring, not the preset's
        MeshConfig.from_preset(CONFIGS / "code.toml", run_dir=tmp_path, reward={"sandbox_url": "http://x:1"})


def test_up_refuses_code_rows_whose_file_part_does_not_name_the_code_verifier(tmp_path: Path) -> None:
    rows = tmp_path / "code.jsonl"
    truth = '{\\"asserts\\": [\\"assert f(1) == 2\\"]}'
    lines = [
        f'{{"prompt": "f{i}", "verifier": "code", "reward_model": {{"ground_truth": "{truth}"}}}}' for i in range(8)
    ]
    rows.write_text("\n".join(lines))
    r = CliRunner().invoke(app, ["up", "--tiny", "--run-dir", str(tmp_path / "run"), "--set",
                                 f"mesh.dataset=file:{rows}"])  # fmt: skip
    out = " ".join(r.output.split())
    assert r.exit_code == 2 and "file:PATH@code" in out, out


def test_the_compute_environment_gets_the_sandbox_too(tmp_path: Path) -> None:
    from env_server.settings import EnvSettings

    cfg = MeshConfig.from_preset(CONFIGS / "agents-calculator.toml", run_dir=tmp_path, dataset="env:compute")
    p = ports(cfg)
    cmds = {c.name: c for c in service_commands(cfg, MODEL, URL, p)}
    assert list(cmds)[:3] == ["sandbox", "reward", "env"]
    env = load_settings(EnvSettings, list(cmds["env"].args))
    assert str(env.sandbox_url).rstrip("/") == f"http://127.0.0.1:{p['sandbox']}"
