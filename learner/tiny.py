"""Tiny random Llama models and hand-made TrainBatches: for tests, benchmarks and smoke runs.

model_dir = tiny_llama(Path("/tmp/tiny"))          # a random LlamaForCausalLM saved as safetensors
batch = tiny_batch(0)                              # a TrainBatch whose token ids fit VOCAB
"""

from __future__ import annotations

import random
import uuid
from pathlib import Path
from typing import Any

from services.schemas import PromptTask, Sample, Score, ScoredGroup, TrainBatch

VOCAB = 256


def tiny_tokenizer() -> Any:
    """A byte-level tokenizer: 256 tokens, one per byte, no merges; any text round-trips. With a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=alphabet[1], pad_token=alphabet[0])
    fast.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return fast


def tiny_llama(
    path: Path,
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    vocab: int = VOCAB,
    seed: int = 0,
    tokenizer: bool = False,
) -> Path:
    """A random LlamaForCausalLM saved to `path` (with the byte-level tokenizer when `tokenizer`, vocab 256)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=512,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    if tokenizer:
        tiny_tokenizer().save_pretrained(path)
    return path


def group(
    i: int, rewards: list[float], *, prompt_len: int = 6, resp_len: int = 8, version: int = 0, seed: int | None = None
) -> ScoredGroup:
    rng = random.Random(i if seed is None else seed)
    task = PromptTask(
        task_id=f"t{i}-{uuid.uuid4().hex[:6]}",
        prompt_id=f"p{i}",
        prompt_token_ids=[rng.randrange(3, VOCAB) for _ in range(prompt_len)],
        ground_truth="1",
        verifier="dapo_math",
        data_source="test",
        n_samples=len(rewards),
    )
    samples = [
        Sample(
            response_token_ids=[rng.randrange(3, VOCAB) for _ in range(resp_len - j % 3)],
            response_text="x",
            logprobs=[-5.5] * (resp_len - j % 3),
            finish_reason="stop",
            policy_version=version,
        )
        for j in range(len(rewards))
    ]
    scores = [Score(reward=r, acc=r > 0) for r in rewards]
    return ScoredGroup(task=task, samples=samples, scores=scores, replica_id="test")


def tiny_batch(batch_id: int, n_groups: int = 2, g: int = 4, **kw: object) -> TrainBatch:
    rewards = [1.0 if k % 2 == 0 else -1.0 for k in range(g)]
    return TrainBatch.assemble(batch_id, [group(batch_id * 100 + i, rewards, **kw) for i in range(n_groups)])  # type: ignore[arg-type]
