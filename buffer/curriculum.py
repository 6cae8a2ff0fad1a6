"""Which prompts to roll out: per-prompt pass-rate state in Redis and the curriculum dispatch policy.

Dynamic sampling drops every group whose samples all agree (all right or all wrong), and which prompts give such
groups is predictable: one whose last groups were all right is likely to be so again (GRESO, arXiv 2506.02177;
online difficulty filtering, arXiv 2504.03380). Each scored group updates its prompt's state, one Redis hash field
per prompt (`KEY_PROMPT_STATE`), in one server-side script:

    states = PromptStates(client, decay=0.5)
    before, after, counted, _ = states.record(group, zero_variance=True, version=12)  # counted: False for a
                                                                                      # redelivered group
    q = zero_variance_probability(state, n_samples=8)     # P(the next group is filtered)
    dispatch with probability max(explore, (1 - q) * streak_decay ** state.streak)    # "curriculum"; "uniform": 1

The state keeps decayed counts of correct and sampled answers (each older group weighs `decay` times less: the
policy moves), so the pass rate is an exponentially weighted one. The prediction is the Beta-binomial probability
that G samples all agree: with p ~ Beta(a, b), a = prior·m0 + correct, b = prior·(1 - m0) + wrong,
P(all right) = Π_{i<G} (a+i)/(a+b+i) and P(all wrong) = Π_{i<G} (b+i)/(a+b+i). The prior Beta(0.25, 0.25) is
U-shaped, as pass rates are (most prompts are solved or unsolved): one all-right group of 8 predicts 0.84, a 7 of
8 group 0.40. The chance of dispatching is the chance the group is kept, 1 - q, and it decays further with each group
in a row whose samples all agreed (GRESO's decaying exploration: the Beta-binomial alone, measured, under-predicts
the filtered groups of a policy that is learning the prompts — 31% predicted for 54% observed). A prompt with no
history is dispatched unless its class predicts otherwise (below), and every prompt still comes back with
probability `explore`: a solved prompt can be forgotten, an unsolved one can become solvable.

A prompt without history borrows a prediction from its class (`curriculum_shared`): its task, or its task and the
item's difficulty attributes (reasoning-gym's metadata names them: chain_sum's `num_digits`, leg_counting's
`num_animals`). Each class counts, decayed, how many of its prompts' first groups were dropped, in the same script
that counts the group in its prompt's state. In the hard-start preset's first pass chain_sum's 2-digit prompts' first
groups were dropped 76% of the time and its 1-digit ones' 31%, where the task as a whole says 52%
(docs/results/curriculum.md). An unseen prompt is dispatched with the chance its class's first groups were kept.

Groups sampled in rounds count, in the same script, what going on after an agreeing first round cost their task
(`KEY_GOING_ON`: samples drawn after that round, samples of the groups that then broke agreement) and what a trained
sample costs the run; `cost_give_up` gives up a task's agreeing first rounds where the first is the higher
(sampling_give_up_by = "cost"; docs: services/sampling-budgets.md).
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import redis

from services.schemas import ScoredGroup
from services.streams import redis_errors

KEY_PROMPT_STATE = (
    "dapo:buffer:prompt-state"  # hash: prompt id -> JSON [correct, samples, groups, version, streak, tags]
)
KEY_CLASS_STATE = "dapo:buffer:class-state"  # hash: class -> JSON [dropped, groups (both decayed), first groups]
# hash: task -> JSON [groups, samples drawn after the first round, samples of those groups kept (all decayed), groups
# counted] over its groups let go on after an agreeing first round; RUN_FIELD -> JSON [drawn, kept (decayed)] over
# every group sampled in rounds (sampling_give_up_by = "cost")
KEY_GOING_ON = "dapo:buffer:going-on"
RUN_FIELD = ""  # the run's field: no task is named "" (PromptTask.data_source has min_length 1)
COST_MIN_GROUPS = 8  # a task's cost of going on decides nothing before this many groups let go on
COST_DECAY = 0.99  # weight of a task's (and the run's) older groups, per newer one: the policy moves
CLASS_MIN_GROUPS = 4  # a class predicts nothing before this many first groups
RECENT_TAGS = 8  # group ids (8 hex digits each) remembered per prompt: a redelivered group is not counted twice
BANDS = ((0.0, "unsolved"), (0.05, "hard"), (0.35, "medium"), (0.65, "easy"), (0.95, "solved"))

# KEYS[1] the prompts' hash, KEYS[2] the classes', KEYS[3] the going-on costs'; ARGV: prompt id, group tag, correct,
# samples, zero-variance (0/1), version, decay, tags kept, the prompt's class ('' none), the class decay, then for a
# group sampled in rounds (ARGV[11] its task, '' none): samples drawn, samples kept (0: uniform), let go on after an
# agreeing first round (0/1), samples drawn after its first round, the cost decay. A prompt's first group also counts
# in its class. Returns {the state before ('' if none), the state after, 1 if counted now / 0 if the tag was already
# counted, its class's state before ('' if none, or not a first group)}.
_RECORD_LUA = """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
local s = raw and cjson.decode(raw) or {0, 0, 0, 0, 0, {}}
for _, t in ipairs(s[6]) do if t == ARGV[2] then return {raw, raw, 0, ''} end end
local decay = tonumber(ARGV[7])
s[1] = s[1] * decay + tonumber(ARGV[3])
s[2] = s[2] * decay + tonumber(ARGV[4])
s[3] = s[3] + 1
s[4] = math.max(s[4], tonumber(ARGV[6]))
if ARGV[5] == '1' then s[5] = s[5] + 1 else s[5] = 0 end
local tags = {ARGV[2]}
for i = 1, math.min(#s[6], tonumber(ARGV[8]) - 1) do tags[i + 1] = s[6][i] end
s[6] = tags
local new = cjson.encode(s)
redis.call('HSET', KEYS[1], ARGV[1], new)
local cls = ''
if not raw and ARGV[9] ~= '' then
  cls = redis.call('HGET', KEYS[2], ARGV[9]) or ''
  local c = cls ~= '' and cjson.decode(cls) or {0, 0, 0}
  local cd = tonumber(ARGV[10])
  c[1] = c[1] * cd + tonumber(ARGV[5])
  c[2] = c[2] * cd + 1
  c[3] = c[3] + 1
  redis.call('HSET', KEYS[2], ARGV[9], cjson.encode(c))
end
if ARGV[11] ~= '' then
  local kd = tonumber(ARGV[16])
  local r = redis.call('HGET', KEYS[3], ARGV[17])
  r = r and cjson.decode(r) or {0, 0}
  r[1] = r[1] * kd + tonumber(ARGV[12])
  r[2] = r[2] * kd + tonumber(ARGV[13])
  redis.call('HSET', KEYS[3], ARGV[17], cjson.encode(r))
  if ARGV[14] == '1' then
    local g = redis.call('HGET', KEYS[3], ARGV[11])
    g = g and cjson.decode(g) or {0, 0, 0, 0}
    g[1] = g[1] * kd + 1
    g[2] = g[2] * kd + tonumber(ARGV[15])
    g[3] = g[3] * kd + tonumber(ARGV[13])
    g[4] = g[4] + 1
    redis.call('HSET', KEYS[3], ARGV[11], cjson.encode(g))
  end
end
return {raw or '', new, 1, cls}
"""


@dataclass(frozen=True)
class PromptState:
    correct: float  # decayed count of correct samples
    samples: float  # decayed count of samples
    groups: int  # groups recorded
    version: int  # the newest policy version that sampled one of its groups
    streak: int  # groups in a row whose samples all agreed

    @property
    def pass_rate(self) -> float:
        return self.correct / self.samples if self.samples else float("nan")

    @classmethod
    def parse(cls, raw: bytes | str) -> PromptState:
        c, m, n, v, z, _ = json.loads(raw)
        return cls(float(c), float(m), int(n), int(v), int(z))


@dataclass(frozen=True)
class ClassState:
    dropped: float  # decayed count of its prompts' first groups that dynamic sampling dropped
    groups: float  # decayed count of its prompts' first groups
    seen: int  # its prompts' first groups counted (not decayed)

    @classmethod
    def parse(cls, raw: bytes | str) -> ClassState:
        d, n, k = json.loads(raw)
        return cls(float(d), float(n), int(k))

    def predict(self) -> float | None:
        """P(an unseen prompt of this class gives a dropped first group): the decayed share, with half a pseudo-group
        of each outcome; None before CLASS_MIN_GROUPS first groups."""
        return (self.dropped + 0.5) / (self.groups + 1.0) if self.seen >= CLASS_MIN_GROUPS else None


@dataclass(frozen=True)
class GoingOn:
    """A task's groups let go on after their first round agreed: what going on drew and what it gave to train."""

    groups: float  # decayed count of such groups
    extra: float  # decayed samples they drew after their first round
    kept: float  # decayed samples of those that broke agreement (0 for one that stayed uniform)
    seen: int  # such groups counted (not decayed)

    @classmethod
    def parse(cls, raw: bytes | str) -> GoingOn:
        g, e, k, n = json.loads(raw)
        return cls(float(g), float(e), float(k), int(n))

    def cost(self) -> float | None:
        """Samples drawn after an agreeing first round per sample it let train (one pseudo-sample kept: a task whose
        groups never broke costs its extra samples, not infinity); None before COST_MIN_GROUPS such groups."""
        return self.extra / (self.kept + 1.0) if self.seen >= COST_MIN_GROUPS else None


@dataclass(frozen=True)
class RunCost:
    """Every group sampled in rounds: samples drawn, and samples of the groups with both outcomes (decayed)."""

    drawn: float
    kept: float

    @classmethod
    def parse(cls, raw: bytes | str) -> RunCost:
        d, k = json.loads(raw)
        return cls(float(d), float(k))

    def ratio(self) -> float | None:
        """Samples drawn per sample kept: what a trained sample costs the run (None: nothing kept yet)."""
        return self.drawn / self.kept if self.kept > 0 else None


def cost_give_up(going_on: GoingOn | None, run: RunCost | None, *, explore: float, floor: float) -> float:
    """The chance of giving up a prompt of this task when its first round agrees (sampling_give_up_by = "cost"):
    1 - explore where going on costs more samples per trained one than the run pays for a trained sample on
    average (a fresh prompt would cost about that), else `floor`; `floor` until both are known. The `explore`
    share still goes on, so the task's cost keeps being counted as the policy moves."""
    cost = going_on.cost() if going_on is not None else None
    ratio = run.ratio() if run is not None else None
    if cost is None or ratio is None or cost <= ratio:
        return floor
    return max(floor, 1.0 - explore)


def difficulty_class(data_source: str, ground_truth: str, shared: str) -> str | None:
    """The class an unseen prompt borrows its prediction from: None ("none"), its task ("task"), or its task and the
    values of the difficulty attributes its reasoning-gym metadata names ("difficulty"; the task alone for an item
    without such metadata, e.g. a file row)."""
    if shared == "none":
        return None
    meta: object = None
    if shared == "difficulty":
        try:
            meta = json.loads(ground_truth).get("metadata")
        except (ValueError, AttributeError):  # not JSON, or not an object: no metadata
            meta = None
    if not isinstance(meta, dict):
        return data_source
    levels = meta.get("difficulty")
    if isinstance(levels, dict):
        parts = [f"{k}={meta[k]}" for k in sorted(levels) if isinstance(meta.get(k), int | float | str)]
    else:
        parts = [f"difficulty={levels}"] if isinstance(levels, int | float | str) else []
    return data_source + ("|" + ",".join(parts) if parts else "")


def zero_variance_probability(
    state: PromptState | None, n_samples: int, *, prior: float = 0.5, prior_mean: float = 0.5
) -> float | None:
    """P(a group of `n_samples` of this prompt all right or all wrong), Beta-binomial; None without history."""
    if state is None or state.groups == 0:
        return None
    a = prior * prior_mean + state.correct
    b = prior * (1 - prior_mean) + max(0.0, state.samples - state.correct)
    all_right = all_wrong = 1.0
    for i in range(n_samples):
        all_right *= (a + i) / (a + b + i)
        all_wrong *= (b + i) / (a + b + i)
    return min(1.0, all_right + all_wrong)


def dispatch_probability(q: float | None, streak: int, *, explore: float, streak_decay: float) -> float:
    """The curriculum's chance of dispatching a prompt whose next group is filtered with probability q (None: no
    history) after `streak` groups in a row that were."""
    return 1.0 if q is None else max(explore, (1.0 - q) * streak_decay**streak)


def decide(probability: float, seed: int, epoch: int, position: int) -> bool:
    """A seeded draw per dispatch slot: a restarted buffer makes the same choices for the same slots."""
    return random.Random(f"{seed}:{epoch}:{position}").random() < probability


def band(state: PromptState | None) -> str:
    """The difficulty band of a prompt by its (decayed) pass rate; "unseen" without history."""
    if state is None or not state.samples:
        return "unseen"
    name = BANDS[0][1]
    for lower, label in BANDS:
        if state.pass_rate >= lower:
            name = label
    return name


class Recorded(NamedTuple):
    before: PromptState | None  # the prompt's state before the group (None: its first)
    after: PromptState
    counted: bool  # False: the group was counted before (a redelivery)
    class_before: ClassState | None  # its class's state before a first group (None: no class, or not a first group)


def group_tag(group_id: str) -> str:
    return hashlib.blake2b(group_id.encode(), digest_size=4).hexdigest()


def going_on_args(group: ScoredGroup, zero_variance: bool, stale: bool = False) -> list[str | int | float]:
    """The record script's last arguments: a group sampled in rounds counts in the run's cost and, let go on after
    an agreeing first round, in its task's cost of going on; any other group counts in neither. What it drew counts
    either way; its samples count as kept only if it can train: both outcomes, and not stale on arrival (rounds
    that outlive the staleness bound are a cost of going on too)."""
    s, budget = group.sampling, group.task.budget
    if s is None or budget is None:
        return ["", 0, 0, 0, 0, COST_DECAY, RUN_FIELD]
    went_on = bool(s.first_agreed) and not s.gave_up and s.rounds > 1
    kept = 0 if zero_variance or stale else len(group.samples)
    return [group.task.data_source, s.drawn, kept, int(went_on), max(0, s.drawn - budget.first), COST_DECAY, RUN_FIELD]


class PromptStates:
    """The per-prompt state in Redis. Every update is one script run: two buffers never interleave on a prompt."""

    def __init__(self, client: redis.Redis, *, decay: float = 0.5, class_decay: float = 0.95):
        self.client, self.decay, self.class_decay = client, decay, class_decay
        self._record = client.register_script(_RECORD_LUA)

    def record(
        self, group: ScoredGroup, *, zero_variance: bool, version: int, klass: str | None = None, stale: bool = False
    ) -> Recorded:
        """Count one scored group (its accuracy, whether its samples all agreed, the newest version that sampled
        it), and a prompt's first group in its class `klass` too (`stale`: it arrived past the staleness bound, so
        the costs count nothing of it kept). A group already counted (redelivered after a restart, or read by two
        buffers) changes nothing and says so (counted False)."""
        correct, samples = sum(s.acc for s in group.scores), len(group.scores)
        if group.sampling is not None:  # sampled in rounds: every sample drawn, down-sampled ones too
            correct, samples = group.sampling.drawn_right, group.sampling.drawn
        args = [group.task.prompt_id, group_tag(group.group_id), correct, samples, int(zero_variance)]
        args += [version, self.decay, RECENT_TAGS, klass or "", self.class_decay]
        args += going_on_args(group, zero_variance, stale)
        with redis_errors(self.client):
            old, new, counted, cls = self._record(keys=[KEY_PROMPT_STATE, KEY_CLASS_STATE, KEY_GOING_ON], args=args)
        before = PromptState.parse(old) if old else None
        return Recorded(before, PromptState.parse(new), bool(counted), ClassState.parse(cls) if cls else None)

    def going_on(self, tasks: Sequence[str]) -> tuple[list[GoingOn | None], RunCost | None]:
        """These tasks' costs of going on after an agreeing first round (None: none counted), and the run's."""
        with redis_errors(self.client):
            raws = self.client.hmget(KEY_GOING_ON, [*tasks, RUN_FIELD])
        costs = [GoingOn.parse(r) if r is not None else None for r in raws[:-1]]
        return costs, RunCost.parse(raws[-1]) if raws[-1] is not None else None

    def classes(self, names: Sequence[str]) -> list[ClassState | None]:
        """The states of these classes (None: no first group counted yet)."""
        if not names:
            return []
        with redis_errors(self.client):
            raws = self.client.hmget(KEY_CLASS_STATE, list(names))
        return [ClassState.parse(r) if r is not None else None for r in raws]

    def get(self, prompt_ids: Sequence[str]) -> list[PromptState | None]:
        if not prompt_ids:
            return []
        with redis_errors(self.client):
            raws = self.client.hmget(KEY_PROMPT_STATE, list(prompt_ids))
        return [PromptState.parse(r) if r is not None else None for r in raws]

    def scan(self) -> Iterator[tuple[str, PromptState]]:
        """Every prompt's state (HSCAN: in pages, never one long command)."""
        with redis_errors(self.client):
            for key, raw in self.client.hscan_iter(KEY_PROMPT_STATE, count=1000):
                yield (key.decode() if isinstance(key, bytes) else key), PromptState.parse(raw)
