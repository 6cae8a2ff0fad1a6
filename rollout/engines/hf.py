"""transformers `generate` as a rollout engine, called in chunks: for machines without vLLM and for fast tests.

    engine = HFEngine(model_dir, dtype="fp32")            # or load_engine(model_dir, "hf") (rollout/engines)
    outs = engine.generate(prompts, [4, 2], SamplingParams(max_tokens=12, seed=7))

Its log-probs are vLLM's processed ones, computed from the raw logits: at the sampling temperature, top-p applied.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rollout.engines.base import Completion, FinishReason, SamplingParams, counts
from services.adapters import AdapterInfo, is_adapter
from services.dtype import Dtype, torch_dtype


class HFEngine:
    def __init__(self, model_dir: Path, *, threads: int | None = None, dtype: Dtype = "fp32"):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if threads:
            torch.set_num_threads(threads)
        self.dtype = dtype
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype(dtype)).eval()
        self.tokenizer: Any = AutoTokenizer.from_pretrained(model_dir)  # as the Engine protocol types it
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
        reason: FinishReason
        if end is not None:
            tokens, logps, reason = tokens[:end], logps[:end], "stop"
        else:
            reason = "length" if len(tokens) >= max_tokens else "stop"
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return Completion(tokens, text, logps, reason)

    def load_weights(self, hf_dir: Path, version: int) -> None:
        if is_adapter(hf_dir):
            raise ValueError(f"{hf_dir} is a LoRA adapter: the HF engine serves full weights; use the vllm engine")
        from safetensors.torch import load_file

        state: dict[str, Any] = {}
        for f in sorted(Path(hf_dir).glob("*.safetensors")):
            state.update(load_file(f))
        self.load_tensors(iter(state.items()), version, source=str(hf_dir))

    def load_tensors(
        self,
        named: Iterator[tuple[str, Any]],
        version: int,
        *,
        source: str = "the broadcast",
        adapter: AdapterInfo | None = None,
    ) -> None:
        if adapter is not None:
            raise ValueError("the HF engine serves full weights, not LoRA adapters: use the vllm engine")
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
