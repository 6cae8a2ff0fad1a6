"""The run recorder: the learner's ledger and the held-out evaluations become metrics.jsonl and curves.png.

    rec = RunRecorder(RunLayout(run_dir), client=lambda: redis_client, say=print)
    entries = rec.new_entries()         # ledger lines added since the last call
    rows = rec.record_steps(entries, states)   # -> rows of kind "train" (with the mesh's numbers)
    rec.record_evals()                  # new dapo:eval entries -> rows of kind "eval"

One row per policy version: a version trained again after a learner crash (the ledger has it twice) is
recorded once. NaN numbers (not known yet) are left out of a row.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mesh import curves
from mesh.layout import RunLayout
from mesh.live import ServiceState, mesh_numbers
from mesh.trackers import Trackers
from services.episode_log import read_jsonl
from services.ledger import LedgerTail
from services.schemas import LedgerEntry
from services.snapshots import write_atomic

TABLE_COLUMNS = ["version", "task", "prompt", "response", "reward", "acc", "advantage"]


class RunRecorder:
    def __init__(
        self,
        paths: RunLayout,
        *,
        client: Callable[[], Any],
        say: Callable[[str], None] = print,
        trackers: Trackers | None = None,
        table_every: int = 5,
        table_rows: int = 16,
    ):
        self.paths, self.client, self.say = paths, client, say
        self.trackers, self.table_every, self.table_rows = trackers, table_every, table_rows
        self.tail = LedgerTail(paths.learner)
        self.version = 0  # the newest policy version in metrics.jsonl
        self.evaluated: set[int] = set()  # policy versions with a held-out evaluation
        self._eval_seen = ""  # the last dapo:eval entry recorded

    def new_entries(self) -> list[LedgerEntry]:
        return self.tail.read()

    def record_steps(self, entries: list[LedgerEntry], states: list[ServiceState]) -> list[dict[str, Any]]:
        rows = []
        for e in entries:
            if e.version > self.version:  # a version trained again after a learner crash: logged once
                self.version = e.version
                rows.append(row(e, states))
        self.append(rows)
        for r in rows:
            if self.trackers is not None and r["policy_version"] % self.table_every == 0:
                self.trackers.log_table(r["policy_version"], TABLE_COLUMNS, self.episode_table(r["policy_version"]))
        return rows

    def episode_table(self, version: int) -> list[list[Any]]:
        """The trackers' table of sampled episodes trained into `version`: the first samples of its recorded groups
        (the learner's --record-episodes), `table_rows` at most; none when nothing was recorded."""
        out: list[list[Any]] = []
        for g in read_jsonl(self.paths.episodes[0] / f"v{version:06d}.jsonl"):
            for s in g["samples"]:
                if len(out) == self.table_rows:
                    return out
                out.append([version, g["task"], g["prompt"] or "", s["text"], s["reward"], s["acc"], s["advantage"]])
        return out

    def record_evals(self) -> list[dict[str, Any]]:
        """New held-out evaluations (dapo:eval) -> rows of metrics.jsonl with kind "eval"."""
        import redis

        from services.schemas import EvalResult
        from services.streams import STREAM_EVAL, DecodeError, RedisUnavailable, decode

        try:
            entries = self.client().xrange(STREAM_EVAL, min=f"({self._eval_seen}" if self._eval_seen else "-")
        except (RedisUnavailable, redis.RedisError, OSError) as err:  # Redis restarting: the next pass reads them
            self.say(f"[yellow]could not read {STREAM_EVAL}: {err}[/]")
            return []
        rows: list[dict[str, Any]] = []
        for entry_id, fields in entries:
            self._eval_seen = entry_id.decode()
            try:
                e = decode(fields, EvalResult)
            except DecodeError as err:  # another version's replica, a result over the size bound: said, passed over
                self.say(f"[yellow]an evaluation on {STREAM_EVAL} could not be read ({err}): skipped[/]")
                continue
            rows.append(
                {
                    "kind": "eval",
                    "step": e.version,
                    "policy_version": e.version,
                    "eval_acc": e.avg_at_k,
                    "eval_pass_at_k": e.pass_at_k,
                    "eval_k": e.k,
                    "eval_prompts": e.n_prompts,
                    "eval_response_tokens": e.mean_response_tokens,
                    "eval_seconds": e.seconds,
                    "eval_newest_version": e.newest_version if e.newest_version is not None else e.version,
                    "eval_later_token_frac": e.later_token_frac,
                    "eval_at": e.created_at,
                    "eval_mean_token_version": e.mean_token_version or float(e.version),
                    **{f"eval_acc/{task}": acc for task, acc in e.by_task.items()},
                }
            )
            self.say(
                f"held-out eval of version {e.version}: avg@{e.k} {e.avg_at_k:.3f}  pass@{e.k} "
                f"{e.pass_at_k:.3f}  ({e.n_prompts} prompts, {e.seconds:.0f} s)"
            )
            if e.samples:  # what the viewer shows of it
                try:
                    self.write_eval_samples(e)
                except OSError as err:
                    self.say(f"[yellow]could not write the held-out samples of version {e.version}: {err}[/]")
        self.append(rows)
        self.evaluated.update(r["policy_version"] for r in rows)
        return rows

    def write_eval_samples(self, e: Any) -> None:
        """evals/v<version>.jsonl: the held-out samples the replica published with its result (replaced whole: an
        evaluation of the same version read again is the same file)."""
        self.paths.evals.mkdir(parents=True, exist_ok=True)
        lines = [json.dumps(s.model_dump(mode="json") | {"version": e.version}) + "\n" for s in e.samples]
        write_atomic(self.paths.evals / f"v{e.version:06d}.jsonl", "".join(lines))

    def append(self, rows: list[dict[str, Any]]) -> None:
        """Rows to metrics.jsonl (curves.png is drawn from it at the end: `draw`)."""
        if not rows:
            return
        with self.paths.metrics.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        if self.trackers is not None:  # after metrics.jsonl: a tracker never holds what the run's own record lacks
            self.trackers.log_rows(rows)

    def draw(self) -> Path | None:
        """curves.png from metrics.jsonl: once, when the run ends (it used to be redrawn at every step, on the cores
        the run needs)."""
        return curves.plot(self.paths.metrics, self.paths.curves)


def row(e: LedgerEntry, states: list[ServiceState]) -> dict[str, Any]:
    """One line of metrics.jsonl: the learner's step, and the mesh's numbers at that moment."""
    mesh = {k: v for k, v in mesh_numbers(states).items() if not math.isnan(v)}  # NaN: not known yet
    return {
        "kind": "train",
        "step": e.version,
        "policy_version": e.version,
        "batch_id": e.batch_id,
        "lag": e.lag,
        **e.metrics,
        **mesh,
    }


def line(r: dict[str, Any], steps: int) -> str:
    """A step's row as one line of the mesh's output (when it is not on a terminal)."""
    return (
        f"step {r['step']}/{steps} (version {r['policy_version']}): reward {r['reward_mean']:+.3f}  "
        f"acc {r['acc_mean']:.3f}  entropy {r['entropy']:.3f}  clip {r.get('clip_frac_upper', 0.0):.3f}  "
        f"filtered {r.get('filtered_frac', float('nan')):.0%}  "
        f"{r.get('generated_per_trained', float('nan')):.2f} generated per trained  {r['seconds']:.1f} s"
    )
