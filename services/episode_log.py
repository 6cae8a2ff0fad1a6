"""Episodes recorded for people to read (`dapo-mesh view`): a sampled share of the groups the learner trained and the
buffer or learner dropped, token by token, bounded on disk.

    log = EpisodeLog(run_dir / "episodes", fraction=1.0, max_mb=256, meta={"model_dir": "..."})
    if log.wants(group.group_id): ...
    log.write("v000012.jsonl", [group_record(g, "trained", version=12, ...)], replace=True)

One JSON line per group (`group_record`): the task (its prompt text, ground truth cut to a length), and per sample
its reward, accuracy, advantage, finish reason, response text and token ids, the behaviour log-prob of each token, the
learner's log-prob of it before the update (pi_prox: how far the learner's distribution is from the sampler's), the
policy version of each token as runs, the turns (model / environment) as runs, and the loss mask as runs. Floats are
rounded to 4 decimals (a log-prob gap below 1e-4 is not something a reader sees). Which groups: a hash of the group id
under `fraction` (a restarted writer keeps the same choice). The writer owns its directory: at `max_mb` it stops
recording and says so once, in its log and in meta.json (`stopped_at`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from services.schemas import PROMPT_CHARS, Sample, ScoredGroup
from services.snapshots import write_atomic

log = logging.getLogger(__name__)
FORMAT = 1
META = "meta.json"
TRUTH_CHARS = 1000


def runs(values: Sequence[Any]) -> list[list[Any]]:
    """[a, a, b] -> [[a, 2], [b, 1]]: per-token labels (versions, roles, mask bits) as run-lengths."""
    out: list[list[Any]] = []
    for v in values:
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([v, 1])
    return out


def expand(pairs: Sequence[Sequence[Any]] | None, n: int, default: Any) -> list[Any]:
    """Run-lengths back to one label per token (`n` of `default` when there are none)."""
    if not pairs:
        return [default] * n
    return [v for v, k in pairs for _ in range(int(k))]


def _r(xs: Any) -> list[float]:
    """Floats (a list, an array, packed log-probs) rounded to 4 decimals."""
    return list(np.round(np.asarray(xs, dtype=np.float64), 4).tolist())


def sample_record(
    s: Sample,
    reward: float,
    acc: bool,
    pred: str | None,
    *,
    advantage: float | None = None,
    learner_logp: Sequence[float] | None = None,
    loss_mask: Sequence[float] | None = None,
) -> dict[str, Any]:
    """One sample: `learner_logp` and `loss_mask` (one per response token) only for what the learner trained."""
    ids = s.response_token_ids.tolist()
    return {
        "reward": round(float(reward), 4),
        "acc": bool(acc),
        "pred": cut(pred, 200),
        "advantage": None if advantage is None else round(float(advantage), 4),
        "finish": s.finish_reason,
        "text": s.response_text,
        "ids": ids,
        "logp": _r(s.logprobs),
        "learner_logp": None if learner_logp is None else _r(learner_logp),
        "versions": runs(s.token_versions()),
        "turns": None if not s.turns else [[t.role, t.tokens] for t in s.turns],
        "mask": runs([int(m > 0) for m in (loss_mask if loss_mask is not None else s.loss_mask())]),
        "episode": None if s.episode is None else s.episode.model_dump(mode="json"),
    }


def group_record(
    g: ScoredGroup,
    outcome: str,
    version: int,
    *,
    reason: str | None = None,
    batch_id: int | None = None,
    samples: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A group as one line. `outcome`: "trained" (into policy `version`) or "dropped" (at the learner's `version`,
    for `reason`); `samples`: sample_record()s with the learner's numbers (default: the group's own)."""
    t = g.task
    return {
        "format": FORMAT,
        "outcome": outcome,
        "reason": reason,
        "version": version,
        "batch_id": batch_id,
        "group_id": g.group_id,
        "prompt_id": t.prompt_id,
        "task": t.data_source,
        "prompt": cut(t.prompt),
        "ground_truth": cut(t.ground_truth, TRUTH_CHARS),
        "replica": g.replica_id,
        "created_at": g.created_at,
        "sampling": None if g.sampling is None else g.sampling.model_dump(mode="json"),  # sampled in rounds
        "samples": samples
        if samples is not None
        else [sample_record(s, sc.reward, sc.acc, sc.pred) for s, sc in zip(g.samples, g.scores, strict=True)],
    }


def cut(text: str | None, limit: int = PROMPT_CHARS) -> str | None:
    """`text` at most `limit` characters, and "…" where it was cut."""
    return text if text is None or len(text) <= limit else text[:limit] + "…"


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The complete lines of a JSON-lines file another process may be appending to: a last line without its newline
    (being written) and a line that is no JSON object are left out; [] without the file."""
    try:
        data = path.read_bytes()
    except OSError:
        return []
    out = []
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            out.append(value)
    return out


class EpisodeLog:
    """A writer's directory of recorded groups: the share it records, and its bound on disk."""

    def __init__(self, directory: Path, *, fraction: float, max_mb: float, meta: dict[str, Any] | None = None):
        self.dir, self.fraction, self.limit = directory, fraction, int(max_mb * 1024 * 1024)
        self.stopped = fraction <= 0
        self.bytes = 0
        if self.stopped:
            return
        directory.mkdir(parents=True, exist_ok=True)
        self.bytes = sum(p.stat().st_size for p in directory.glob("*.jsonl"))  # a restarted writer's earlier share
        self.meta = {"format": FORMAT, **(meta or {})}
        old = self._meta()
        if old.get("stopped_at") is not None:
            self.meta["stopped_at"] = old["stopped_at"]
        self._write_meta()

    def wants(self, group_id: str) -> bool:
        """Whether this group is recorded: its id's hash under the fraction (the same answer after a restart)."""
        if self.stopped:
            return False
        if self.fraction >= 1:
            return True
        h = int.from_bytes(hashlib.blake2b(group_id.encode(), digest_size=8).digest(), "big")
        return h < self.fraction * 2**64

    def write(self, name: str, records: list[dict[str, Any]], *, version: int, replace: bool = False) -> int:
        """Append `records` to `name` (`replace`: the file becomes them, written whole then renamed: a batch trained
        again after a crash records itself once). Returns the bytes written. The bound is checked record by record
        as they are encoded: at the bound, what fits is written and recording stops."""
        if self.stopped or not records:
            return 0
        path = self.dir / name
        before = path.stat().st_size if replace and path.exists() else 0
        room = self.limit - (self.bytes - before)
        lines: list[str] = []
        size = 0
        for r in records:
            line = json.dumps(r, separators=(",", ":")) + "\n"  # ASCII (ensure_ascii): characters are bytes
            if size + len(line) > room:
                self._stop(version)
                break
            lines.append(line)
            size += len(line)
        if not lines and not replace:
            return 0
        if replace:
            write_atomic(path, "".join(lines))
        else:
            with path.open("a") as f:
                f.write("".join(lines))
        self.bytes += size - before
        return size

    def _stop(self, version: int) -> None:
        self.stopped = True
        self.meta["stopped_at"] = version
        self._write_meta()
        log.warning(
            "episode recording stopped at version %d: %s holds %.0f MB, the bound (raise record_episodes_mb)",
            version,
            self.dir,
            self.bytes / 2**20,
        )

    def _meta(self) -> dict[str, Any]:
        try:
            return dict(json.loads((self.dir / META).read_text()))
        except (OSError, ValueError):
            return {}

    def _write_meta(self) -> None:
        write_atomic(self.dir / META, json.dumps(self.meta, indent=1))
