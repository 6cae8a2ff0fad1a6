"""How predictable is a dropped group from its prompt's history?  The question under the curriculum's goal.

For runs of `dapo-mesh up` (their run directories: the embedded Redis's `dapo:dropped` records and the learner's
ledger), every scored group of every prompt in dispatch order (epoch, position — a prompt is dispatched at most once
per epoch in these presets) with its outcome: kept (trained), all_correct or all_wrong (dropped by dynamic sampling),
stale. Then, over the groups that have a previous group of their prompt, how often the next group is dropped given
what the previous one or two were — and what the sharpest history rule could reach on the same groups: dispatch a
prompt only when its previous group was kept. Under `uniform` every prompt comes back every epoch, so these are
the conditional rates of the policy's own learning, unbiased by the dispatcher.

    .venv/bin/python docs/results/curriculum/history.py extract RUN_DIR NAME   # -> NAME.outcomes.jsonl here
    .venv/bin/python docs/results/curriculum/history.py report NAME [NAME ...]  # the table, pooled over NAMEs
    .venv/bin/python docs/results/curriculum/history.py classes NAME PRESET     # first groups by class
"""

from __future__ import annotations

import json
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
DROPPED = {"all_correct", "all_wrong"}


def extract(run_dir: Path, name: str) -> Path:
    """Each group of the run: {"prompt", "epoch", "position", "outcome", "correct", "samples"}, written to
    NAME.outcomes.jsonl. A kept group's correct answers come from its batch in `dapo:batches` (a dropped one's are
    0 or all); where the stream no longer holds its batch (the learner trims it), from the batch's mean accuracy in
    the ledger ("exact": false); `correct` is null for a stale group."""
    from mesh.audit import stream_entries
    from mesh.layout import RunLayout
    from services.ledger import read_ledger
    from services.redis_server import EmbeddedRedis
    from services.schemas import DroppedGroup, TrainBatch
    from services.streams import STREAM_BATCHES, STREAM_DROPPED, connect, decode

    layout = RunLayout(run_dir)
    outcome: dict[str, str] = {}
    correct: dict[str, tuple[int, int]] = {}
    batch_acc: dict[str, float] = {}  # a kept group's batch's mean accuracy: where its own batch was trimmed
    for entry in read_ledger(layout.learner):
        outcome.update(dict.fromkeys(entry.task_ids, "kept"))
        batch_acc.update(dict.fromkeys(entry.task_ids, float(entry.metrics.get("acc_mean", 0.5))))
    server = EmbeddedRedis(layout.redis)
    try:
        client = connect(server.start(), retries=2)
        for _, fields in stream_entries(client, STREAM_DROPPED):
            d = decode(fields, DroppedGroup)
            outcome.setdefault(d.task_id, d.reason)
        for _, fields in stream_entries(client, STREAM_BATCHES):
            for g in decode(fields, TrainBatch, max_bytes=1 << 30).groups:
                correct[g.task.task_id] = (round(sum(s.acc for s in g.scores)), len(g.scores))
    finally:
        server.stop()
    n = next(iter(correct.values()))[1] if correct else 8  # G: the presets' when no batch is left to say
    rows = []
    for task_id, what in outcome.items():
        prompt, _, slot = task_id.rpartition("#e")
        epoch, _, position = slot.partition("p")
        c = {"all_correct": (n, n), "all_wrong": (0, n)}.get(what) or correct.get(task_id, (None, n))
        exact = c[0] is not None or what != "kept"
        if not exact:  # kept, its batch trimmed from the stream: its batch's mean, as a count a kept group can have
            c = (min(n - 1, max(1, round(batch_acc[task_id] * n))), n)
        row = {"prompt": prompt, "epoch": int(epoch), "position": int(position), "outcome": what}
        rows.append(row | {"correct": c[0], "samples": c[1], "exact": exact})
    rows.sort(key=lambda r: (r["epoch"], r["position"]))
    out = HERE / f"{name}.outcomes.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def sequences(names: list[str]) -> list[list[dict[str, Any]]]:
    """Per prompt of each run, its groups in dispatch order (stale groups left out: no verdict, no count)."""
    out = []
    for name in names:
        by_prompt: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for line in (HERE / f"{name}.outcomes.jsonl").read_text().splitlines():
            r = json.loads(line)
            if r["outcome"] == "kept" or r["outcome"] in DROPPED:
                by_prompt[r["prompt"]].append(r)
        out += list(by_prompt.values())
    return out


def predictions(
    seqs: list[list[dict[str, Any]]], *, decay: float = 0.5, prior: float = 0.5
) -> list[tuple[float, bool]]:
    """Every group that has a previous one of its prompt: (the curriculum's predicted chance that it is dropped,
    from its prompt's state replayed as buffer/curriculum.py keeps it; dropped or not)."""
    from buffer.curriculum import PromptState, zero_variance_probability

    out = []
    for groups in seqs:
        c = m = 0.0
        for i, r in enumerate(groups):
            if i:
                q = zero_variance_probability(PromptState(c, m, i, 0, 0), r["samples"], prior=prior)
                out.append((float(q or 0.0), r["outcome"] in DROPPED))
            c, m = c * decay + r["correct"], m * decay + r["samples"]
    return out


def skip_rules(seqs: list[list[dict[str, Any]]]) -> list[str]:
    """What the curriculum's rule would drop of these groups at several exploration floors, without feedback: each
    group weighed by its chance of being dispatched, max(explore, 1 - q) (importance weights, for a `uniform` run);
    and the predictor's calibration."""
    pq = predictions(seqs)
    n = len(pq)
    if not n:
        return ["no group has a previous one of its prompt (the run ended in its first pass)"]
    lines = [
        f"groups with history: {n}; predicted dropped {sum(q for q, _ in pq) / n:.0%}, "
        f"observed {sum(d for _, d in pq) / n:.0%}",
        "",
        "| exploration floor | share of these groups dispatched | of those, dropped |",
        "|---|---|---|",
    ]
    for explore in (1.0, 0.1, 0.0):
        w = [max(explore, 1 - q) for q, _ in pq]
        dropped = sum(wi for wi, (_, d) in zip(w, pq, strict=True) if d) / sum(w)
        lines.append(f"| {'1 (uniform)' if explore == 1.0 else explore} | {sum(w) / n:.0%} | {dropped:.0%} |")
    bins: dict[int, list[bool]] = defaultdict(list)
    for q, d in pq:
        bins[min(int(q * 5), 4)].append(d)
    lines += ["", "| predicted dropped | groups | observed dropped |", "|---|---|---|"]
    lines += [f"| {b / 5:.1f}–{(b + 1) / 5:.1f} | {len(v)} | {sum(v) / len(v):.0%} |" for b, v in sorted(bins.items())]
    return lines


def _label(r: dict[str, Any], counts: bool = False) -> str:
    if r["outcome"] != "kept":
        return {"all_correct": "right", "all_wrong": "wrong"}[r["outcome"]]
    if not counts:
        return "kept"
    return f"kept, {r['correct']} of {r['samples']} right" if r["exact"] else "kept (count not recorded)"


def report(names: list[str]) -> str:
    seqs = sequences(names)
    after: dict[str, Counter[str]] = defaultdict(Counter)
    for s in seqs:
        after["none (its first group)"][s[0]["outcome"]] += 1
        for i in range(1, len(s)):
            nxt = s[i]["outcome"]
            after[_label(s[i - 1])][nxt] += 1
            after["any previous group"][nxt] += 1
            if s[i - 1]["outcome"] == "kept":
                after[_label(s[i - 1], counts=True)][nxt] += 1
            if i >= 2:
                after[f"{_label(s[i - 2])}, then {_label(s[i - 1])}"][nxt] += 1

    def row(label: str) -> str:
        c = after[label]
        n = sum(c.values())
        dropped = sum(c[d] for d in DROPPED)
        return f"| {label} | {n} | {dropped / n:.0%} | {c['all_correct'] / n:.0%} | {c['all_wrong'] / n:.0%} |"

    order = ["none (its first group)", "any previous group", "kept", "right", "wrong"]
    order += sorted((k for k in after if k.startswith("kept, ") and " of " in k), key=lambda k: int(k.split()[1]))
    order += sorted((k for k in after if ", then " in k), key=lambda k: -sum(after[k].values()))
    lines = [
        f"runs: {', '.join(names)}; {len(seqs)} prompts, {sum(map(len, seqs))} groups with a verdict",
        "",
        "| the prompt's previous group(s) | groups | next one dropped | all right | all wrong |",
        "|---|---|---|---|---|",
    ]
    lines += [row(k) for k in order if after[k]]
    return "\n".join(lines + [""] + skip_rules(seqs) + [""] + by_task(seqs))


def by_task(seqs: list[list[dict[str, Any]]]) -> list[str]:
    """Per task (the prompt id's second part): groups, the share dropped, and of each prompt's first group — what a
    task-level prior shared by its prompts would have to go on in the first pass."""
    tasks: dict[str, list[list[dict[str, Any]]]] = defaultdict(list)
    for s in seqs:
        tasks[s[0]["prompt"].split("/")[1]].append(s)
    lines = ["| task | prompts | groups | dropped | first groups dropped |", "|---|---|---|---|---|"]
    for task, ss in sorted(tasks.items()):
        groups = [r for s in ss for r in s]
        dropped = sum(r["outcome"] in DROPPED for r in groups) / len(groups)
        first = sum(s[0]["outcome"] in DROPPED for s in ss) / len(ss)
        lines.append(f"| {task} | {len(ss)} | {len(groups)} | {dropped:.0%} | {first:.0%} |")
    return lines


def classes(name: str, preset: Path, explore: float = 0.1, decay: float = 0.95) -> str:
    """Each prompt's first group by its class (buffer/curriculum.py's difficulty_class, the items rebuilt from the
    run's preset), and the class prior replayed on the first groups in dispatch order: each weighed by its chance
    of being dispatched, max(explore, 1 - q) with q its class's decayed drop share so far (importance weights, for a
    `uniform` run; without the feedback of a live run, whose class states count only the first groups it sent)."""
    from buffer.curriculum import ClassState, difficulty_class
    from buffer.runner import buffer_source
    from buffer.settings import BufferSettings
    from mesh.config import load_preset

    p = load_preset(preset)
    s = BufferSettings(**p.services["buffer"] | {k: p.mesh[k] for k in ("dataset", "eval_size") if k in p.mesh})
    items = {it.prompt_id: it for it in buffer_source(s).train}
    firsts = sorted((seq[0] for seq in sequences([name])), key=lambda r: (r["epoch"], r["position"]))
    lines = ["| shared by | class | first groups | dropped |", "|---|---|---|---|"]
    replay = []
    for shared in ("task", "difficulty"):
        state: dict[str, tuple[float, float, int]] = {}
        seen: dict[str, list[bool]] = defaultdict(list)
        w = []
        for r in firsts:
            it = items[r["prompt"]]
            k = difficulty_class(it.data_source, it.ground_truth, shared) or ""
            d, n, seen_k = state.get(k, (0.0, 0.0, 0))
            q = ClassState(d, n, seen_k).predict()
            w.append((1.0 if q is None else max(explore, 1 - q), r["outcome"] in DROPPED))
            state[k] = (d * decay + (r["outcome"] in DROPPED), n * decay + 1, seen_k + 1)
            seen[k].append(r["outcome"] in DROPPED)
        lines += [f"| {shared} | {k} | {len(v)} | {sum(v) / len(v):.0%} |" for k, v in sorted(seen.items())]
        dispatched = sum(x for x, _ in w)
        dropped = sum(x for x, dr in w if dr) / dispatched
        replay.append(f"| {shared} | {dispatched / len(w):.0%} | {dropped:.0%} |")
    uniform = sum(r["outcome"] in DROPPED for r in firsts) / len(firsts)
    head = [
        "",
        f"first groups replayed (explore {explore}, class decay {decay}):",
        "",
        "| class prior | share dispatched | of those, dropped |",
        "|---|---|---|",
        f"| none (uniform) | 100% | {uniform:.0%} |",
    ]
    return "\n".join(lines + head + replay)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "extract":
        print(extract(Path(sys.argv[2]), sys.argv[3]))
    elif len(sys.argv) >= 3 and sys.argv[1] == "report":
        print(report(sys.argv[2:]))
    elif len(sys.argv) == 4 and sys.argv[1] == "classes":
        print(classes(sys.argv[2], Path(sys.argv[3])))
    else:
        sys.exit(__doc__)
