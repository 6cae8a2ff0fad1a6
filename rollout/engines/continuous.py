"""Continuous batching on vLLM: an engine that never stops, weights loaded while sequences are in flight, and the
policy version of every sampled token.

    engine = ContinuousEngine(VllmEngine(model_dir), update="keep")   # or load_engine(..., batching="continuous")
    engine.submit("t1", prompt_ids, n=8, params)         # G requests join the running batch at the next step
    for key, completions in engine.step():                # one engine step; the groups whose G samples finished
        ...                                               # completion.versions: ((version, n_tokens), ...)
    engine.load_tensors(named, version=8)                 # between two steps, with sequences in flight

This thread steps vLLM's engine (`LLMEngine`, in this process): between two steps the scheduler is paused with
its requests kept, which is where weights load (what `AsyncLLM.pause_generation(mode="keep")` does for an engine
in another process; here the broadcast's tensors go to the model without a copy or a pickle). What a load does
to the sequences in flight is the `update` mode:

    keep        they continue under the new weights from their next token; the K/V of their prefix stays as
                the old weights computed it (AReaL's interruptible rollouts, PipelineRL's in-flight updates)
    recompute   they are preempted and their prefix (prompt + tokens so far) re-encoded with the new weights
                before their next token: every later token is exactly the new policy's
    drain       the caller stops admitting prompts and loads once nothing is in flight (the chunked loop's
                behaviour; `draining` says a load waits)

Every token records the version that sampled it: the engine runs one step at a time, so the tokens a step returns
were sampled by the weights held during that step. A Completion carries them as run-lengths, oldest first.
New requests carry a cache salt of the version they start under, so a prompt never continues from prefix blocks
an older version computed (in `keep` mode those blocks stay cached for the sequences that own them).
On CPU a per-request seed crashes vLLM (rollout/engines/vllm_chunked.py): a seed seeds torch's global generator
once, which the engine samples from.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout.engines.base import UPDATE_MODES, Completion, Engine, RequestRefused, SamplingParams, UpdateMode, counts
from rollout.engines.vllm_chunked import VllmEngine, finish_reason, sampled_logprobs

log = logging.getLogger(__name__)


@dataclass
class _Sequence:
    group: str
    index: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    runs: list[list[int]] = field(default_factory=list)  # [[version, tokens], ...]

    def add(self, tokens: list[int], logprobs: list[float], text: str, version: int) -> None:
        self.tokens += tokens
        self.logprobs += logprobs
        self.text.append(text)
        if not tokens:
            return
        if self.runs and self.runs[-1][0] == version:
            self.runs[-1][1] += len(tokens)
        else:
            self.runs.append([version, len(tokens)])


@dataclass
class _Group:
    n: int
    priority: int
    done: dict[int, Completion] = field(default_factory=dict)


class ContinuousEngine:
    """The ContinuousBatching protocol (rollout/engines/base.py) on a VllmEngine's LLMEngine."""

    def __init__(self, engine: VllmEngine, *, update: UpdateMode = "keep", seed: int | None = None):
        if update not in UPDATE_MODES:
            raise ValueError(f"unknown weight-update mode {update!r}; use one of {UPDATE_MODES}")
        self.vllm: VllmEngine = engine
        self.update: UpdateMode = update
        # vLLM types step()'s outputs as a union with pooling outputs, which a generating engine never returns
        self.core: Any = engine.llm.llm_engine
        if self.core.vllm_config.scheduler_config.async_scheduling:
            raise RuntimeError(
                "vLLM's asynchronous scheduling is on: a step would return the previous step's tokens and the "
                "version of each token could not be told; build the engine with async_scheduling=False"
            )
        self.tokenizer, self.dtype = engine.tokenizer, engine.dtype
        self.seqs: dict[str, _Sequence] = {}  # request id -> sequence in flight
        self.groups: dict[str, _Group] = {}  # key -> its G samples
        self.loads = 0
        if seed is not None:
            import torch

            torch.manual_seed(seed)

    @property
    def version(self) -> int:
        return self.vllm.version

    @property
    def chunked(self) -> Engine:
        return self.vllm

    def in_flight(self, priority: int | None = None) -> int:
        """Sequences submitted and not finished (of one priority, if given)."""
        if priority is None:
            return len(self.seqs)
        return sum(1 for s in self.seqs.values() if self.groups[s.group].priority == priority)

    def submit(self, key: str, prompt: list[int], n: int, params: SamplingParams, *, priority: int = 0) -> None:
        from vllm import SamplingParams as VSP
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if key in self.groups:
            raise ValueError(f"{key!r} is in flight already")
        sampling = VSP(
            n=1,
            temperature=params.temperature,
            top_p=params.top_p,
            max_tokens=params.max_tokens,
            logprobs=0,
            output_kind=RequestOutputKind.DELTA,
            ignore_eos=params.ignore_eos,
        )
        from vllm.exceptions import VLLMClientError

        request = TokensPrompt(prompt_token_ids=prompt, cache_salt=f"v{self.version}")
        added: list[str] = []
        try:  # vLLM refuses a prompt itself (longer than the model's context): nothing stays behind
            for j in range(n):
                self.core.add_request(f"{key}#{j}", request, sampling)
                added.append(f"{key}#{j}")
        except (ValueError, VLLMClientError) as e:
            if added:
                self.core.abort_request(added)
            raise RequestRefused(str(e)) from e
        self.groups[key] = _Group(n, priority)
        self.seqs.update((rid, _Sequence(key, j)) for j, rid in enumerate(added))

    def step(self) -> list[tuple[str, list[Completion]]]:
        """One engine step; the groups it completed, each as (key, its G completions in submission order)."""
        if not self.seqs:
            return []
        version = self.version
        finished: list[tuple[str, list[Completion]]] = []
        for out in self.core.step():
            seq = self.seqs.get(out.request_id)
            if seq is None:
                continue
            c = out.outputs[0]
            seq.add(list(c.token_ids), sampled_logprobs(c), c.text, version)
            if not out.finished:
                continue
            del self.seqs[out.request_id]
            runs = tuple((v, k) for v, k in seq.runs)
            group = self.groups[seq.group]
            group.done[seq.index] = Completion(seq.tokens, "".join(seq.text), seq.logprobs, finish_reason(c), runs)
            if len(group.done) == group.n:
                del self.groups[seq.group]
                finished.append((seq.group, [group.done[j] for j in range(group.n)]))
        return finished

    def abort(self) -> None:
        """Drop everything in flight (a replica stopping: its prompts stay pending in Redis for another)."""
        if self.seqs:
            self.core.abort_request(list(self.seqs))
        self.seqs.clear()
        self.groups.clear()

    # ------------------------------------------------------------------ weights, between two steps

    @property
    def draining(self) -> bool:
        """In `drain` mode a load waits until nothing is in flight."""
        return self.update == "drain" and bool(self.seqs)

    def load_tensors(self, named: Iterator[tuple[str, Any]], version: int) -> None:
        self._load(lambda: self.vllm.load_tensors(named, version, keep_running=self.update == "keep"))

    def load_weights(self, hf_dir: Path, version: int) -> None:
        self._load(lambda: self.vllm.load_weights(hf_dir, version, keep_running=self.update == "keep"))

    def _load(self, load: Callable[[], None]) -> None:
        if self.draining:
            raise RuntimeError("drain mode: weights load once no sequence is in flight")
        t0 = time.perf_counter()
        load()  # keep: the running requests stay; recompute: they are preempted and re-encoded (vllm_chunked.py)
        self.loads += 1
        log.debug(
            "version %d loaded with %d sequences in flight (%s) in %.2f s",
            self.version,
            len(self.seqs),
            self.update,
            time.perf_counter() - t0,
        )

    # ------------------------------------------------------------------ the Engine protocol (warm-up, tests)

    def generate(self, prompts: list[list[int]], n: int | list[int], params: SamplingParams) -> list[list[Completion]]:
        """Run these prompts to the end, nothing else in flight; their completions in order."""
        if self.seqs:
            raise RuntimeError("generate() needs an idle engine: sequences are in flight")
        keys = [f"generate/{time.monotonic_ns()}/{i}" for i in range(len(prompts))]
        for key, prompt, k in zip(keys, prompts, counts(prompts, n), strict=True):
            self.submit(key, prompt, k, params)
        done: dict[str, list[Completion]] = {}
        while len(done) < len(keys):
            done.update(self.step())
        return [done[k] for k in keys]
