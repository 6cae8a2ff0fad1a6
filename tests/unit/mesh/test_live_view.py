"""The live view's numbers and the run's curves, from synthetic service states (no processes)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from rich.console import Console

from mesh import curves
from mesh.live import LiveView, ServiceState, mesh_numbers, quantile
from mesh.recorder import row as metrics_row
from services.schemas import LedgerEntry


def states() -> list[ServiceState]:
    buffer = ServiceState("buffer", 1, True, True, "running", {
        "dapo_buffer_groups_received_total": [({}, 40.0)], "dapo_buffer_groups_kept_total": [({}, 10.0)],
        "dapo_buffer_version_lag_sum": [({}, 6.0)], "dapo_buffer_version_lag_count": [({}, 10.0)],
    })  # fmt: skip
    r0 = ServiceState("rollout-0", 2, True, True, "ready", {"dapo_rollout_tokens_per_second": [({}, 100.0)],
                                                            "dapo_rollout_weight_version": [({}, 7.0)]})  # fmt: skip
    r1 = ServiceState("rollout-1", 3, True, True, "ready", {"dapo_rollout_tokens_per_second": [({}, 50.0)],
                                                            "dapo_rollout_weight_version": [({}, 6.0)]})  # fmt: skip
    learner = ServiceState("learner", 4, False, False, "exited")
    return [buffer, r0, r1, learner]


def test_mesh_numbers() -> None:
    n = mesh_numbers(states())
    assert n["filtered_frac"] == 0.75 and n["version_lag_mean"] == 0.6
    assert n["rollout_tokens_per_s"] == 150.0 and n["replica_version_min"] == 6.0
    assert math.isnan(n["sync_seconds_mean"])  # no learner metrics: unknown, not zero
    assert math.isnan(mesh_numbers([])["filtered_frac"])


def test_metrics_row_and_view(tmp_path: Path) -> None:
    entry = LedgerEntry(batch_id=4, version=5, pid=1, lag=0, task_ids=["t1"], metrics={
        "reward_mean": 0.25, "acc_mean": 0.5, "entropy": 1.2, "clip_frac_upper": 0.01, "seconds": 3.0,
        "behav_kl": 0.0123})  # fmt: skip
    row = metrics_row(entry, states())
    assert row["step"] == 5 and row["policy_version"] == 5 and "version" not in row and "pid" not in row
    assert "task_ids" not in row and row["batch_id"] == 4 and row["reward_mean"] == 0.25
    assert row["filtered_frac"] == 0.75 and "sync_seconds_mean" not in row  # NaNs are left out of the JSON
    json.dumps(row, allow_nan=False)
    view = LiveView(steps=10)
    view.update(states(), row, 5)
    console = Console(record=True, width=160)
    console.print(view.render())
    text = console.export_text()
    assert "5/10" in text and "+0.250" in text and "75%" in text and "exited" in text and "rollout-1" in text
    assert "behav KL" in text and "0.0123" in text


def test_curves_png(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    assert curves.plot(metrics, tmp_path / "c.png") is None  # nothing yet
    rows = [{"step": i, "reward_mean": i / 10, "acc_mean": i / 20, "entropy": 1.0, "seconds": 2.0,
             "filtered_frac": float("nan")} for i in range(1, 4)]  # fmt: skip
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = curves.plot(metrics, tmp_path / "c.png")
    assert out is not None and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_per_task_and_curriculum_numbers_and_view() -> None:
    a, b = "reasoning_gym/chain_sum", "reasoning_gym/basic_arithmetic"
    buffer = ServiceState("buffer", 1, True, True, "running", {
        "dapo_buffer_task_groups_total": [({"task": a, "outcome": "keep"}, 3.0), ({"task": a, "outcome": "all_wrong"},
                                          9.0), ({"task": b, "outcome": "all_correct"}, 4.0)],
        "dapo_buffer_curriculum_skipped_total": [({"task": b}, 6.0)],
        "dapo_buffer_prompts_dispatched_total": [({}, 14.0)],
        "dapo_buffer_curriculum_predicted_filtered_total": [({}, 4.5)],
        "dapo_buffer_curriculum_observed_filtered_total": [({}, 5.0)],
        "dapo_buffer_curriculum_predicted_groups_total": [({}, 10.0)],
        "dapo_buffer_prompts_by_band": [({"band": "solved"}, 7.0), ({"band": "unseen"}, 3.0)],
    })  # fmt: skip
    twin = ServiceState(
        "buffer-1", 5, True, True, "running", {"dapo_buffer_prompts_by_band": [({"band": "solved"}, 7.0)]}
    )
    replica = ServiceState("rollout-0", 2, True, True, "ready", {"dapo_eval_task_avg_at_k": [({"task": a}, 0.31)]})
    n = mesh_numbers([buffer, twin, replica])
    assert n[f"filtered_frac/{a}"] == 0.75 and n[f"groups_kept/{a}"] == 3.0 and n[f"heldout/{a}"] == 0.31
    assert n[f"filtered_frac/{b}"] == 1.0 and n[f"groups_kept/{b}"] == 0.0 and n[f"skipped/{b}"] == 6.0
    assert n["predicted_filtered_frac"] == 0.45 and n["observed_filtered_frac"] == 0.5 and n["skip_frac"] == 0.3
    assert n["band/solved"] == 7.0 and n["band/unseen"] == 3.0  # two buffers see one shared state: not 14
    view = LiveView(steps=10)
    view.update([buffer, replica], {"reward_mean": 0.1}, 1)
    console = Console(record=True, width=160)
    console.print(view.render())
    text = console.export_text()
    assert a in text and "0.310" in text and "75%" in text and "solved 7" in text and "predicted filtered 45%" in text


def test_curves_draw_a_line_per_task(tmp_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": i, "reward_mean": 0.1, "filtered_frac/x": 0.5, "filtered_frac/y": 0.2} for i in range(1, 4)]
    rows.append({"kind": "eval", "step": 3, "eval_acc": 0.4, "eval_acc/x": 0.3, "eval_acc/y": 0.5})
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    seen: list[str] = []
    real = matplotlib.axes.Axes.plot

    def spy(self, *args, **kw):  # type: ignore[no-untyped-def]
        seen.append(kw.get("label", ""))
        return real(self, *args, **kw)

    matplotlib.axes.Axes.plot = spy  # type: ignore[method-assign]
    try:
        curves.plot(metrics, tmp_path / "c.png")
    finally:
        matplotlib.axes.Axes.plot = real  # type: ignore[method-assign]
    assert {"x (eval_acc)", "y (eval_acc)", "x (filtered_frac)", "y (filtered_frac)"} <= set(seen)


def episode_states() -> list[ServiceState]:
    def buckets(counts: list[tuple[str, float]]) -> list[tuple[dict[str, str], float]]:
        return [({"kind": "step", "le": le}, v) for le, v in counts] + [({"kind": "reset", "le": "+Inf"}, 50.0)]

    r0 = ServiceState("rollout-0", 2, True, True, "ready", {
        "dapo_rollout_episodes_total": [({"env": "retry", "ended": "done"}, 30.0),
                                        ({"env": "retry", "ended": "max_tokens"}, 8.0),
                                        ({"env": "retry", "ended": "failed"}, 2.0)],
        "dapo_rollout_episode_turns_sum": [({"env": "retry"}, 76.0)],
        "dapo_rollout_episode_turns_count": [({"env": "retry"}, 38.0)],
        "dapo_rollout_episode_seconds_total": [({"phase": "env"}, 30.0), ({"phase": "generate"}, 90.0)],
        "dapo_rollout_tool_calls_total": [({"outcome": "valid"}, 12.0), ({"outcome": "malformed"}, 3.0)],
        "dapo_rollout_episodes_live": [({}, 5.0)],
        "dapo_rollout_env_step_seconds_bucket": buckets([("0.1", 50.0), ("1.0", 98.0), ("+Inf", 100.0)]),
    })  # fmt: skip
    r1 = ServiceState("rollout-1", 3, True, True, "ready", {
        "dapo_rollout_tool_calls_total": [({"outcome": "valid"}, 8.0)],
        "dapo_rollout_env_step_seconds_bucket": buckets([("0.1", 0.0), ("1.0", 0.0), ("+Inf", 0.0)]),
    })  # fmt: skip
    return [r0, r1]


def test_episode_numbers_and_view() -> None:
    n = mesh_numbers(episode_states())
    assert n["episodes/done"] == 30.0 and n["episodes/max_tokens"] == 8.0 and n["episode_turns_mean"] == 2.0
    assert n["env_wait_share"] == 0.25 and n["tool_calls_total/valid"] == 20.0 and n["episodes_live"] == 5.0
    # 100 step calls over both replicas: the median at the 0.1 s edge, p99 halfway into (1, +Inf] -> its lower edge
    assert math.isclose(n["env_step_p50_s"], 0.1) and n["env_step_p99_s"] == 1.0
    assert "episode_turns_mean" not in mesh_numbers(states())  # no episodes: no episode numbers
    view = LiveView(steps=10)
    view.update(episode_states(), {"reward_mean": 0.1}, 1)
    console = Console(record=True, width=200)
    console.print(view.render())
    text = console.export_text()
    assert "turns/episode" in text and "2.00" in text and "20%" in text and "valid 20" in text and "25%" in text


def test_quantile_interpolates_within_a_bucket() -> None:
    st = ServiceState("rollout-0", 1, True, True, "", {"h_bucket": [
        ({"le": "1.0"}, 10.0), ({"le": "2.0"}, 30.0), ({"le": "+Inf"}, 30.0)]})  # fmt: skip
    assert quantile([st], "h", 0.5) == 1.25 and math.isclose(quantile([st], "h", 0.2), 0.6)
    assert math.isnan(quantile([st], "nope", 0.5))


def test_batch_episode_metrics() -> None:
    from learner.batching import episode_metrics
    from services.schemas import EpisodeInfo, Sample, ScoredGroup, TrainBatch
    from services.selfcheck import example_group

    g = example_group(0, n_samples=2, n_tokens=4)
    assert episode_metrics(TrainBatch.assemble(0, [g])) == {}  # single-turn samples: no episode numbers
    infos = [EpisodeInfo(env="calculator", model_turns=3, ended="done", tool_calls={"valid": 2, "malformed": 1},
                         env_seconds=1.0, generate_seconds=3.0),
             EpisodeInfo(env="calculator", model_turns=1, ended="max_tokens", generate_seconds=4.0)]  # fmt: skip
    samples = [Sample.model_validate(s.model_dump() | {"episode": i}) for s, i in zip(g.samples, infos, strict=True)]
    m = episode_metrics(TrainBatch.assemble(0, [ScoredGroup.model_validate(g.model_dump() | {"samples": samples})]))
    assert m["episode_turns"] == 2.0 and m["episode_truncated_frac"] == 0.5 and m["env_wait_frac"] == 1 / 8
    assert m["tool_calls/valid"] == 1.0 and m["tool_calls/malformed"] == 0.5 and m["tool_calls/failed"] == 0.0


def test_curves_add_episode_panels(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": i, "reward_mean": 0.1, "episode_turns": 2.0, "tool_calls/valid": i / 3} for i in range(1, 4)]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    import matplotlib

    matplotlib.use("Agg")
    titles: list[str] = []
    real = matplotlib.axes.Axes.set_title

    def spy(self, label, *args, **kw):  # type: ignore[no-untyped-def]
        titles.append(label)
        return real(self, label, *args, **kw)

    matplotlib.axes.Axes.set_title = spy  # type: ignore[method-assign]
    try:
        assert curves.plot(metrics, tmp_path / "c.png") is not None
    finally:
        matplotlib.axes.Axes.set_title = real  # type: ignore[method-assign]
    assert "episodes" in titles and len(titles) == len(curves.PANELS) + len(curves.EPISODE_PANELS)


def test_gateway_numbers_and_line() -> None:
    from mesh.live import gateway_line, gateway_numbers

    plain = ServiceState("rollout-0", 2, True, True, "ready", {"dapo_rollout_tokens_per_second": [({}, 1.0)]})
    assert gateway_numbers([plain]) == {} and gateway_line({}) is None
    buckets = [({"le": "0.01"}, 6.0), ({"le": "0.1"}, 9.0), ({"le": "+Inf"}, 10.0)]
    metrics = {"dapo_gateway_sessions_total": [({"outcome": "opened"}, 12.0), ({"outcome": "ended"}, 9.0),
                                               ({"outcome": "abandoned"}, 1.0)],
               "dapo_gateway_sessions_open": [({}, 2.0)],
               "dapo_gateway_calls_total": [({"route": "chat", "status": "200"}, 30.0),
                                            ({"route": "chat", "status": "400"}, 4.0)],
               "dapo_gateway_rejected_total": [({"reason": "no_task"}, 5.0)],
               "dapo_gateway_added_seconds_bucket": buckets}  # fmt: skip
    n = gateway_numbers([ServiceState("rollout-0", 2, True, True, "ready", metrics)])
    assert n["gateway_sessions/ended"] == 9 and n["gateway_open"] == 2 and n["gateway_calls"] == 30
    assert n["gateway_429"] == 5 and n["gateway_added_p50_s"] <= 0.01 < n["gateway_added_p99_s"]
    line = gateway_line(n)
    assert line is not None and "open 2, ended 9, abandoned 1; calls 30, 429s 5" in line


def test_generated_per_trained_and_the_rounds_line() -> None:
    from mesh.live import rounds_numbers, sampling_line

    assert rounds_numbers(states()) == {} and "rounds" not in sampling_line(mesh_numbers(states()))
    buffer = ServiceState(
        "buffer",
        1,
        True,
        True,
        "running",
        {"dapo_buffer_samples_generated_total": [({}, 330.0)], "dapo_buffer_samples_trained_total": [({}, 100.0)]},
    )
    replica = ServiceState("rollout-0", 2, True, True, "ready", {
        "dapo_rollout_group_samples_drawn_sum": [({}, 300.0)], "dapo_rollout_group_samples_drawn_count": [({}, 50.0)],
        "dapo_rollout_group_rounds_sum": [({}, 90.0)], "dapo_rollout_groups_given_up_total": [({}, 10.0)],
        "dapo_rollout_samples_down_sampled_total": [({}, 24.0)], "dapo_rollout_generated_tokens_total": [({}, 9e3)]})  # fmt: skip  # noqa: E501 -- two metric families a line reads as the replica's page
    n = mesh_numbers([buffer, replica])
    assert n["generated_per_trained"] == 3.3 and n["group_drawn_mean"] == 6.0 and n["group_rounds_mean"] == 1.8
    assert n["groups_given_up_frac"] == 0.2 and n["samples_down_sampled"] == 24
    other = ServiceState("rollout-1", 3, True, True, "ready", {"dapo_rollout_generated_tokens_total": [({}, 1e3)]})
    assert mesh_numbers([buffer, replica, other])["tokens_generated"] == 10_000  # every replica's, summed
    assert sampling_line(n) == (
        "samples: 3.30 generated per trained   rounds: 6.0 samples and 1.8 rounds a group, 20% given up, "
        "24 down-sampled"
    )
