"""The wire contracts of dapo-mesh: every message that crosses a process boundary.

Producers and consumers import the same classes from here; nothing else defines a message.
Token ids and log-probs are packed arrays (services/arrays.py): bytes on the wire, numpy
views in memory; they accept lists. Each message carries `schema_version`; a consumer rejects a
version it does not know (the streams adapter dead-letters it instead of crashing).

Data path (docs: architecture.md):
    buffer --PromptTask--> rollout --ScoredGroup--> buffer --TrainBatch--> learner
    learner --WeightVersion--> everyone;  rollout --ReplicaHeartbeat--> Redis key with a TTL
    learner --LedgerEntry--> trained.jsonl (services/ledger.py) --> the mesh's recorder, the audit
"""

from __future__ import annotations

import hashlib
import itertools
import time
from typing import Annotated, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, model_validator

from services.arrays import LogProbs, TokenIds

SCHEMA_VERSION: Literal[1] = 1
CLIENT_SCORED = "client"  # a task's verifier when its dataset says the client scores it (a gateway session's reward)

FinishReason = Literal["stop", "length", "abort"]


class Message(BaseModel):
    """Base of every wire message: strict about unknown fields and the schema version."""

    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1] = SCHEMA_VERSION


class SamplingBudget(BaseModel):
    """How a prompt is sampled in rounds (rollout/rounds.py; docs: services/sampling-budgets.md). None on a task:
    `fixed`, its n_samples in one round."""

    model_config = ConfigDict(extra="forbid")

    rule: Literal["signal", "balanced"] = Field(
        description="signal: rounds until the group holds a right and a wrong answer, then topped up to n_samples "
        "(every sample trained); balanced: rounds until it holds n_samples/2 of each, then down-sampled to "
        "n_samples, advantages against the mean of every sample drawn (Reinforce-Ada-balance)."
    )
    first: int = Field(ge=1, le=1024, description="Samples in the first round (k).")
    round: int = Field(ge=1, le=1024, description="Samples added by each later round.")
    most: int = Field(ge=1, le=1024, description="Samples drawn for the prompt at most (every round counted).")
    give_up: FiniteFloat = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Chance of giving the prompt up when its first round agrees (the buffer's: from the prompt's "
        "history, or its task's cost of going on).",
    )
    draw: FiniteFloat | None = Field(
        None,
        ge=0.0,
        lt=1.0,
        description="The task's uniform draw for the give-up (the buffer's, seeded: every replica decides the same); "
        "None: drawn from the task id.",
    )

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        if self.first > self.most:
            raise ValueError(f"first: a first round of {self.first} passes the budget's most ({self.most})")
        return self


class GroupSampling(BaseModel):
    """How a group sampled in rounds was drawn (set by the replica on a task with a budget)."""

    model_config = ConfigDict(extra="forbid")

    rounds: int = Field(ge=1, description="Rounds sampled.")
    drawn: int = Field(ge=1, description="Samples generated, down-sampled ones included.")
    drawn_right: int = Field(0, ge=0, description="... of them right (the prompt's history counts all it drew).")
    gave_up: bool = Field(False, description="Given up after its first round agreed.")
    first_agreed: bool | None = Field(
        None,
        description="Its first round's answers all agreed (all right or all wrong); None: not said (an older "
        "replica). The buffer counts what going on after such a round cost (sampling_give_up_by = cost).",
    )
    pool_mean: FiniteFloat | None = Field(
        None, description="balanced: the mean reward of every sample drawn (the advantages' baseline)."
    )
    pool_std: FiniteFloat | None = Field(None, ge=0.0, description="balanced: their standard deviation (unbiased).")

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if (self.pool_mean is None) != (self.pool_std is None):
            raise ValueError("pool_mean, pool_std: both or neither (the advantages' baseline and its spread)")
        if self.drawn_right > self.drawn:
            raise ValueError(f"drawn_right: {self.drawn_right} right of {self.drawn} drawn")
        return self


class PromptTask(Message):
    """One prompt to sample `n_samples` answers for (dispatched by the buffer)."""

    task_id: str = Field(min_length=1, description="Unique per dispatch; the id of the group it becomes.")
    prompt_id: str = Field(min_length=1, description="Stable id of the dataset item.")
    prompt: str | None = Field(None, description="Prompt text (already templated).")
    prompt_token_ids: TokenIds | None = Field(None, description="Prompt token ids, if pre-tokenised.")
    ground_truth: str = Field(description="What the verifier compares against (may be JSON).")
    verifier: str = Field(
        min_length=1,
        description="Verifier name, e.g. dapo_math, reasoning_gym:chain_sum; env:<name> (an environment scores "
        'it); "client" (the client of a gateway session gives its reward).',
    )
    data_source: str = Field(min_length=1)
    n_samples: int = Field(ge=1, le=1024, description="G, samples per prompt.")
    dispatch_version: int = Field(0, ge=0, description="Learner policy version when dispatched.")
    budget: SamplingBudget | None = Field(None, description="Sampled in rounds (None: n_samples in one round).")
    created_at: float = Field(default_factory=time.time)

    @model_validator(mode="after")
    def _has_prompt(self) -> Self:
        if not self.prompt and not self.prompt_token_ids:
            raise ValueError("prompt: a PromptTask needs `prompt` text or `prompt_token_ids`")
        if self.budget is not None and self.budget.most < self.n_samples:
            raise ValueError(
                f"budget: most {self.budget.most} is below n_samples {self.n_samples}, the group's size to train"
            )
        return self


class Turn(BaseModel):
    """A stretch of an episode's response: `tokens` tokens written by the model (sampled) or the environment."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["model", "env"]
    tokens: int = Field(ge=1)


class EpisodeInfo(BaseModel):
    """How an episode went (Sample schema 4; None on a single-turn sample)."""

    model_config = ConfigDict(extra="forbid")

    env: str = Field(min_length=1, description="The environment it ran in.")
    model_turns: int = Field(ge=1)
    ended: Literal["done", "max_turns", "max_tokens"] = Field(
        description="done: the environment ended it; max_turns / max_tokens: cut there (truncated)."
    )
    tool_calls: dict[str, int] = Field(default_factory=dict, description="valid, malformed, unknown, failed.")
    env_seconds: FiniteFloat = Field(0.0, ge=0, description="Time it waited for the environment.")
    generate_seconds: FiniteFloat = Field(0.0, ge=0, description="Time its model turns were in the engine.")


class Sample(Message):
    """One sampled response, with the behaviour log-prob of every response token and how it was sampled.

    Schema 2 added `temperature` and `top_p`; a schema-1 sample (without them) reads as sampled at 1.0 and 1.0.
    Schema 3 added `version_runs`, the policy version of every token (continuous batching loads weights while
    sequences are in flight, rollout/engines/continuous.py); a sample without them was sampled by `policy_version`
    alone. Schema 4 added `turns`: an episode's response is its model turns as sampled and the environment's turns
    as rendered between them (services/episodes.py), and only the model's tokens are in the loss; a sample
    without turns is one model turn."""

    schema_version: Literal[1, 2, 3, 4] = 4  # type: ignore[assignment]
    response_token_ids: TokenIds
    response_text: str
    logprobs: LogProbs = Field(
        description="Behaviour log-prob of each response token (float32), of the distribution sampled from: at "
        "`temperature` (the learner applies the same temperature to its logits)."
    )
    finish_reason: FinishReason
    policy_version: int = Field(
        ge=0, description="Version of the weights that generated this sample: of its first (oldest) token."
    )
    temperature: FiniteFloat = Field(1.0, ge=0.0, description="Sampling temperature (0: greedy; logprobs at 1).")
    top_p: FiniteFloat = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling of this sample.")
    version_runs: list[tuple[int, int]] | None = Field(
        None,
        description="The version that sampled each token, as run-lengths [[version, tokens], ...] in token "
        "order, versions increasing, the first = policy_version; None: every token by policy_version.",
    )
    turns: list[Turn] | None = Field(
        None,
        max_length=4096,
        description="The episode's turns in token order, covering every response token: the model's (sampled: "
        "log-probs, versions, in the loss) and the environment's (rendered by the chat template: out of the loss, "
        "log-prob 0); None: one model turn.",
    )

    episode: EpisodeInfo | None = Field(None, description="An episode's summary (None: a single-turn sample).")

    def loss_mask(self) -> list[int]:
        """1 for each response token the model sampled, 0 for each the environment wrote."""
        if not self.turns:
            return [1] * len(self.response_token_ids)
        return [int(t.role == "model") for t in self.turns for _ in range(t.tokens)]

    @property
    def truncated(self) -> bool:
        """Hit the response-length limit (overlong shaping and filtering use this)."""
        return self.finish_reason == "length"

    @property
    def newest_version(self) -> int:
        return self.version_runs[-1][0] if self.version_runs else self.policy_version

    @property
    def n_versions(self) -> int:
        """How many policy versions sampled this response's tokens (1: none loaded while it was in flight)."""
        return len(self.version_runs) if self.version_runs else 1

    def token_versions(self) -> list[int]:
        """The policy version of each response token."""
        if not self.version_runs:
            return [self.policy_version] * len(self.response_token_ids)
        return [v for v, n in self.version_runs for _ in range(n)]

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if len(self.logprobs) != len(self.response_token_ids):
            raise ValueError(
                f"logprobs: {len(self.logprobs)} log-probs for "
                f"{len(self.response_token_ids)} response tokens; they must match one to one"
            )
        if self.turns is not None and sum(t.tokens for t in self.turns) != len(self.response_token_ids):
            raise ValueError(
                f"turns: {sum(t.tokens for t in self.turns)} tokens in turns for {len(self.response_token_ids)} "
                "response tokens; the turns must cover the response exactly"
            )
        runs = self.version_runs
        if runs is None:
            return self
        versions = [v for v, _ in runs]
        if sum(n for _, n in runs) != len(self.response_token_ids) or any(n < 1 for _, n in runs):
            raise ValueError(
                f"version_runs: {runs} do not cover the {len(self.response_token_ids)} response tokens "
                "with runs of at least one token"
            )
        rising = all(b > a for a, b in itertools.pairwise(versions))
        if versions and (versions[0] != self.policy_version or not rising):
            raise ValueError(
                f"version_runs: versions {versions} must increase from policy_version {self.policy_version}"
            )
        return self


class Score(Message):
    """The reward server's verdict on one sample."""

    reward: FiniteFloat = Field(description="Final reward, overlong penalty included.")
    acc: bool = Field(description="Whether the answer is correct.")
    overlong_penalty: FiniteFloat = Field(0.0, le=0.0)
    pred: str | None = Field(None, description="The prediction the verifier extracted.")


class ScoredGroup(Message):
    """A prompt with its G samples and their scores (rollout -> buffer)."""

    task: PromptTask
    samples: list[Sample] = Field(min_length=1)
    scores: list[Score] = Field(min_length=1)
    replica_id: str = Field(min_length=1)
    sampling: GroupSampling | None = Field(None, description="How its rounds went (a task with a budget).")
    created_at: float = Field(default_factory=time.time)

    @property
    def drawn(self) -> int:
        """Samples generated for this group (down-sampled ones included)."""
        return self.sampling.drawn if self.sampling is not None else len(self.samples)

    @property
    def group_id(self) -> str:
        return self.task.task_id

    def digest(self) -> bytes:
        """What makes this group itself: its task, its replica, when it was scored and every sampled token. A copy
        (a retried XADD, a redelivery) has the same digest; a new sampling of the same prompt another."""
        h = hashlib.blake2b(digest_size=16)
        for part in (self.task.task_id, self.replica_id, repr(self.created_at)):
            h.update(part.encode() + b"\0")
        for s in self.samples:
            h.update(s.response_token_ids.tobytes() + b"\0")
        return h.digest()

    @property
    def min_version(self) -> int:
        return min(s.policy_version for s in self.samples)

    @property
    def max_version(self) -> int:
        return max(s.newest_version for s in self.samples)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if len(self.scores) != len(self.samples):
            raise ValueError(f"scores: {len(self.scores)} scores for {len(self.samples)} samples")
        if len(self.samples) != self.task.n_samples:
            raise ValueError(
                f"samples: the group has {len(self.samples)} samples but task.n_samples is {self.task.n_samples}"
            )
        return self


class DroppedGroup(Message):
    """The buffer's record of a scored group it did not put in a batch (dynamic sampling, staleness,
    duplicates): written to `dapo:dropped` in the same step that acknowledges the group."""

    task_id: str = Field(min_length=1)
    prompt_id: str = Field(min_length=1)
    reason: str = Field(min_length=1, description="all_correct, all_wrong, no_variance, stale, duplicate, ...")
    replica_id: str = Field(min_length=1)
    min_version: int = Field(ge=0)
    at_version: int = Field(ge=0, description="The learner's version when the group was dropped.")


class TrainBatch(Message):
    """B scored groups that the learner trains on as one step (buffer -> learner)."""

    batch_id: int = Field(ge=0, description="Monotonically increasing; the learner trains each once.")
    groups: list[ScoredGroup] = Field(min_length=1)
    min_version: int = Field(ge=0, description="Oldest policy version of any token in the batch.")
    max_version: int = Field(ge=0, description="Newest policy version of any token in the batch.")
    created_at: float = Field(default_factory=time.time)

    def digest(self) -> str:
        """The batch's identity for the learner's exactly-once: its groups' digests, in order — not the batch id,
        which a Redis that lost its last writes would hand out again."""
        h = hashlib.blake2b(digest_size=16)
        for g in self.groups:
            h.update(g.digest())
        return h.hexdigest()

    @classmethod
    def assemble(cls, batch_id: int, groups: list[ScoredGroup]) -> TrainBatch:
        """Build a batch whose version range is derived from its groups."""
        if not groups:
            raise ValueError("groups: a TrainBatch needs at least one group")
        return cls(
            batch_id=batch_id,
            groups=groups,
            min_version=min(g.min_version for g in groups),
            max_version=max(g.max_version for g in groups),
        )

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        lo = min(g.min_version for g in self.groups)
        hi = max(g.max_version for g in self.groups)
        # a batch assembled before Sample schema 3 declared the newest *first* token as max_version
        first = max(s.policy_version for g in self.groups for s in g.samples)
        if self.min_version != lo or not first <= self.max_version <= hi:
            raise ValueError(
                f"min_version/max_version: declared {self.min_version}..{self.max_version} but the "
                f"groups' samples span {lo}..{hi}"
            )
        ids = [g.group_id for g in self.groups]
        if len(set(ids)) != len(ids):
            raise ValueError("groups: the same group (task_id) appears twice in one batch")
        return self


class WeightVersion(Message):
    """Published by the learner after the rollout replicas hold new weights."""

    version: int = Field(ge=0)
    step: int = Field(ge=0, description="Optimizer steps taken by the learner.")
    batch_id: int | None = Field(None, ge=0, description="Last batch trained into this version.")
    checkpoint_dir: str | None = Field(None, description="HF snapshot of these weights, for late joiners.")
    checksum: int | None = Field(None, ge=0, description="Checksum of the broadcast weights (see services/weights).")
    replicas: list[str] = Field(default_factory=list, description="Replicas that acknowledged these weights.")
    sync_seconds: FiniteFloat = Field(0.0, ge=0.0, description="Wall time of the broadcast round.")
    created_at: float = Field(default_factory=time.time)


class SyncGroup(Message):
    """The learner's weight-broadcast group, announced in Redis: where to rendezvous and who is invited."""

    generation: int = Field(ge=1, description="Increases each time the group is rebuilt (membership changed).")
    host: str = Field(min_length=1, description="Address of the learner's rendezvous store.")
    port: int = Field(ge=1, le=65535)
    candidates: list[str] = Field(description="Replica ids invited to this generation.")
    incarnations: list[str] = Field(
        default_factory=list, description="The invited process of each candidate (a restarted replica is not it)."
    )
    timeout_s: FiniteFloat = Field(gt=0, description="Every wait of a round gives up after this long.")


class ReplicaHeartbeat(Message):
    """A rollout replica's liveness record, kept in Redis under a key with a TTL."""

    replica_id: str = Field(min_length=1)
    host: str = Field(min_length=1)
    port: int = Field(ge=0, le=65535)
    weight_version: int = Field(ge=0)
    tokens_per_s: FiniteFloat = Field(0.0, ge=0.0)
    state: Literal["starting", "ready", "syncing", "draining"] = "starting"
    weight_checksum: int | None = Field(None, ge=0, description="Checksum of the broadcast weights it serves.")
    sync_broadcast: bool = Field(False, description="Joins the learner's weight-broadcast group.")
    incarnation: str = Field("", description="Random per process start: a restarted replica has a new one.")
    gateway_url: str | None = Field(
        None, description="Where its OpenAI-compatible gateway answers (None: it serves none): the router sends there."
    )
    gateway_free: int = Field(0, ge=0, description="Gateway sessions it could open now (its bound less those open).")
    gateway_seats: int = Field(
        0, ge=0, description="Free seats in the tasks its gateway holds: a session opened there joins a group begun."
    )
    timestamp: float = Field(default_factory=time.time)


PROMPT_CHARS = 4000  # a recorded prompt (services/episode_log.py, EvalSampleRecord) is cut there, with "…"
RESPONSE_CHARS = 16000  # and a held-out response: the records are for reading, not a copy of the data


class EvalSampleRecord(BaseModel):
    """One held-out sample of an evaluation, for people to read (`dapo-mesh view`)."""

    model_config = ConfigDict(extra="forbid")

    prompt_id: str
    task: str = Field(description="The item's data source.")
    prompt: str | None = Field(
        None, max_length=PROMPT_CHARS + 1, description="The prompt text, cut at PROMPT_CHARS characters."
    )
    sample: int = Field(ge=0, description="Which of the item's k samples.")
    response: str = Field(max_length=RESPONSE_CHARS + 1, description="The response, cut at RESPONSE_CHARS characters.")
    response_tokens: int = Field(ge=0)
    finish_reason: str
    acc: bool
    score: FiniteFloat
    pred: str | None = None


class EvalResult(Message):
    """A held-out evaluation of one policy version (rollout/evaluate.py), published to dapo:eval. Schema 2 added
    `samples` (a schema-1 result reads as without them)."""

    schema_version: Literal[1, 2] = 2  # type: ignore[assignment]  # a subclass widens the base's Literal[1]

    version: int = Field(ge=0, description="Policy version of the weights evaluated.")
    replica_id: str = Field(min_length=1)
    k: int = Field(ge=1, description="Samples per prompt.")
    n_prompts: int = Field(ge=1)
    avg_at_k: FiniteFloat = Field(ge=0.0, le=1.0, description="Mean accuracy over all k samples of all prompts.")
    pass_at_k: FiniteFloat = Field(ge=0.0, le=1.0, description="Fraction of prompts with a correct sample.")
    mean_response_tokens: FiniteFloat = Field(ge=0.0)
    truncated_frac: FiniteFloat = Field(ge=0.0, le=1.0)
    seconds: FiniteFloat = Field(ge=0.0)
    mean_token_version: FiniteFloat | None = Field(
        None, ge=0.0, description="The mean policy version over its sampled tokens (None: all by `version`)."
    )
    newest_version: int | None = Field(
        None,
        ge=0,
        description="A replica with continuous batching evaluates beside training and loads weights meanwhile: the "
        "newest version that sampled any of its tokens (None: all by `version`).",
    )
    later_token_frac: FiniteFloat = Field(
        0.0, ge=0.0, le=1.0, description="Share of its tokens sampled by versions newer than `version`."
    )
    by_task: dict[str, Annotated[FiniteFloat, Field(ge=0.0, le=1.0)]] = Field(
        default_factory=dict, description="avg@k per task (the items' data source); empty from older replicas."
    )
    samples: list[EvalSampleRecord] = Field(
        default_factory=list, max_length=4096, description="The first --eval-record-samples held-out samples."
    )
    created_at: float = Field(default_factory=time.time)


class LedgerEntry(Message):
    """One line of the learner's ledger (trained.jsonl, services/ledger.py): a batch trained into the
    weights. Written by the learner after the update; read by the mesh's run recorder, the audit, the benchmarks."""

    batch_id: int = Field(ge=0)
    version: int = Field(ge=1, description="The policy version this batch's update produced.")
    pid: int = Field(ge=0, description="The learner process that trained it (a restarted learner has another).")
    lag: int = Field(ge=0, description="Learner version at training minus the batch's oldest sample version.")
    task_ids: list[str] = Field(description="The groups (task ids) the batch held: what the audit accounts.")
    digest: str = Field("", description="The batch's content digest (TrainBatch.digest): its identity.")
    metrics: dict[str, int | float] = Field(
        default_factory=dict, description="The step's numbers: loss, reward_mean, acc_mean, seconds, sync_seconds..."
    )


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.__name__: cls
    for cls in (
        PromptTask,
        Sample,
        Score,
        ScoredGroup,
        DroppedGroup,
        TrainBatch,
        WeightVersion,
        ReplicaHeartbeat,
        SyncGroup,
        EvalResult,
    )
}  # the stream messages (LedgerEntry is a file's line, services/ledger.py)


# --------------------------------------------------------------------------- reward server HTTP API
# POST /v1/score (rollout -> reward server). Versioned by the URL path, not by schema_version.


class ScoreItem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(max_length=256, description="Echoed back in the result.")
    response: str = Field(description="The model's response text.")
    ground_truth: str = Field(description="Reference answer (for reasoning_gym: the entry as JSON).")
    verifier: str = Field(
        max_length=128,
        description="dapo_math | math_verify | reasoning_gym:<task>",
        # in the OpenAPI schema (clients, fuzzers); checked by the server with a message naming the choices
        json_schema_extra={"pattern": r"^(dapo_math|math_verify|reasoning_gym:[a-z0-9_]+)$"},
    )
    response_tokens: int | None = Field(None, ge=0, description="Response length; enables overlong shaping.")
    max_response_tokens: int | None = Field(None, ge=1, description="L_max for this item (default: settings).")


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    items: list[ScoreItem] = Field(min_length=1)


class ScoreResult(BaseModel):
    id: str
    score: float = Field(description="Verifier reward plus overlong penalty.")
    acc: bool
    pred: str | None = None
    overlong_penalty: float = 0.0
    timed_out: bool = False
    error: str | None = None


class ScoreResponse(BaseModel):
    results: list[ScoreResult]
