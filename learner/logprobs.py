"""Per-token log-probs and entropies from the hidden states, the lm_head applied a chunk of positions at a time.

    logp, ent = chunked_logprobs(hidden, head, ids, temperature, chunk=1024)   # hidden [B, T, H] -> [B, T]

No [B, T, V] tensor is ever made (vocabulary 49,152: a 32 x 128-token micro-batch would hold 800 MB of fp32
logits): each chunk of positions gets its logits (in the model's dtype), upcast to fp32, its log-softmax, the
picked token's log-prob and the entropy, and is freed. The backward pass recomputes each chunk's logits from the
saved hidden states (one more lm_head matmul per token) instead of keeping them: memory grows with the chunk, not
the batch. Values and gradients equal those of the unchunked `loss.token_logprobs_and_entropy` on the full logits.

Alignment as in loss.token_logprobs: out[b, t] is the log-prob of ids[b, t] given ids[b, :t]; column 0 is 0. The
logits are divided by each row's sampling temperature (the distribution the rollout sampled from). The entropy
carries no gradient (it is a metric).
"""

from __future__ import annotations

from typing import Any

import torch

DEFAULT_CHUNK = 1024  # positions per chunk: 1024 x 49,152 fp32 logits = 200 MB at most at any time

# Config attributes of model families whose logits are not the lm_head's output, and the value at which each
# changes nothing: Gemma 2/3 soft-cap them (tanh(z / c) * c), Cohere multiplies them by `logit_scale`, Granite
# divides them by `logits_scaling`. vLLM applies these; a log-prob taken from the head alone would disagree.
LOGIT_TRANSFORMS = {"final_logit_softcapping": None, "logit_scale": 1.0, "logits_scaling": 1.0}


def logits_transform(config: Any) -> str | None:
    """The name of the config attribute by which this model transforms its logits after the head, or None."""
    for name, neutral in LOGIT_TRANSFORMS.items():
        value = getattr(config, name, neutral)
        if value is not None and value != neutral:
            return name
    return None


def chunked_logprobs(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    ids: torch.Tensor,
    temperature: torch.Tensor | None = None,
    *,
    chunk: int = DEFAULT_CHUNK,
    with_entropy: bool = False,
    only: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hidden [B, T, H] (the final norm applied), head: the lm_head (a Linear, bias or not), ids [B, T],
    temperature [B] or None -> (log-probs [B, T] fp32, entropies [B, T] fp32 or None).

    `only` [B, T]: the positions whose log-probs are wanted (the response tokens of the loss); the others are 0 and
    cost nothing. A prompt is ~60% of a row in the learning run, and the vocabulary-wide work (49,152 fp32 values
    per position: upcast, logsumexp, softmax) is the most of the lm_head's cost on a CPU."""
    b, t, h = hidden.shape
    x = hidden[:, :-1].reshape(-1, h)  # position t predicts token t+1
    targets = ids[:, 1:].reshape(-1)
    temp = None if temperature is None or bool((temperature == 1).all()) else temperature
    temp = None if temp is None else temp.to(hidden.device, torch.float32).view(-1, 1).expand(b, t - 1).reshape(-1)
    rows = None if only is None else only[:, 1:].reshape(-1).to(hidden.device).nonzero().squeeze(-1)
    if rows is not None:
        x, targets, temp = x.index_select(0, rows), targets[rows], None if temp is None else temp[rows]
    weight, bias = head.weight, getattr(head, "bias", None)
    logp, ent = _ChunkedLogprob.apply(x, weight, bias, targets, temp, chunk, with_entropy)
    if rows is not None:
        full = torch.zeros(b * (t - 1), device=x.device)
        logp = full.index_copy(0, rows, logp)
        ent = None if ent is None else full.index_copy(0, rows, ent)
    pad = torch.nn.functional.pad
    return pad(logp.view(b, t - 1), (1, 0)), None if ent is None else pad(ent.view(b, t - 1), (1, 0))


def _logits(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temp: torch.Tensor | None
) -> torch.Tensor:
    """fp32 logits of one chunk, at its temperature (the matmul in the model's dtype: bf16 on bf16 weights)."""
    z = torch.nn.functional.linear(x, weight, bias).float()
    return z if temp is None else z.div_(temp.unsqueeze(-1))


class _ChunkedLogprob(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        temp: torch.Tensor | None,
        chunk: int,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = torch.empty(x.shape[0], device=x.device, dtype=torch.float32)
        ent_out = torch.empty_like(out) if with_entropy else None
        for s in range(0, x.shape[0], chunk):
            e = s + chunk
            z = _logits(x[s:e], weight, bias, None if temp is None else temp[s:e])
            lse = torch.logsumexp(z, dim=-1)
            out[s:e] = z.gather(-1, targets[s:e].unsqueeze(-1)).squeeze(-1) - lse
            if ent_out is not None:  # H = lse - sum(softmax * z)
                ent_out[s:e] = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
        ctx.save_for_backward(x, weight, bias, targets, temp)
        ctx.chunk = chunk
        if ent_out is not None:
            ctx.mark_non_differentiable(ent_out)
        return out, ent_out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _grad_ent: Any = None) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, weight, bias, targets, temp = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        gx = torch.zeros_like(x) if need_x else None
        gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        gb = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
        for s in range(0, x.shape[0], ctx.chunk):
            e = s + ctx.chunk
            z = _logits(x[s:e], weight, bias, None if temp is None else temp[s:e])
            # d logp / d z = onehot(target) - softmax(z); the temperature divides z, so it divides the gradient too
            scale = grad[s:e] if temp is None else grad[s:e] / temp[s:e]
            gz = torch.softmax(z, dim=-1).mul_(-scale.unsqueeze(-1))
            gz.scatter_add_(-1, targets[s:e].unsqueeze(-1), scale.unsqueeze(-1))
            if gx is not None:
                gx[s:e] = (gz.to(weight.dtype) @ weight).to(x.dtype)
            if gw is not None:  # the matmul in the model's dtype, accumulated in fp32 over the chunks
                gw += (gz.to(weight.dtype).t() @ x[s:e].to(weight.dtype)).float()
            if gb is not None:
                gb += gz.sum(0)
        return (
            gx,
            None if gw is None else gw.to(weight.dtype),
            None if gb is None else gb.to(weight.dtype),
            None,
            None,
            None,
            None,
        )
