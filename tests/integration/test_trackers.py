"""The trackers with their real libraries: rows and a table logged through Trackers, then read back with each
library's own reader (wandb: the offline run's .wandb file; mlflow: MlflowClient; tensorboard: EventAccumulator).
And the failure rule: a tracker that raises mid-run never stops the others, start-up errors are TrackerErrors."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mesh.trackers import (
    TRACKERS,
    MlflowTracker,
    TrackerError,
    TrackingSettings,
    markdown_table,
    metrics_of,
    mlflow_key,
    open_trackers,
)

pytestmark = pytest.mark.slow  # importing mlflow and creating its sqlite store alone is ~4 s here

PARAMS = {"steps": 3, "learner": {"lr": 1e-6, "loss": {"eps_high": 0.28}}, "tasks": ["chain_sum"], "seed": None}
ROWS: list[dict[str, Any]] = [
    {"kind": "train", "step": 1, "policy_version": 1, "reward_mean": 0.25, "gap/lag1": 0.5, "batch_id": "b1"},
    {"kind": "train", "step": 2, "policy_version": 2, "reward_mean": 0.5, "entropy": float("nan"), "lag": 1},
    {"kind": "eval", "step": 1, "policy_version": 1, "eval_acc": 0.125, "eval_acc/chain_sum": 0.375, "eval_at": None},
    {"kind": "train", "step": 3, "policy_version": 3, "reward_mean": 0.75, "tool_calls/valid": 2.5},
]
COLUMNS = ["prompt", "response", "reward", "correct"]
TABLE = [["2+3=", "<think>2+3</think>\n5 | done", 1.0, True], ["7*6=", "41", 0.0, False]]


@pytest.fixture(autouse=True)
def wandb_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """W&B's files outside the run's folder (the service's log, episode tables staged for `wandb sync`) go to the
    test's folder, not the user's home."""
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))


def expected_points() -> dict[tuple[str, int], float]:
    return {(k, r["step"]): v for r in ROWS for k, v in metrics_of(r).items()}


def test_every_key_at_every_step_reaches_each_tracker(tmp_path: Path) -> None:
    said: list[str] = []
    trackers = open_trackers(list(TRACKERS), TrackingSettings(run_name="t1"), tmp_path, PARAMS, say=said.append)
    assert trackers.names == list(TRACKERS)
    trackers.log_rows(ROWS[:2])
    trackers.log_rows(ROWS[2:])  # an evaluation of version 1 after the train row of version 2: out of order
    trackers.log_table(3, COLUMNS, TABLE)
    trackers.close()
    assert said == [f"trackers: wandb, mlflow, tensorboard (files under {tmp_path / 'trackers'})"]
    assert not _wandb_core_running()  # close() ended the service process wandb starts

    points, config, table = read_wandb(tmp_path / "trackers" / "wandb")
    assert points == expected_points()
    assert config == PARAMS
    assert table == {"columns": COLUMNS, "data": TABLE}

    points, params, table = read_mlflow(tmp_path / "trackers" / "mlruns")
    assert points == {(mlflow_key(k), s): v for (k, s), v in expected_points().items()}
    assert params == {
        "steps": "3",
        "learner.lr": "1e-06",
        "learner.loss.eps_high": "0.28",
        "tasks": '["chain_sum"]',
        "seed": "null",
    }
    assert table == {"columns": COLUMNS, "data": TABLE}

    points, texts = read_tensorboard(tmp_path / "trackers" / "tensorboard" / "dapo-mesh" / "t1")
    assert points == {key: float(np.float32(v)) for key, v in expected_points().items()}  # float32 in event files
    assert texts["episodes"] == [(3, markdown_table(COLUMNS, TABLE))]
    assert texts["config"][0][0] == 0 and "| learner.loss.eps_high | 0.28 |" in texts["config"][0][1]


def test_a_tracker_that_fails_mid_run_is_said_once_then_off_and_the_others_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    said: list[str] = []
    trackers = open_trackers(["mlflow", "tensorboard"], TrackingSettings(run_name="t2"), tmp_path, {}, said.append)
    mlflow = trackers._open["mlflow"]
    assert isinstance(mlflow, MlflowTracker)
    calls = []

    def store_gone(*args: Any, **kwargs: Any) -> None:
        calls.append(1)
        raise OSError("disk full")

    monkeypatch.setattr(mlflow.client, "log_batch", store_gone)
    for row in ROWS:
        trackers.log_rows([row])  # never raises
    trackers.close()
    assert len(calls) == 3  # the fourth row was not sent: mlflow was off by then
    assert said[1:] == [
        "[yellow]tracker mlflow failed at step 1: OSError: disk full; training goes on[/]",
        "[yellow]tracker mlflow failed 3 times in a row: off for this run[/]",
    ]
    points, _ = read_tensorboard(tmp_path / "trackers" / "tensorboard" / "dapo-mesh" / "t2")
    assert points == {key: float(np.float32(v)) for key, v in expected_points().items()}


def test_start_up_errors_are_tracker_errors_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(TrackerError, match=r"unknown tracker 'neptune'.*choose from wandb, mlflow, tensorboard"):
        open_trackers(["tensorboard", "neptune"], TrackingSettings(), tmp_path, {})
    with pytest.raises(TrackerError, match=r"tracker 'mlflow' could not start: .*bogus"):
        open_trackers(["mlflow"], TrackingSettings(mlflow_tracking_uri="bogus://nowhere"), tmp_path, {})
    (tmp_path / "a-file").write_text("")
    with pytest.raises(TrackerError, match="cannot write the trackers' folder"):
        open_trackers(["tensorboard"], TrackingSettings(), tmp_path / "a-file", {})
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if the extra were not installed
    with pytest.raises(TrackerError, match=r"tracker 'wandb' is not installed .*pip install 'dapo-mesh\[trackers\]'"):
        open_trackers(["wandb"], TrackingSettings(), tmp_path, {})


OFFLINE_RUN = """
import socket, sys
from pathlib import Path
looked_up = []
def hook(event, args):  # every address looked up or connected to, but local sockets (wandb-core's)
    if event == "socket.getaddrinfo" or (event == "socket.connect" and not isinstance(args[1], str)):
        looked_up.append(f"{event} {args[1] if event == 'socket.connect' else args[0]}")
sys.addaudithook(hook)
import atexit
atexit.register(lambda: print("looked up:", looked_up))  # registered first, so it runs after the libraries' own
from mesh.trackers import TRACKERS, TrackingSettings, open_trackers
t = open_trackers(list(TRACKERS), TrackingSettings(), Path(sys.argv[1]), {"lr": 1e-6}, say=lambda _: None)
t.log_rows([{"kind": "train", "step": 1, "policy_version": 1, "reward_mean": 0.5}])
t.log_table(1, ["prompt"], [["1+1="]])
t.close()
"""


def test_an_offline_run_looks_up_no_address(tmp_path: Path) -> None:
    """Offline means offline: MLflow's usage telemetry (a thread started at import) and W&B's (exporters started by
    an offline run's first log, flushed at exit) both reach for the internet unless told not to. MLflow turns its
    own off where it sees CI or pytest, so the child runs without those variables, as a user's mesh does."""
    quiet = ("CI", "PYTEST_CURRENT_TEST", "DO_NOT_TRACK", "MLFLOW_DISABLE_TELEMETRY", "WANDB_MODE")
    env = {k: v for k, v in os.environ.items() if k not in quiet}
    done = subprocess.run(
        [sys.executable, "-c", OFFLINE_RUN, str(tmp_path)], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "looked up: []"


NO_TRACKER = """
import sys
from pathlib import Path
from mesh.trackers import TrackingSettings, open_trackers
t = open_trackers([], TrackingSettings(), Path(sys.argv[1]), {})
t.log_rows([{"kind": "train", "step": 1, "x": 1.0}])
t.close()
print(sorted(m for m in ("wandb", "mlflow", "tensorboard", "torch") if m in sys.modules))
"""


def test_no_tracker_named_imports_no_tracker_library(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", NO_TRACKER, str(tmp_path)], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


# The readers: each tracker's files read back as {(key, step): value}.


def read_wandb(root: Path) -> tuple[dict[tuple[str, int], float], dict[str, Any], dict[str, Any]]:
    """The offline run's .wandb file (a LevelDB log of wandb.proto Records): history rows by policy_version (the
    x-axis Trackers gives W&B), the run's config, and the episode table's file."""
    from wandb.proto import wandb_internal_pb2 as pb

    [run_dir] = root.glob("offline-run-*")
    [data_file] = run_dir.glob("run-*.wandb")
    points: dict[tuple[str, int], float] = {}
    config: dict[str, Any] = {}
    table: dict[str, Any] = {}
    for payload in leveldb_records(data_file.read_bytes()):
        record = pb.Record()
        record.ParseFromString(payload)
        if record.HasField("run"):
            config = {u.key: json.loads(u.value_json) for u in record.run.config.update if u.key != "_wandb"}
        if record.HasField("history"):
            items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
            step = items["policy_version"]
            if "episodes/path" in items:
                table = json.loads((run_dir / "files" / items["episodes/path"]).read_text())
                continue
            points.update({(k, step): v for k, v in items.items() if not k.startswith("_")})
    return points, config, {"columns": table.get("columns"), "data": table.get("data")}


def leveldb_records(data: bytes) -> list[bytes]:
    """W&B's framing (LevelDB's log format after a 7-byte ":W&B" header): 32 KiB blocks of records, each a 7-byte
    header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last) and its bytes; a block's tail under 7 bytes is
    padding."""
    assert data[:4] == b":W&B"
    block, pos, out, part = 32768, 7, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # a zero-filled tail
            pos += block - pos % block
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        part = chunk if kind in (1, 2) else part + chunk
        if kind in (1, 4):
            out.append(part)
    return out


def read_mlflow(
    store: Path, table_version: int = 3
) -> tuple[dict[tuple[str, int], float], dict[str, str], dict[str, Any]]:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{store / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("dapo-mesh")
    assert experiment is not None
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    points = {
        (key, m.step): m.value for key in run.data.metrics for m in client.get_metric_history(run.info.run_id, key)
    }
    table_file = client.download_artifacts(
        run.info.run_id, f"episodes/v{table_version:06d}.json", str(store.parent / "dl")
    )
    return points, dict(run.data.params), json.loads(Path(table_file).read_text())


def read_tensorboard(logdir: Path) -> tuple[dict[tuple[str, int], float], dict[str, list[tuple[int, str]]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    points = {(tag, e.step): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}
    texts = {
        tag: [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(tag)]
        for tag in acc.Tags()["tensors"]
    }
    return points, texts


def _wandb_core_running() -> bool:
    """A wandb-core process serving this one (it is started with --pid of its client)."""
    found = subprocess.run(["pgrep", "-f", f"wandb-core .*--pid {os.getpid()}"], capture_output=True)
    return found.returncode == 0
