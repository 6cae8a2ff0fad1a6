"""The gateway's model calls: OpenAI's chat completions and completions, streamed (SSE) or not.

A call in a session (its key) is planned by the session (rollout/gateway/sessions.py: continued token-exactly, or
a new segment), submitted to the loop (rollout/gateway/core.py) and its answer kept in the session; a call with the
mesh token is not captured. A streamed call's tokens are sent as the engine samples them (with tools offered, the
answer is parsed whole first: its calls, then its text); a client that goes away mid-stream takes its sequences
out of the engine.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from rollout.engines.base import Completion, RequestRefused, SamplingParams
from rollout.engines.continuous import Delta
from rollout.gateway.auth import ApiError, Auth, Caller
from rollout.gateway.core import Busy, Gateway, Pending, Waiter
from rollout.gateway.schemas import ChatRequest, CompletionRequest, error
from rollout.gateway.sessions import CallRefused, Choice, assistant_message

CALL_TIMEOUT_S = 900.0  # one model call at most (then it leaves the engine and the client gets a 503)
router = APIRouter()


def check(gw: Gateway, req: ChatRequest | CompletionRequest) -> int:
    if req.model != gw.s.gateway_model:
        raise ApiError(
            404,
            f"the model {req.model!r} does not exist; this gateway serves {gw.s.gateway_model!r}",
            code="model_not_found",
            param="model",
        )
    if req.n > gw.s.gateway_max_n:
        raise ApiError(400, f"n: at most {gw.s.gateway_max_n} (--gateway-max-n)", param="n")
    limit = req.limit()
    if limit is not None and limit > gw.s.gateway_max_tokens:
        raise ApiError(400, f"max_tokens: at most {gw.s.gateway_max_tokens} (--gateway-max-tokens)", param="max_tokens")
    try:
        req.stops()
    except ValueError as e:
        raise ApiError(400, str(e), param="stop") from e
    return limit or min(gw.s.max_response_tokens, gw.s.gateway_max_tokens)


def enter(gw: Gateway, caller: Caller, req: ChatRequest | CompletionRequest, max_tokens: int, stream: bool) -> Pending:
    params = SamplingParams(req.temperature, req.top_p, max_tokens, ignore_eos=req.ignore_eos, stop=req.stops())
    sess = caller.session
    if isinstance(req, CompletionRequest) and isinstance(req.prompt, list):
        vocab = len(gw.tok)
        if not req.prompt or min(req.prompt) < 0 or max(req.prompt) >= vocab:
            raise ApiError(400, f"prompt: token ids must be 0 to {vocab - 1}, at least one", param="prompt")
    with gw.lock:
        try:
            if isinstance(req, ChatRequest):
                plan = sess.plan_chat(req, max_tokens) if sess else None
                prompt = plan.prompt if plan else gw.render.full(req.messages, req.offered_tools())
            else:
                plan = sess.plan_completion(req, max_tokens, lambda t, sp: encode(gw, t, sp)) if sess else None
                prompt = (
                    plan.prompt
                    if plan
                    else (list(req.prompt) if isinstance(req.prompt, list) else encode(gw, req.prompt, True))
                )
        except CallRefused as e:
            raise ApiError(409 if e.conflict else 400, str(e), code=e.code) from e
        except (TypeError, ValueError, RecursionError) as e:  # text the tokenizer cannot take (a lone surrogate)
            raise ApiError(400, f"the request's text cannot be tokenised: {str(e)[:200]}") from e
        try:  # the session is busy with this call from here: any refusal frees it
            if not prompt:
                raise ApiError(400, "prompt: empty once tokenised", param="prompt")
            if plan is None and len(prompt) + max_tokens > gw.s.gateway_max_context:
                raise ApiError(
                    400,
                    f"the prompt ({len(prompt)} tokens) and max_tokens exceed {gw.s.gateway_max_context} tokens",
                    code="context_length_exceeded",
                )
            key = f"g/{sess.sid if sess else 'free'}/{uuid.uuid4().hex[:12]}"
            p = Pending(key, prompt, req.n, params, Waiter(stream), stream, sess, plan)
            gw.submit(p)
        except (ApiError, Busy) as e:
            if sess is not None and plan is not None:
                sess.failed(time.monotonic())
            if isinstance(e, Busy):
                raise ApiError(429, str(e), "rate_limit_error", retry_after=1) from e
            raise
    return p


def encode(gw: Gateway, text: str, special: bool) -> list[int]:
    return list(gw.tok(text, add_special_tokens=special).input_ids)


def timed_out() -> ApiError:
    return ApiError(503, "the call ran past its time limit", "server_error", retry_after=5)


def refused(e: RequestRefused) -> ApiError:
    return ApiError(400, f"the engine refused the prompt: {e}", code="context_length_exceeded")


async def outcome(gw: Gateway, p: Pending) -> list[Completion]:
    try:
        got = await asyncio.wait_for(asyncio.shield(p.waiter.future), CALL_TIMEOUT_S)
    except TimeoutError:
        give_up(gw, p)
        raise timed_out() from None
    if isinstance(got, RequestRefused):
        give_up(gw, p)
        raise refused(got)
    return list(got)


def give_up(gw: Gateway, p: Pending) -> None:
    with gw.lock:
        p.waiter.withdrawn = True
        gw.cancel(p.key)
        if p.session is not None:
            p.session.failed(time.monotonic())


def keep(
    gw: Gateway, p: Pending, outs: list[Completion], t0: float, *, chat: bool = False, tools: bool = False
) -> list[tuple[Choice, str]]:
    """The call's choices (chat: their assistant messages, tool calls parsed if tools were offered), kept in its
    session; the metrics."""
    out = []
    for i, c in enumerate(outs):
        msg, finish = assistant_message(c, tools, f"call_{p.key[-12:]}_{i}")
        out.append((Choice(c, p.version, msg if chat else None), finish))
    with gw.lock:
        if p.session is not None and p.plan is not None:
            p.session.answered(p.plan, [c for c, _ in out], p.params.temperature, p.params.top_p, time.monotonic())
            if p.plan.new and len(p.session.segments) > 1:
                gw.m.segments.inc()
    gw.m.tokens.labels("prompt").inc(len(p.prompt))
    gw.m.tokens.labels("completion").inc(sum(len(c.token_ids) for c in outs))
    gw.m.added.observe(max(0.0, time.perf_counter() - t0 - p.engine_s))
    return out


def usage(p: Pending, outs: list[Completion]) -> dict[str, int]:
    n = sum(len(c.token_ids) for c in outs)
    return {"prompt_tokens": len(p.prompt), "completion_tokens": n, "total_tokens": len(p.prompt) + n}


def logprobs_of(gw: Gateway, c: Completion) -> dict[str, Any]:
    content = []
    for t, lp in zip(c.token_ids, c.logprobs, strict=True):
        text = gw.tok.decode([t])
        content.append({"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []})
    return {"content": content}


@router.post("/v1/chat/completions")
async def chat(request: Request, req: ChatRequest, caller: Auth) -> Any:
    """OpenAI's chat completions; in a session, captured token by token for training."""
    gw: Gateway = request.app.state.gw
    t0 = time.perf_counter()
    max_tokens = check(gw, req)
    tools = req.offered_tools() is not None
    p = enter(gw, caller, req, max_tokens, req.stream)
    rid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
    head = {"id": rid, "created": created, "model": gw.s.gateway_model}
    if req.stream:
        include = bool(req.stream_options and req.stream_options.include_usage)
        chunk = sse(head, "chat.completion.chunk")
        gen = chat_events(gw, p, req, chunk, tools, t0)
        return StreamingResponse(framed(gw, p, "chat", include, chunk, gen), media_type="text/event-stream")
    outs = await outcome(gw, p)
    kept = keep(gw, p, outs, t0, chat=True, tools=tools)
    gw.m.calls.labels("chat", "200").inc()
    choices = [
        {
            "index": i,
            "message": ch.message,
            "finish_reason": finish,
            "logprobs": logprobs_of(gw, ch.c) if req.logprobs else None,
        }
        for i, (ch, finish) in enumerate(kept)
    ]
    body = {**head, "object": "chat.completion", "choices": choices, "usage": usage(p, outs)}
    return with_ids(body, p, outs) if req.return_token_ids else body


def with_ids(body: dict[str, Any], p: Pending, outs: list[Completion]) -> dict[str, Any]:
    for choice, c in zip(body["choices"], outs, strict=True):
        choice["token_ids"] = c.token_ids
    return {**body, "prompt_token_ids": p.prompt}


async def events(p: Pending) -> AsyncIterator[Delta | list[Completion]]:
    """A streamed call's new tokens as the engine samples them, then its completions (last)."""
    assert p.waiter.queue is not None
    while True:
        try:
            item = await asyncio.wait_for(p.waiter.queue.get(), CALL_TIMEOUT_S)
        except TimeoutError:
            raise timed_out() from None
        if isinstance(item, RequestRefused):
            raise refused(item)
        yield item
        if not isinstance(item, Delta):
            return


def sse(head: dict[str, Any], kind: str) -> Any:
    """One server-sent event of this call: its choices (and more, e.g. usage) in the `kind` object."""

    def chunk(choices: list[dict[str, Any]], **more: Any) -> str:
        return f"data: {json.dumps({**head, 'object': kind, 'choices': choices, **more})}\n\n"

    return chunk


async def framed(
    gw: Gateway, p: Pending, route: str, include: bool, chunk: Any, body: AsyncIterator[str | list[Completion]]
) -> AsyncIterator[str]:
    """What both routes' streams share: the body's events (it yields the kept completions once answered), the usage
    if asked, [DONE]; an error as an error event; a client gone before the answer takes its sequences out of the
    engine."""
    done = False
    try:
        outs: list[Completion] = []
        async for item in body:
            if isinstance(item, str):
                yield item
            else:
                done, outs = True, item
        if include:
            yield chunk([], usage=usage(p, outs))
        yield "data: [DONE]\n\n"
        gw.m.calls.labels(route, "200").inc()
    except ApiError as e:
        yield f"data: {json.dumps(error(str(e), e.kind))}\n\n"
    finally:
        if not done:
            give_up(gw, p)


async def chat_events(
    gw: Gateway, p: Pending, req: ChatRequest, chunk: Any, tools: bool, t0: float
) -> AsyncIterator[str | list[Completion]]:
    yield chunk(
        [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None} for i in range(req.n)]
    )
    outs: list[Completion] = []
    async for item in events(p):
        if isinstance(item, Delta):
            if not tools:  # with tools the answer is parsed once whole: its calls, then its text
                yield chunk([{"index": item.index, "delta": {"content": item.text}, "finish_reason": None}])
        else:
            outs = item
    kept = keep(gw, p, outs, t0, chat=True, tools=tools)
    yield outs
    for i, (ch, finish) in enumerate(kept):
        delta: dict[str, Any] = {}
        if tools:
            msg = ch.message or {}
            delta = {"content": msg.get("content")}
            if msg.get("tool_calls"):
                delta["tool_calls"] = [{"index": j, **tc} for j, tc in enumerate(msg["tool_calls"])]
        lp = logprobs_of(gw, ch.c) if req.logprobs else None
        last = {"index": i, "delta": delta, "finish_reason": finish, "logprobs": lp}
        ids = {"token_ids": ch.c.token_ids, "prompt_token_ids": p.prompt} if req.return_token_ids else {}
        yield chunk([{**last, **ids}])


@router.post("/v1/completions")
async def completions(request: Request, req: CompletionRequest, caller: Auth) -> Any:
    """OpenAI's (legacy) completions: text or token ids in; in a session, captured for training."""
    gw: Gateway = request.app.state.gw
    t0 = time.perf_counter()
    max_tokens = check(gw, req)
    p = enter(gw, caller, req, max_tokens, req.stream)
    head = {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": gw.s.gateway_model}
    if req.stream:
        include = bool(req.stream_options and req.stream_options.include_usage)
        chunk = sse(head, "text_completion")
        gen = completion_events(gw, p, req, chunk, t0)
        return StreamingResponse(framed(gw, p, "completions", include, chunk, gen), media_type="text/event-stream")
    outs = await outcome(gw, p)
    kept = keep(gw, p, outs, t0)
    gw.m.calls.labels("completions", "200").inc()
    choices = [
        {
            "index": i,
            "text": ch.c.text,
            "finish_reason": finish,
            "logprobs": legacy_logprobs(gw, ch.c) if req.logprobs is not None else None,
        }
        for i, (ch, finish) in enumerate(kept)
    ]
    body = {**head, "object": "text_completion", "choices": choices, "usage": usage(p, outs)}
    return with_ids(body, p, outs) if req.return_token_ids else body


def legacy_logprobs(gw: Gateway, c: Completion) -> dict[str, Any]:
    tokens = [gw.tok.decode([t]) for t in c.token_ids]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": list(c.logprobs), "top_logprobs": None, "text_offset": offsets}


async def completion_events(
    gw: Gateway, p: Pending, req: CompletionRequest, chunk: Any, t0: float
) -> AsyncIterator[str | list[Completion]]:
    outs: list[Completion] = []
    async for item in events(p):
        if isinstance(item, Delta):
            yield chunk([{"index": item.index, "text": item.text, "finish_reason": None, "logprobs": None}])
        else:
            outs = item
    kept = keep(gw, p, outs, t0)
    yield outs
    for i, (ch, finish) in enumerate(kept):
        lp = legacy_logprobs(gw, ch.c) if req.logprobs is not None else None
        ids = {"token_ids": ch.c.token_ids, "prompt_token_ids": p.prompt} if req.return_token_ids else {}
        yield chunk([{"index": i, "text": "", "finish_reason": finish, "logprobs": lp, **ids}])
