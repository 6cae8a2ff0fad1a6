"""Experiment trackers: a run's metrics.jsonl rows, its resolved config and tables of sampled episodes, mirrored to
Weights & Biases, MLflow and TensorBoard (the preset's `trackers = [...]` and its `[tracking]` table).

    trackers = open_trackers(["wandb", "tensorboard"], TrackingSettings(), run_dir, params=cfg.model_dump(mode="json"))
    trackers.log_rows(rows)             # rows as RunRecorder appends them to metrics.jsonl
    trackers.log_table(version, ["prompt", "response", "reward"], [["1+1=", "2", 1.0]])
    trackers.close()

Everything goes under RUN_DIR/trackers/: wandb/offline-run-*/ (`wandb sync` uploads it later), mlruns/ (MLflow's
sqlite store and its artifacts), tensorboard/PROJECT/RUN_NAME/ (event files). docs/operations/trackers.md says how
to open each.

A tracker's library is imported when it is opened, never by a mesh that names none: mlflow takes ~2 s of CPU to
import, wandb ~0.7 s, and the orchestrator must stay under 1% of the run's CPU. A failure at start-up is a
TrackerError (one line, before any service starts); a failure later is said once and the run goes on (`Trackers`).
"""

from __future__ import annotations

import html
import json
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

TRACKERS = ("wandb", "mlflow", "tensorboard")
INSTALL = "pip install 'dapo-mesh[trackers]'"
FAILS_TO_DISABLE = 3  # failures in a row after which a tracker is switched off for the rest of the run
NAME = r"^[\w-][\w.-]{0,127}$"  # a project or run name: also a folder name (TensorBoard), so no "/" and no ".."

Point = tuple[int, dict[str, float]]  # (step = policy version, {metric: value})


class TrackerError(ValueError):
    """A tracker that cannot start: not installed, a bad URI, a folder that cannot be written."""


class TrackingSettings(BaseModel):
    """The preset's [tracking] table: what the trackers named by `trackers = [...]` record, and where."""

    model_config = ConfigDict(extra="forbid")

    project: str = Field(
        "dapo-mesh", pattern=NAME, description="W&B project, MLflow experiment name, TensorBoard subfolder"
    )
    run_name: str | None = Field(None, pattern=NAME, description="the run's name in each tracker; None: RUN_DIR's name")
    table_every: int = Field(5, ge=1, description="a table of sampled episodes every N policy versions")
    table_rows: int = Field(16, ge=1, description="rows per episode table at most")
    wandb_mode: Literal["offline", "online"] = Field(
        "offline", description="offline: files only, no network (upload later with `wandb sync`); online: needs login"
    )
    wandb_entity: str | None = Field(None, description="W&B team or user (online); None: the login's default entity")
    mlflow_tracking_uri: str | None = Field(
        None,
        description="an MLflow tracking server or store (http://..., sqlite:///...); None: a local sqlite store "
        "under RUN_DIR/trackers/mlruns",
    )


class Tracker(Protocol):
    """One tracking library's side: what Trackers calls. Each method may raise; Trackers decides what follows."""

    def log_points(self, points: list[Point]) -> None: ...

    def log_table(self, version: int, columns: list[str], rows: list[list[Any]]) -> None: ...

    def close(self) -> None: ...


# The pure parts: rows, params and tables into what the trackers take.


def metrics_of(row: dict[str, Any]) -> dict[str, float]:
    """A metrics.jsonl row's finite numbers under their own names; "kind" and "step" (the x-axis) left out, strings
    and None skipped, NaN and inf skipped (not known), booleans as 0/1."""
    out = {}
    for k, v in row.items():
        if k in ("kind", "step") or not isinstance(v, int | float):
            continue
        if math.isfinite(v):
            out[k] = float(v)
    return out


def flatten(params: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts to dotted keys: {"learner": {"lr": 1e-6}} -> {"learner.lr": 1e-6}; other values as they are."""
    out: dict[str, Any] = {}
    for k, v in params.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{key}."))
        else:
            out[key] = v
    return out


def param_text(value: Any) -> str:
    """A parameter's value as text: strings as they are, everything else as JSON (lists, None -> null)."""
    return value if isinstance(value, str) else json.dumps(value, default=str)


def mlflow_key(name: str) -> str:
    """A metric or parameter name MLflow accepts: it refuses characters other than word characters, "./- :", and
    names that a path normalization would change ("a//b", "a/./b"); such characters become "_"."""
    parts = [re.sub(r"[^\w.\- :]", "_", p) for p in name.split("/")]
    return "/".join("_" if p in ("", ".", "..") else p for p in parts)[:250]


def markdown_table(columns: Sequence[Any], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table (TensorBoard's text plugin renders it): a cell's "|" escaped, its newlines as <br>, its HTML
    shown as text (a model's "<think>" is not a tag)."""

    def cell(v: Any) -> str:
        return html.escape(str(v), quote=False).replace("|", "\\|").replace("\r\n", "\n").replace("\n", "<br>")

    lines = ["| " + " | ".join(cell(c) for c in columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


# The adapters: each imports its library when it is opened and raises whatever the library raises.


class WandbTracker:
    def __init__(self, settings: TrackingSettings, root: Path, run_name: str, params: dict[str, Any]):
        import wandb

        quiet = {  # no console capture (the live view owns the terminal), no system-metrics sampler, no code,
            # git, requirements, command line or host name in the run's files
            "console": "off",
            "silent": True,
            "x_disable_stats": True,
            "x_disable_meta": True,
            "x_disable_machine_info": True,
            "save_code": False,
            "disable_git": True,
            "x_save_requirements": False,
        }
        # wandb's own telemetry follows the process-wide settings, not the run's: without this an offline run's
        # first log() starts OpenTelemetry exporters that look up api.wandb.ai when the process exits.
        wandb.setup(settings=wandb.Settings(mode=settings.wandb_mode, **quiet))
        self.wandb = wandb
        try:
            self.run = wandb.init(
                mode=settings.wandb_mode,
                dir=str(root),  # wandb adds wandb/offline-run-*/ below it
                project=settings.project,
                entity=settings.wandb_entity,
                name=run_name,
                config=params,
                settings=wandb.Settings(**quiet),
            )
        except BaseException:
            wandb.teardown()  # the wandb-core process it may have started
            raise
        # W&B drops a row whose step is below the newest one, and a held-out evaluation of version v arrives after
        # the train row of a later version: so the x-axis is the policy version, a metric of each row, and wandb's
        # own _step just counts the rows.
        self.run.define_metric("policy_version")
        self.run.define_metric("*", step_metric="policy_version")

    def log_points(self, points: list[Point]) -> None:
        for step, values in points:
            self.run.log({**values, "policy_version": step})

    def log_table(self, version: int, columns: list[str], rows: list[list[Any]]) -> None:
        header: list[str | int] = list(columns)
        self.run.log({"episodes": self.wandb.Table(columns=header, data=rows), "policy_version": version})

    def close(self) -> None:
        try:
            self.run.finish()
        finally:
            self.wandb.teardown()  # ends the wandb-core process that finish() leaves running


class MlflowTracker:
    def __init__(self, settings: TrackingSettings, root: Path, run_name: str, params: dict[str, Any]):
        import logging

        # MLflow 3 starts a thread at import that fetches a telemetry config from the internet and reports usage
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        from mlflow import MlflowClient
        from mlflow.entities import Param

        uri, artifacts = settings.mlflow_tracking_uri, None
        if uri is None:  # the sqlite store: MLflow 3 refuses the ./mlruns file store unless MLFLOW_ALLOW_FILE_STORE
            store = root / "mlruns"
            store.mkdir(parents=True, exist_ok=True)
            uri, artifacts = f"sqlite:///{store / 'mlflow.db'}", (store / "artifacts").as_uri()
        elif uri.startswith(("http://", "https://")):
            # MLflow retries a request 7 times with backoff and waits 120 s for an answer: minutes in which the
            # orchestrator's loop would stand still. A server that does not answer fails fast, and Trackers says so.
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        for name in ("mlflow.store.db.utils", "alembic"):  # "Creating initial MLflow database tables..." at INFO
            logging.getLogger(name).setLevel(logging.WARNING)
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(settings.project)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self.client.create_experiment(settings.project, artifact_location=artifacts)
        )
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        given = [Param(mlflow_key(k), param_text(v)[:6000]) for k, v in flatten(params).items()]  # 6000: its limit
        for i in range(0, len(given), 100):  # at most 100 parameters per request
            self.client.log_batch(self.run_id, params=given[i : i + 100])

    def log_points(self, points: list[Point]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(mlflow_key(k), v, now, step) for step, values in points for k, v in values.items()]
        for i in range(0, len(metrics), 1000):  # at most 1000 metrics per request
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def log_table(self, version: int, columns: list[str], rows: list[list[Any]]) -> None:
        data = {c: [r[i] for r in rows] for i, c in enumerate(columns)}
        self.client.log_table(self.run_id, data=data, artifact_file=f"episodes/v{version:06d}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class TensorBoardTracker:
    """TensorBoard's own event-file writer, which torch's SummaryWriter wraps: the same files, without importing
    torch into the orchestrator (0.2 s of CPU instead of 2 s)."""

    def __init__(self, settings: TrackingSettings, root: Path, run_name: str, params: dict[str, Any]):
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.logdir = root / "tensorboard" / settings.project / run_name
        self.writer = EventFileWriter(str(self.logdir), flush_secs=30)
        config = markdown_table(["parameter", "value"], [[k, param_text(v)] for k, v in flatten(params).items()])
        self._text("config", config, step=0)

    def log_points(self, points: list[Point]) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        for step, values in points:
            summary = Summary(value=[Summary.Value(tag=k, simple_value=v) for k, v in values.items()])
            self.writer.add_event(Event(wall_time=time.time(), step=step, summary=summary))

    def log_table(self, version: int, columns: list[str], rows: list[list[Any]]) -> None:
        self._text("episodes", markdown_table(columns, rows), step=version)

    def _text(self, tag: str, markdown: str, step: int) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.plugins.text.summary_v2 import text_pb

        self.writer.add_event(Event(wall_time=time.time(), step=step, summary=text_pb(tag, markdown)))

    def close(self) -> None:
        self.writer.close()


OPENERS: dict[str, Callable[[TrackingSettings, Path, str, dict[str, Any]], Tracker]] = {
    "wandb": WandbTracker,
    "mlflow": MlflowTracker,
    "tensorboard": TensorBoardTracker,
}


def open_trackers(
    names: list[str],
    settings: TrackingSettings,
    run_dir: Path,
    params: dict[str, Any],
    say: Callable[[str], None] = print,
) -> Trackers:
    """Each named tracker opened under run_dir/trackers/, with `params` (the resolved config) as the run's
    parameters. Raises TrackerError in one line when one cannot start (the ones already open are closed)."""
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise TrackerError(f"unknown tracker {unknown[0]!r} in trackers = [...]: choose from {', '.join(TRACKERS)}")
    opened: dict[str, Tracker] = {}
    if not names:
        return Trackers(opened, say)
    root = run_dir / "trackers"
    try:
        root.mkdir(parents=True, exist_ok=True)
        (root / ".write-test").touch()
        (root / ".write-test").unlink()
    except OSError as e:
        raise TrackerError(f"cannot write the trackers' folder {root}: {e}") from None
    run_name = settings.run_name or run_dir.resolve().name
    try:
        for name in dict.fromkeys(names):
            opened[name] = _open(name, settings, root, run_name, params)
    except TrackerError:
        Trackers(opened, lambda _: None).close()
        raise
    say(f"trackers: {', '.join(opened)} (files under {root})")
    return Trackers(opened, say)


def _open(name: str, settings: TrackingSettings, root: Path, run_name: str, params: dict[str, Any]) -> Tracker:
    try:
        return OPENERS[name](settings, root, run_name, params)
    except ImportError as e:
        raise TrackerError(f"tracker {name!r} is not installed (no module {e.name!r}): {INSTALL}") from None
    except Exception as e:  # whatever the library raises at start-up: a bad URI, a folder it cannot write, ...
        raise TrackerError(f"tracker {name!r} could not start: {_one_line(e)}") from e


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


class Trackers:
    """The open trackers, as the mesh calls them. No call raises: a tracker's failure is said once per kind (the
    call and the exception's type), and a tracker that fails FAILS_TO_DISABLE times in a row is closed and left
    out from then on. Training never waits on a tracker that broke."""

    def __init__(self, opened: dict[str, Tracker], say: Callable[[str], None] = print):
        self.names = list(opened)
        self._open = dict(opened)  # the trackers still in use
        self._say = say
        self._fails: dict[str, int] = {}  # failures in a row, per tracker
        self._said: set[tuple[str, str, str]] = set()  # (tracker, call, exception type) already said

    def log_rows(self, rows: list[dict[str, Any]]) -> None:
        points = [(r["step"], m) for r in rows if isinstance(r.get("step"), int) and (m := metrics_of(r))]
        if points:
            self._each("log_rows", f"at step {points[0][0]}", lambda t: t.log_points(points))

    def log_table(self, version: int, columns: list[str], rows: list[list[Any]]) -> None:
        self._each("log_table", f"at version {version}", lambda t: t.log_table(version, columns, rows))

    def close(self) -> None:
        self._each("close", "while closing", lambda t: t.close())
        self._open.clear()

    def _each(self, call: str, where: str, do: Callable[[Tracker], None]) -> None:
        from rich.markup import escape

        for name, tracker in list(self._open.items()):
            try:
                do(tracker)
            except Exception as e:  # any library error: the run goes on without this record
                self._fails[name] = self._fails.get(name, 0) + 1
                if (name, call, type(e).__name__) not in self._said:
                    self._said.add((name, call, type(e).__name__))
                    self._say(f"[yellow]tracker {name} failed {where}: {escape(_one_line(e))}; training goes on[/]")
                if self._fails[name] >= FAILS_TO_DISABLE and call != "close":
                    self._say(f"[yellow]tracker {name} failed {FAILS_TO_DISABLE} times in a row: off for this run[/]")
                    del self._open[name]
                    with suppress(Exception):  # ends what it started (wandb's service process), if it can
                        tracker.close()
            else:
                self._fails[name] = 0
