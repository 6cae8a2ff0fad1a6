"""Generation engines: G samples per prompt, with the behaviour log-prob of every sampled token.

    engine = load_engine(model_dir, "vllm", kv_cache_gib=2)   # VllmEngine (rollout/vllm_engine.py) or "hf": HFEngine
    outs = engine.generate([[1, 2, 3]], n=4, params)          # outs[prompt][sample] -> Completion
    engine.load_weights(hf_dir, version=7)                    # a learner snapshot (late joiners, filesystem transport)
    engine.load_tensors(named_tensors, version=8)             # a broadcast round (rollout/weight_receiver.py)

Behaviour log-probs are those of the distribution sampled from: at the sampling temperature, with top-p applied
(greedy: the model's own). The learner recomputes them with the temperature each Sample carries (not top-p: with
top-p < 1 the off-policy weight sees the truncation); with DAPO's temperature 1.0 and top-p 1.0 all of these are
the model's own distribution.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from services.dtype import Dtype, torch_dtype

log = logging.getLogger(__name__)

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    seed: int | None = None
    ignore_eos: bool = False  # generate max_tokens whatever is sampled (benchmarks: lengths as drawn)


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: FinishReason
    # the policy version that sampled each token, as run-lengths ((version, n_tokens), ...), oldest first; None: all
    # by the engine's version when the call began (the chunked engines load weights only between calls)
    versions: tuple[tuple[int, int], ...] | None = None


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

    def load_tensors(self, named: Iterator[tuple[str, Any]], version: int) -> None: ...


def encode_prompt(tokenizer: Any, text: str, chat_template: bool = True) -> list[int]:
    """The prompt's token ids, in the model's chat template when it has one."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def counts(prompts: list[list[int]], n: int | list[int]) -> list[int]:
    return [n] * len(prompts) if isinstance(n, int) else list(n)


class HFEngine:
    """transformers `generate`: for machines without vLLM and for fast tests."""

    def __init__(self, model_dir: Path, *, threads: int | None = None, dtype: Dtype = "fp32"):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if threads:
            torch.set_num_threads(threads)
        self.dtype = dtype
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype(dtype)).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.version = 0
        cfg = self.model.generation_config
        self.eos = {cfg.eos_token_id} if isinstance(cfg.eos_token_id, int) else set(cfg.eos_token_id or [])
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    def generate(self, prompts: list[list[int]], n: int | list[int], params: SamplingParams) -> list[list[Completion]]:
        import torch

        out: list[list[Completion]] = []
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        for prompt, k in zip(prompts, counts(prompts, n), strict=True):
            if gen is not None:
                torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
            ids = torch.tensor([prompt] * k, dtype=torch.long)
            with torch.no_grad():
                res = self.model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=params.temperature > 0,
                    temperature=params.temperature or None,
                    top_p=params.top_p,
                    top_k=0,
                    max_new_tokens=params.max_tokens,
                    output_logits=True,
                    return_dict_in_generate=True,
                    pad_token_id=self.pad,
                )
            # raw logits -> log-probs of the distribution sampled from: at the temperature, top-p applied (greedy:
            # the model's own), as vLLM's processed log-probs
            logits = torch.stack(res.logits, dim=1).float()  # [k, steps, V]
            if params.temperature > 0:
                logits = top_p_filter(logits / params.temperature, params.top_p)
            logp = logits.log_softmax(-1)
            new = res.sequences[:, len(prompt) :]
            picked = logp.gather(-1, new.unsqueeze(-1)).squeeze(-1)
            out.append([self._completion(new[j].tolist(), picked[j].tolist(), params.max_tokens) for j in range(k)])
        return out

    def _completion(self, tokens: list[int], logps: list[float], max_tokens: int) -> Completion:
        end = next((i + 1 for i, t in enumerate(tokens) if t in self.eos), None)
        if end is not None:
            tokens, logps, reason = tokens[:end], logps[:end], "stop"
        else:
            reason = "length" if len(tokens) >= max_tokens else "stop"
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return Completion(tokens, text, logps, reason)  # type: ignore[arg-type]

    def load_weights(self, hf_dir: Path, version: int) -> None:
        from safetensors.torch import load_file

        state: dict[str, Any] = {}
        for f in sorted(Path(hf_dir).glob("*.safetensors")):
            state.update(load_file(f))
        self.load_tensors(iter(state.items()), version, source=str(hf_dir))

    def load_tensors(self, named: Iterator[tuple[str, Any]], version: int, *, source: str = "the broadcast") -> None:
        state = dict(named)
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        if unexpected or [k for k in missing if not k.endswith("lm_head.weight")]:
            raise ValueError(f"weights from {source} do not fit the model: missing {missing}, unexpected {unexpected}")
        self.model.tie_weights()
        self.version = version


def top_p_filter(logits: Any, top_p: float) -> Any:
    """Logits outside the nucleus (the smallest set of tokens with probability >= top_p) set to -inf, keeping at
    least the most likely token: what vLLM's sampler does before its processed log-probs."""
    if top_p >= 1.0:
        return logits
    import torch

    ordered, order = logits.sort(dim=-1)
    drop = ordered.softmax(-1).cumsum(-1) <= 1 - top_p
    drop[..., -1] = False
    return torch.empty_like(logits).scatter_(-1, order, ordered.masked_fill(drop, float("-inf")))


def load_engine(model_dir: Path, kind: str, *, dtype: Dtype = "fp32", **vllm_kw: Any) -> Engine:
    """`dtype`: resolved already (services.dtype.resolve_dtype), bf16 or fp32."""
    if kind == "hf":
        return HFEngine(model_dir, dtype=dtype)
    from rollout.vllm_engine import VllmEngine

    return VllmEngine(model_dir, dtype=dtype, **vllm_kw)
