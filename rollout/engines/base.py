"""What every rollout engine is, and the types they share; no implementation lives or is imported here.

    params = SamplingParams(temperature=1.0, max_tokens=256, seed=7)
    outs = engine.generate([[1, 2, 3]], n=4, params)      # outs[prompt][sample] -> Completion
    engine.load_weights(hf_dir, version=7)                # a learner snapshot (late joiners, filesystem transport)
    engine.load_tensors(named_tensors, version=8)         # a broadcast round (rollout/weight_receiver.py)

`Engine` is called in chunks: a call runs its prompts to the end, and weights load between calls (HFEngine,
rollout/engines/hf.py; VllmEngine, rollout/engines/vllm_chunked.py). `ContinuousBatching` never stops: prompts
join the running batch at the next step, and weights load between two steps with sequences in flight
(rollout/engines/continuous.py). `load_engine` (rollout/engines/__init__.py) builds either.

Behaviour log-probs are those of the distribution sampled from: at the sampling temperature, with top-p applied
(greedy: the model's own). The learner recomputes them with the temperature each Sample carries (not top-p: with
top-p < 1 the off-policy weight sees the truncation); with DAPO's temperature 1.0 and top-p 1.0 all of these are
the model's own distribution.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from services.adapters import AdapterInfo
from services.dtype import Dtype

FinishReason = Literal["stop", "length", "abort"]
Batching = Literal["chunked", "continuous"]
# what a weight load does to the sequences in flight of a continuously batching engine (rollout/engines/continuous.py)
UpdateMode = Literal["keep", "recompute", "drain"]
UPDATE_MODES: tuple[UpdateMode, ...] = ("keep", "recompute", "drain")
# how a vLLM engine serves a LoRA adapter (rollout/engines/lora.py): vLLM's LoRA layers, or merged into its weights
LoraServing = Literal["auto", "vllm", "merge"]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    seed: int | None = None
    ignore_eos: bool = False  # generate max_tokens whatever is sampled (benchmarks: lengths as drawn)
    stop: tuple[str, ...] = ()  # stop strings (the gateway's callers; continuous batching only)


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: FinishReason
    # the policy version that sampled each token, as run-lengths ((version, n_tokens), ...), oldest first; None: all
    # by the engine's version when the call began (the chunked engines load weights only between calls)
    versions: tuple[tuple[int, int], ...] | None = None


class RequestRefused(ValueError):
    """The engine refuses this prompt on its own (e.g. longer than the model's context): retrying cannot help."""


class Engine(Protocol):
    @property
    def version(self) -> int:
        """Policy version of the weights it holds."""
        ...

    tokenizer: Any
    dtype: Dtype  # what it computes in (resolved: bf16 or fp32)

    def generate(self, prompts: list[list[int]], n: int | list[int], params: SamplingParams) -> list[list[Completion]]:
        """`n` samples for each prompt (one count for all, or one per prompt)."""
        ...

    def load_weights(self, hf_dir: Path, version: int) -> None: ...

    def load_tensors(
        self, named: Iterator[tuple[str, Any]], version: int, *, adapter: AdapterInfo | None = None
    ) -> None:
        """A broadcast round; `adapter`: its tensors are a LoRA adapter of this base (the round's manifest says)."""
        ...


class ContinuousBatching(Engine, Protocol):
    """An engine that never stops: groups of G requests are submitted, each engine step returns the groups it
    completed, and weights load between two steps with sequences in flight (as `update` says)."""

    update: UpdateMode
    loads: int  # weight loads so far

    @property
    def chunked(self) -> Engine:
        """The engine it steps, to be called in chunks once nothing is in flight (the seeded evaluation)."""
        ...

    @property
    def draining(self) -> bool:
        """In `drain` mode a load waits until nothing is in flight."""
        ...

    def in_flight(self, priority: int | None = None) -> int:
        """Sequences submitted and not finished (of one priority, if given)."""
        ...

    def submit(
        self, key: str, prompt: list[int], n: int, params: SamplingParams, *, priority: int = 0, stream: bool = False
    ) -> None:
        """`n` samples of `prompt` join the running batch at the next step; RequestRefused if the engine refuses
        the prompt itself. `stream`: their new tokens come out at every step too (take_deltas)."""
        ...

    def cancel(self, key: str) -> bool:
        """Drop one group in flight; True if it was."""
        ...

    def take_deltas(self) -> list[Any]:
        """Streamed sequences' new tokens since the last call (rollout/engines/continuous.py's Delta)."""
        ...

    def step(self) -> list[tuple[str, list[Completion]]]:
        """One engine step; the groups it completed, each as (key, its G completions in submission order)."""
        ...

    def abort(self) -> None:
        """Drop everything in flight."""
        ...


def encode_prompt(tokenizer: Any, text: str, chat_template: bool = True) -> list[int]:
    """The prompt's token ids, in the model's chat template when it has one."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def counts(prompts: list[list[int]], n: int | list[int]) -> list[int]:
    """The number of samples of each prompt: one count for all, or one per prompt."""
    return [n] * len(prompts) if isinstance(n, int) else list(n)
