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

Every token records the version that sampled it: the engine runs one step at a time (asynchronous scheduling off,
rollout/engines/vllm_chunked.py), so at a load each sequence in flight has exactly the tokens the old weights
sampled; the load marks that count (vLLM's own, from its output processor) and the tokens after it are the new
version's. A Completion carries them as run-lengths, oldest first. Requests ask for their output once finished
(FINAL_ONLY): a step builds no per-token outputs for the sequences still running (measured: per-step DELTA outputs
cost ~8% of a small model's generation speed, docs/benchmarks.md).
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
from services.adapters import AdapterInfo

log = logging.getLogger(__name__)


@dataclass
class _Sequence:
    group: str
    index: int
    version: int  # the weights it started under
    marks: list[tuple[int, int]] = field(default_factory=list)  # (version before a load, its tokens at that load)

    def runs(self, tokens: int, version: int) -> tuple[tuple[int, int], ...]:
        """The version of each of its `tokens` as run-lengths, oldest first; `version`: the weights held now."""
        out: list[list[int]] = []
        done = 0
        for v, mark in [*self.marks, (version, tokens)]:
            at = min(mark, tokens)  # a stop string may have taken back tokens counted at a load
            if at > done:
                if out and out[-1][0] == v:
                    out[-1][1] += at - done
                else:
                    out.append([v, at - done])
                done = at
        return tuple((v, k) for v, k in out)


@dataclass
class _Group:
    n: int
    priority: int
    done: dict[int, Completion] = field(default_factory=dict)
    stream: bool = False  # its requests return their new tokens at every step (DELTA), gathered here
    parts: dict[int, tuple[list[int], list[float], list[str]]] = field(default_factory=dict)


@dataclass(frozen=True)
class Delta:
    """New tokens of a streamed sequence in flight (`submit(..., stream=True)`): one engine step's."""

    key: str
    index: int
    token_ids: list[int]
    text: str


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
        self.deltas: list[Delta] = []  # streamed sequences' new tokens since the last take_deltas()
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

    def submit(
        self, key: str, prompt: list[int], n: int, params: SamplingParams, *, priority: int = 0, stream: bool = False
    ) -> None:
        """`stream`: its new tokens are returned at every step (take_deltas), not only once finished."""
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
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
            ignore_eos=params.ignore_eos,
            stop=list(params.stop) or None,
        )
        from vllm.exceptions import VLLMClientError

        request = TokensPrompt(prompt_token_ids=prompt, cache_salt=f"v{self.version}")
        added: list[str] = []
        try:  # vLLM refuses a prompt itself (longer than the model's context): nothing stays behind
            for j in range(n):
                self.core.add_request(f"{key}#{j}", request, sampling, lora_request=self.vllm.adapter_request)
                added.append(f"{key}#{j}")
        except (ValueError, VLLMClientError) as e:
            if added:
                self.core.abort_request(added)
            raise RequestRefused(str(e)) from e
        self.groups[key] = _Group(n, priority, stream=stream)
        self.seqs.update((rid, _Sequence(key, j, self.version)) for j, rid in enumerate(added))

    def step(self) -> list[tuple[str, list[Completion]]]:
        """One engine step; the groups it completed, each as (key, its G completions in submission order)."""
        if not self.seqs:
            return []
        finished: list[tuple[str, list[Completion]]] = []
        for out in self.core.step():  # FINAL_ONLY: the sequences that finished in this step; DELTA: any new tokens
            seq = self.seqs.get(out.request_id)
            if seq is None:
                continue
            group, c = self.groups[seq.group], out.outputs[0]
            tokens, text, logprobs = list(c.token_ids), c.text, sampled_logprobs(c)
            if group.stream:
                if tokens or text:
                    self.deltas.append(Delta(seq.group, seq.index, tokens, text))
                ids, lps, texts = group.parts.setdefault(seq.index, ([], [], []))
                ids += tokens
                lps += logprobs
                texts.append(text)
                tokens, logprobs, text = ids, lps, "".join(texts)
            if not out.finished:
                continue
            del self.seqs[out.request_id]
            runs = seq.runs(len(tokens), self.version)
            group.done[seq.index] = Completion(tokens, text, logprobs, finish_reason(c), runs)
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
        self.deltas.clear()

    def cancel(self, key: str) -> bool:
        """Drop one group in flight (a gateway client gone); True if it was."""
        rids = [rid for rid, s in self.seqs.items() if s.group == key]
        if rids:
            self.core.abort_request(rids)
        for rid in rids:
            del self.seqs[rid]
        self.deltas = [d for d in self.deltas if d.key != key]
        return self.groups.pop(key, None) is not None

    def take_deltas(self) -> list[Delta]:
        """The streamed sequences' new tokens since the last call, in step order."""
        out, self.deltas = self.deltas, []
        return out

    # ------------------------------------------------------------------ weights, between two steps

    @property
    def draining(self) -> bool:
        """In `drain` mode a load waits until nothing is in flight."""
        return self.update == "drain" and bool(self.seqs)

    def load_tensors(
        self, named: Iterator[tuple[str, Any]], version: int, *, adapter: AdapterInfo | None = None
    ) -> None:
        keep = self.update == "keep"
        self._load(lambda: self.vllm.load_tensors(named, version, keep_running=keep, adapter=adapter))

    def load_weights(self, hf_dir: Path, version: int) -> None:
        self._load(lambda: self.vllm.load_weights(hf_dir, version, keep_running=self.update == "keep"))

    def tokens_so_far(self) -> dict[str, int]:
        """The tokens each sequence in flight has sampled (by request id), as vLLM's output processor counts them."""
        states, internal = self.core.output_processor.request_states, self.core.output_processor.external_req_ids
        return {
            rid: sum(states[i].detokenizer.num_output_tokens() for i in internal.get(rid, []) if i in states)
            for rid in self.seqs
        }

    def _load(self, load: Callable[[], None]) -> None:
        if self.draining:
            raise RuntimeError("drain mode: weights load once no sequence is in flight")
        t0 = time.perf_counter()
        before = self.version
        for rid, n in self.tokens_so_far().items():  # the old weights sampled these; the next token is the new's
            self.seqs[rid].marks.append((before, n))
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
