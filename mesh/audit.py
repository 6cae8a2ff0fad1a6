"""`dapo-mesh audit RUN_DIR`: does every dispatched prompt have an account?

It reads the streams (prompts, rollouts, batches, dropped records, dead letters) and their consumer
groups' pending lists from Redis, and the learner's checkpointed state and ledger from the run
directory, and puts every dispatched prompt (task id) in exactly one place:

    trained        in a batch whose update the checkpointed weights contain (as the ledger lists its groups)
    dropped        the buffer decided not to train it, with the reason (dynamic sampling, stale), or the learner
                   found it too stale at the update; a group dropped as a duplicate counts where its other copy
                   is, and as vanished if that is nowhere
    in_batch       in a published batch the learner has not trained (yet)
    at_buffer      scored, waiting for the buffer (its pending list or unread)
    at_rollout     not answered yet (the rollout group's pending list or unread)
    dead_lettered  moved to the dead-letter stream
    vanished       none of the above: a loss. Must be empty.

It also checks that no batch id is in the weights twice and that no group is in two batches, and reports how old
the trained tokens were: the version lag of every response token of the trained batches still in the stream (the
learner's version at the update minus the version that sampled the token, from each sample's per-token versions),
and how many samples spanned more than one version (continuous batching loads weights in flight).
The streams keep what the services' trimming settings keep: for a complete audit, run with trimming
above the run's size (the chaos test does); anything trimmed is reported, not guessed.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis

from buffer.curriculum import KEY_PROMPT_STATE, PromptStates
from learner.checkpoint import read_state
from mesh.layout import RunLayout
from services.ledger import read_ledger
from services.schemas import DroppedGroup, PromptTask, ScoredGroup, TrainBatch
from services.streams import (
    DEAD_LETTER_STREAM,
    GROUP_BUFFER,
    GROUP_ROLLOUT,
    STREAM_BATCHES,
    STREAM_DROPPED,
    STREAM_PROMPTS,
    STREAM_ROLLOUTS,
    as_str,
    decode,
    parse_id,
)

PLACES = ("trained", "in_batch", "dropped", "at_buffer", "at_rollout", "dead_lettered", "vanished")


@dataclass
class AuditReport:
    dispatched: int = 0
    places: dict[str, int] = field(default_factory=dict)
    dropped_by_reason: dict[str, int] = field(default_factory=dict)
    vanished: list[str] = field(default_factory=list)
    batches_trained: int = 0
    batches_trained_twice: list[int] = field(default_factory=list)
    groups_in_two_batches: list[str] = field(default_factory=list)
    trainings_lost_in_crashes: int = 0  # ledger lines of batches trained again after a learner crash
    dead_letters: int = 0
    restarts: dict[str, int] = field(default_factory=dict)  # from the mesh's supervisor.jsonl
    trimmed_prompts: bool = False
    token_lag: dict[int, int] = field(default_factory=dict)  # version lag -> trained response tokens
    samples_trained: int = 0  # samples of the trained batches found in the stream
    samples_spanning: int = 0  # ... whose tokens span more than one policy version
    state_checked: int = 0  # prompts whose pass-rate state was checked against the groups the buffer received
    state_miscounted: list[str] = field(default_factory=list)  # ... whose count of groups is not that many

    @property
    def balanced(self) -> bool:
        lists = (self.vanished, self.batches_trained_twice, self.groups_in_two_batches, self.state_miscounted)
        return not any(lists)

    def to_json(self) -> str:
        return json.dumps(asdict(self) | {"balanced": self.balanced}, indent=1)


def stream_entries(client: redis.Redis, stream: str) -> list[tuple[str, dict[bytes, bytes]]]:
    """Every entry of a stream, read in pages of 1,000 (XRANGE), as (entry id, fields)."""
    out: list[tuple[str, dict[bytes, bytes]]] = []
    start = "-"
    while True:
        chunk = client.xrange(stream, min=start, count=1000)
        if not chunk:
            return out
        out += [(as_str(i), f) for i, f in chunk]
        last = parse_id(as_str(chunk[-1][0]))
        start = f"{last[0]}-{last[1] + 1}"


def _unacknowledged(client: redis.Redis, stream: str, group: str, entry_ids: list[str]) -> tuple[set[str], set[str]]:
    """Of `entry_ids` (the stream's entries), those a group has not acknowledged: (read and pending, not read yet)."""
    try:
        groups = {as_str(g["name"]): g for g in client.xinfo_groups(stream)}
    except redis.ResponseError:  # no such stream
        return set(), set()
    if group not in groups:
        return set(), set(entry_ids)
    last = parse_id(as_str(groups[group]["last-delivered-id"]))
    return _pending(client, stream, group), {i for i in entry_ids if parse_id(i) > last}


def _pending(client: redis.Redis, stream: str, group: str) -> set[str]:
    """The entries a group has read and not acknowledged (XPENDING, in pages of 1,000)."""
    ids: set[str] = set()
    start = "-"
    while True:
        pend = client.xpending_range(stream, group, min=start, max="+", count=1000)
        if not pend:
            return ids
        ids |= {as_str(p["message_id"]) for p in pend}
        tail = parse_id(as_str(pend[-1]["message_id"]))
        start = f"{tail[0]}-{tail[1] + 1}"


def audit(client: redis.Redis, run_dir: Path) -> AuditReport:
    r = AuditReport()
    paths = RunLayout(run_dir)
    prompts = [(i, decode(f, PromptTask)) for i, f in stream_entries(client, STREAM_PROMPTS)]  # each stream read once
    dispatched = {t.task_id for _, t in prompts}
    r.dispatched = len(dispatched)
    added = int(client.xinfo_stream(STREAM_PROMPTS).get("entries-added", 0)) if prompts else 0
    r.trimmed_prompts = added > len(prompts)
    waiting_prompts = set().union(*_unacknowledged(client, STREAM_PROMPTS, GROUP_ROLLOUT, [i for i, _ in prompts]))
    at_rollout = {t.task_id for i, t in prompts if i in waiting_prompts}

    rollouts = [(i, decode(f, ScoredGroup).task) for i, f in stream_entries(client, STREAM_ROLLOUTS)]
    read_groups, unread_groups = _unacknowledged(client, STREAM_ROLLOUTS, GROUP_BUFFER, [i for i, _ in rollouts])
    at_buffer = {t.task_id for i, t in rollouts if i in read_groups | unread_groups}
    prompt_of = {t.task_id: t.prompt_id for _, t in prompts} | {t.task_id: t.prompt_id for _, t in rollouts}

    reasons: dict[str, set[str]] = defaultdict(set)
    for _, f in stream_entries(client, STREAM_DROPPED):
        d = decode(f, DroppedGroup)
        reasons[d.task_id].add(d.reason)
        prompt_of.setdefault(d.task_id, d.prompt_id)
    # a group dropped only as a duplicate is accounted by its other copy: with none trained, batched or waiting,
    # it was a copy of itself (a consumer that reclaimed what it still held) and the group is lost
    dropped = {t: min(rs - {"duplicate"}) for t, rs in reasons.items() if rs - {"duplicate"}}
    r.dropped_by_reason = dict(Counter(min(rs) if rs == {"duplicate"} else dropped[t] for t, rs in reasons.items()))

    # batches are told apart by content (TrainBatch.digest), not by id: a Redis that lost its last writes hands
    # an id out again, for another batch
    state = read_state(paths.learner)
    keys = state.keys() if state is not None else []
    id_of = dict(zip(keys, state.trained if state is not None else [], strict=True))
    r.batches_trained = len(keys)
    r.batches_trained_twice = sorted(id_of[k] for k, n in Counter(keys).items() if n > 1)
    in_weights = set(keys)

    batch_groups: dict[str, set[str]] = {}
    batches: dict[str, TrainBatch] = {}
    for _, f in stream_entries(client, STREAM_BATCHES):
        b = decode(f, TrainBatch)
        batches.setdefault(b.digest(), b)
        batch_groups.setdefault(b.digest(), {g.group_id for g in b.groups})
    ledger = read_ledger(paths.learner)
    token_lags(r, {e.digest: (e.version - 1, batches[e.digest]) for e in ledger if e.digest in batches})
    trained_groups: dict[str, set[str]] = {}  # what each trained batch put in the weights: the ledger's task ids
    for e in ledger:
        batch_groups.setdefault(e.digest or f"#{e.batch_id}", set(e.task_ids))
        trained_groups.setdefault(e.digest or f"#{e.batch_id}", set(e.task_ids))
    r.trainings_lost_in_crashes = max(0, len(ledger) - len({e.digest or f"#{e.batch_id}" for e in ledger}))
    owners: dict[str, set[str]] = defaultdict(set)
    for key, tids in batch_groups.items():
        for t in tids:
            owners[t].add(key)
    r.groups_in_two_batches = sorted(t for t, bids in owners.items() if len(bids) > 1)
    # a group of a trained batch is trained unless the learner dropped it at the update (too stale by then)
    trained = {t for k in in_weights for t in trained_groups.get(k, batch_groups.get(k, set()))}
    in_batch = set(owners) - trained

    entries = stream_entries(client, DEAD_LETTER_STREAM)
    r.dead_letters = len(entries)
    dead = {t for _, f in entries for t in _task_ids_of_dead_letter(f)}

    counts = dict.fromkeys(PLACES, 0)
    # the first place that holds a task id is its place; in none, it vanished
    held = [("trained", trained), ("dropped", set(dropped)), ("in_batch", in_batch), ("at_buffer", at_buffer)]
    held += [("at_rollout", at_rollout), ("dead_lettered", dead)]
    for t in dispatched:
        place = next((name for name, ids in held if t in ids), "vanished")
        counts[place] += 1
        if place == "vanished":
            r.vanished.append(t)
    r.places = counts
    r.vanished.sort()
    maybe = {t.task_id for i, t in rollouts if i in read_groups} | dead  # read, perhaps counted, not acknowledged
    check_prompt_state(r, client, prompt_of, received=trained | set(dropped) | in_batch, maybe=maybe)
    sup = paths.supervisor_log
    if sup.exists():
        r.restarts = dict(Counter(json.loads(x)["service"] for x in sup.read_text().splitlines() if x.strip()))
    return r


def check_prompt_state(
    r: AuditReport, client: redis.Redis, prompt_of: dict[str, str], *, received: set[str], maybe: set[str]
) -> None:
    """Is every group the buffer took in counted once in its prompt's pass-rate state (buffer/curriculum.py)? A
    prompt's count of groups must be at least its groups trained, batched or dropped (a duplicate's copy is not
    counted again), and at most that plus its groups that may or may not have been counted: read by the buffer and
    not acknowledged when the run stopped (counted as they are read, unless the buffer died in between), or
    dead-lettered. Not checked when a group's prompt is unknown (a trimmed stream) or the state is absent."""
    if any(t not in prompt_of for t in received) or (received and not client.exists(KEY_PROMPT_STATE)):
        return
    low = Counter(prompt_of[t] for t in received)
    high = Counter(prompt_of[t] for t in maybe - received if t in prompt_of)
    counted = {p: s.groups for p, s in PromptStates(client).scan()}
    seen = counted.keys() | low.keys()
    r.state_checked = len(seen)
    r.state_miscounted = sorted(p for p in seen if not low[p] <= counted.get(p, 0) <= low[p] + high[p])


def token_lags(r: AuditReport, trained: dict[str, tuple[int, TrainBatch]]) -> None:
    """The version lag of every response token of the trained batches (each at the version it was trained at)."""
    lags: Counter[int] = Counter()
    for at, batch in trained.values():
        for g in batch.groups:
            for smp in g.samples:
                lags.update(at - v for v in smp.token_versions())
                r.samples_trained += 1
                r.samples_spanning += smp.n_versions > 1
    r.token_lag = dict(sorted(lags.items()))


def _task_ids_of_dead_letter(fields: dict[bytes, bytes]) -> set[str]:
    """Best effort: the task id inside a dead letter's original message, if it still decodes."""
    orig = {k.removeprefix(b"orig:"): v for k, v in fields.items() if k.startswith(b"orig:")}
    for model in (PromptTask, ScoredGroup, TrainBatch):
        try:
            msg: Any = decode(orig, model)
        except Exception:  # noqa: BLE001 -- a dead letter is, by definition, a message that may not decode
            continue
        if isinstance(msg, PromptTask):
            return {msg.task_id}
        if isinstance(msg, ScoredGroup):
            return {msg.task.task_id}
        return {g.group_id for g in msg.groups}
    return set()
