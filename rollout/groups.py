"""Finished episodes of one task as the group the learner trains on — one builder for the replica's own episodes
(rollout/publisher.py) and the gateway's sessions (rollout/gateway/core.py).

    group = episode_group(task, episodes, scores, replica_id, decode)    # GroupRefused(why) if they are no group

The rule: a group is G episodes of **one task**, and the learner gives them **one prompt**. The prompt is the
longest run of tokens every episode's opening begins with; the rest of each opening stays in that episode as
context (out of the loss, log-prob 0), so every sampled token keeps exactly the context it was sampled in. Openings
that differ after a shared start are kept — an agent that adds its own system prompt to some sessions, an
environment that words one task two ways — and an episode is never re-tokenised. Refused, with the reason: episodes
whose environment says they are of different tasks (`task_key`, the environment's task id: the same seed drew two
tasks, so their rewards are not comparable and the group's baseline would be wrong), and openings with no token in
common (there is no prompt to give them).

Why re-base rather than refuse differing openings (the replica's rule until 2026-12-06): refusing threw away every
group of an agent that varies its prompt, and the learner loses nothing by re-basing — each token's log-prob is
recomputed in its own context — while the advantage compares episodes of one task, which is what its baseline
needs. Each sample carries its own sampling (temperature, top_p) from its episode.
"""

from __future__ import annotations

from collections.abc import Callable

from rollout.episodes import Episode
from services.arrays import TokenIds
from services.schemas import PromptTask, Score, ScoredGroup


class GroupRefused(ValueError):
    """These episodes cannot be one group (the message says why)."""


def episode_group(
    task: PromptTask,
    episodes: list[Episode],
    scores: list[Score],
    replica_id: str,
    decode: Callable[[list[int]], str],
) -> ScoredGroup:
    """The episodes as one ScoredGroup: one shared prompt, each episode re-based on it (module docstring)."""
    if not episodes:
        raise GroupRefused("no episode to make a group of")
    keys = {e.task_key for e in episodes if e.task_key is not None}
    if len(keys) > 1:
        raise GroupRefused(
            f"the environment opened different tasks in one group ({', '.join(sorted(keys)[:4])}): the same seed must "
            "draw the same task"
        )
    n = common_prefix([e.opening for e in episodes])
    if n == 0:
        raise GroupRefused("the episodes' openings share no token: there is no prompt the learner could give them all")
    based = [rebase(e, n) for e in episodes]
    samples = [e.sample(decode(e.ids)) for e in based]
    task = task.model_copy(update={"prompt_token_ids": TokenIds(based[0].opening), "n_samples": len(based)})
    return ScoredGroup(task=task, samples=samples, scores=scores, replica_id=replica_id)


def env_scores(episodes: list[Episode]) -> list[Score]:
    """An environment's rewards as scores (success: reward > 0; no overlong shaping: an episode is cut at
    --max-episode-tokens instead)."""
    return [Score(reward=float(e.reward or 0.0), acc=(e.reward or 0.0) > 0) for e in episodes]


def rebase(ep: Episode, n: int) -> Episode:
    """The same episode opening on its first `n` tokens: the rest of its opening becomes context (out of the loss),
    so that a group's episodes share one prompt (the learner's) when their openings differ after it."""
    if n == len(ep.opening):
        return ep
    extra = ep.opening[n:]
    out = Episode(
        env=ep.env,
        opening=ep.opening[:n],
        reward=ep.reward,
        ended=ep.ended,
        tools=ep.tools,
        temperature=ep.temperature,
        top_p=ep.top_p,
        task_key=ep.task_key,
        env_seconds=ep.env_seconds,
        generate_seconds=ep.generate_seconds,
    )
    out.add_env(extra)
    out.ids += ep.ids
    out.logprobs += ep.logprobs
    first = ep.versions[0] if ep.versions else 0
    out.versions = [first] * len(extra) + ep.versions
    for t in ep.turns:
        out.add_turn(t.role, t.tokens)
    out.model_turns, out.last = ep.model_turns, ep.last
    return out


def common_prefix(seqs: list[list[int]]) -> int:
    """How many leading tokens all of these share."""
    n = min((len(s) for s in seqs), default=0)
    for i in range(n):
        if any(s[i] != seqs[0][i] for s in seqs):
            return i
    return n
