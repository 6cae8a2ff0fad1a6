"""The gateway's model calls: OpenAI's chat completions and completions, streamed (SSE) or not.

A call in a session (its key) takes its session (under the gateway's lock), is planned by it (rollout/gateway/
sessions.py: continued token-exactly, or a new segment; rendered in a worker thread, outside the lock, after a size
check that needs no tokeniser), submitted to the loop (rollout/gateway/core.py), which keeps its answer in the
session; a call with the mesh token is not captured. A streamed call's tokens are sent as the engine samples them
(with tools offered, the answer is parsed whole first: its calls, then its text); a client that goes away
mid-stream takes its sequences out of the engine and frees its session.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from rollout.engines.base import Completion, RequestRefused, SamplingParams
from rollout.engines.continuous import Delta
from rollout.gateway.auth import ApiError, CallAuth, Caller, leaving
from rollout.gateway.core import Busy, Gateway, Leaving, Pending, Waiter
from rollout.gateway.schemas import ChatRequest, CompletionRequest, error
from rollout.gateway.sessions import CallRefused, Choice, Session

CALL_TIMEOUT_S = 900.0  # one model call at most (then it leaves the engine and the client gets a 503)
router = APIRouter()
T = TypeVar("T")


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
    if isinstance(req, CompletionRequest) and isinstance(req.prompt, list):
        vocab = len(gw.tok)
        if not req.prompt or min(req.prompt) < 0 or max(req.prompt) >= vocab:
            raise ApiError(400, f"prompt: token ids must be 0 to {vocab - 1}, at least one", param="prompt")
    return limit or min(gw.s.max_response_tokens, gw.s.gateway_max_tokens)


def refusals(fn: Callable[[], T]) -> T:
    """fn() with a session's refusal as its answer: 400, 409 (in flight: the SDK retries), 410 (over)."""
    try:
        return fn()
    except CallRefused as e:
        status = 410 if e.over else 409 if e.conflict else 400
        raise ApiError(status, str(e), code=e.code or ("session_over" if e.over else None)) from e


async def enter(gw: Gateway, caller: Caller, req: ChatRequest | CompletionRequest, max_tokens: int) -> Pending:
    """The call planned and on its way to the engine. Its session is taken for it under the gateway's lock, its
    prompt rendered outside the lock and off the event loop (a long conversation takes a while to render: the
    engine's loop and the other requests do not wait for it), then submitted under the lock; any refusal on the
    way, or the client gone, gives the session back."""
    params = SamplingParams(req.temperature, req.top_p, max_tokens, ignore_eos=req.ignore_eos, stop=req.stops())
    sess = caller.session
    key = f"g/{sess.sid if sess else 'free'}/{uuid.uuid4().hex[:12]}"
    if sess is not None:
        with gw.lock:
            refusals(lambda: sess.begin_call(key, req.temperature, req.top_p))
    try:
        plan, prompt = await run_in_threadpool(render, gw, sess, req, max_tokens)
        chat = isinstance(req, ChatRequest)
        tools = isinstance(req, ChatRequest) and req.offered_tools() is not None
        p = Pending(key, prompt, req.n, params, Waiter(req.stream), req.stream, sess, plan, tools=tools, chat=chat)
        with gw.lock:
            gw.submit(p)
        return p
    except BaseException as e:
        if sess is not None:
            with gw.lock:
                sess.call_failed(key, time.monotonic())
        if isinstance(e, Busy):
            raise ApiError(429, str(e), "rate_limit_error", code=e.code, retry_after=1) from e
        if isinstance(e, Leaving):
            raise leaving(e) from e
        raise


def render(gw: Gateway, sess: Session | None, req: ChatRequest | CompletionRequest, max_tokens: int) -> Any:
    """(the session's plan or None, the prompt's token ids) — in a worker thread. The size is checked before
    anything is tokenised."""
    room = gw.s.gateway_max_context - max_tokens
    try:
        if isinstance(req, ChatRequest):
            refusals(lambda: gw.render.check_size(req.messages, req.offered_tools(), room))
            if sess is not None:
                plan = refusals(lambda: sess.plan_chat(req, max_tokens))
                return plan, plan.prompt
            prompt = refusals(lambda: gw.render.full(req.messages, req.offered_tools()))
        else:
            if isinstance(req.prompt, str) and len(req.prompt) > room * gw.render.max_token_chars:
                too_long = f"prompt: {len(req.prompt)} characters cannot fit {room} tokens"
                raise ApiError(400, too_long, code="context_length_exceeded")
            if sess is not None:
                plan = refusals(lambda: sess.plan_completion(req, max_tokens, lambda t, sp: encode(gw, t, sp)))
                return plan, plan.prompt
            prompt = list(req.prompt) if isinstance(req.prompt, list) else encode(gw, req.prompt, True)
    except (TypeError, ValueError, RecursionError) as e:  # text the tokenizer cannot take (a lone surrogate)
        raise ApiError(400, f"the request's text cannot be tokenised: {str(e)[:200]}") from e
    if not prompt:
        raise ApiError(400, "prompt: empty once tokenised", param="prompt")
    if len(prompt) + max_tokens > gw.s.gateway_max_context:
        raise ApiError(
            400,
            f"the prompt ({len(prompt)} tokens) and max_tokens exceed {gw.s.gateway_max_context} tokens",
            code="context_length_exceeded",
        )
    return None, prompt


def encode(gw: Gateway, text: str, special: bool) -> list[int]:
    return list(gw.tok(text, add_special_tokens=special).input_ids)


def timed_out() -> ApiError:
    return ApiError(503, "the call ran past its time limit", "server_error", retry_after=5)


def refused(e: RequestRefused) -> ApiError:
    return ApiError(400, f"the engine refused the prompt: {e}", code="context_length_exceeded")


def answered(got: Any) -> list[Choice]:
    """The loop's answer to a call: its choices, or why there are none."""
    if isinstance(got, RequestRefused):
        raise refused(got)
    if isinstance(got, Leaving):
        raise leaving(got)
    return list(got)


async def outcome(gw: Gateway, p: Pending) -> list[Choice]:
    """The call's choices once the loop has them (and kept them in its session); a timeout or the client gone
    takes its sequences out of the engine and frees its session."""
    try:
        got = await asyncio.wait_for(asyncio.shield(p.waiter.future), CALL_TIMEOUT_S)
    except TimeoutError:
        with gw.lock:
            gw.give_up(p)
        raise timed_out() from None
    except asyncio.CancelledError:
        with gw.lock:
            gw.give_up(p)
        raise
    return answered(got)


def finish(ch: Choice, chat: bool) -> str:
    """The choice's finish reason in OpenAI's terms."""
    if chat and (ch.message or {}).get("tool_calls"):
        return "tool_calls"
    return "length" if ch.c.finish_reason == "length" else "stop"


def keep(gw: Gateway, p: Pending, choices: list[Choice], t0: float) -> list[tuple[Choice, str]]:
    """The call's choices with their finish reasons; the metrics."""
    outs = [ch.c for ch in choices]
    gw.m.tokens.labels("prompt").inc(len(p.prompt))
    gw.m.tokens.labels("completion").inc(sum(len(c.token_ids) for c in outs))
    gw.m.added.observe(max(0.0, time.perf_counter() - t0 - p.engine_s))
    return [(ch, finish(ch, p.chat)) for ch in choices]


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
async def chat(request: Request, req: ChatRequest, caller: CallAuth) -> Any:
    """OpenAI's chat completions; in a session, captured token by token for training."""
    gw: Gateway = request.app.state.gw
    t0 = time.perf_counter()
    max_tokens = check(gw, req)
    p = await enter(gw, caller, req, max_tokens)
    rid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
    head = {"id": rid, "created": created, "model": gw.s.gateway_model}
    if req.stream:
        include = bool(req.stream_options and req.stream_options.include_usage)
        chunk = sse(head, "chat.completion.chunk")
        gen = chat_events(gw, p, req, chunk, t0)
        return StreamingResponse(framed(gw, p, "chat", include, chunk, gen), media_type="text/event-stream")
    kept = keep(gw, p, await outcome(gw, p), t0)
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
    outs = [ch.c for ch, _ in kept]
    body = {**head, "object": "chat.completion", "choices": choices, "usage": usage(p, outs)}
    return with_ids(body, p, outs) if req.return_token_ids else body


def with_ids(body: dict[str, Any], p: Pending, outs: list[Completion]) -> dict[str, Any]:
    for choice, c in zip(body["choices"], outs, strict=True):
        choice["token_ids"] = c.token_ids
    return {**body, "prompt_token_ids": p.prompt}


async def events(p: Pending) -> AsyncIterator[Delta | list[Choice]]:
    """A streamed call's new tokens as the engine samples them, then its choices (last)."""
    assert p.waiter.queue is not None
    while True:
        try:
            item = await asyncio.wait_for(p.waiter.queue.get(), CALL_TIMEOUT_S)
        except TimeoutError:
            raise timed_out() from None
        if isinstance(item, Delta):
            yield item
            continue
        yield answered(item)
        return


def sse(head: dict[str, Any], kind: str) -> Any:
    """One server-sent event of this call: its choices (and more, e.g. usage) in the `kind` object."""

    def chunk(choices: list[dict[str, Any]], **more: Any) -> str:
        return f"data: {json.dumps({**head, 'object': kind, 'choices': choices, **more})}\n\n"

    return chunk


async def framed(
    gw: Gateway, p: Pending, route: str, include: bool, chunk: Any, body: AsyncIterator[str | list[Completion]]
) -> AsyncIterator[str]:
    """What both routes' streams share: the body's events (it yields the completions once answered), the usage if
    asked, [DONE]; an error as an error event; a client gone before the answer takes its sequences out of the engine
    and frees its session."""
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
            with gw.lock:
                gw.give_up(p)


async def chat_events(
    gw: Gateway, p: Pending, req: ChatRequest, chunk: Any, t0: float
) -> AsyncIterator[str | list[Completion]]:
    yield chunk(
        [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None} for i in range(req.n)]
    )
    choices: list[Choice] = []
    async for item in events(p):
        if isinstance(item, Delta):
            if not p.tools:  # with tools the answer is parsed once whole: its calls, then its text
                yield chunk([{"index": item.index, "delta": {"content": item.text}, "finish_reason": None}])
        else:
            choices = item
    kept = keep(gw, p, choices, t0)
    yield [ch.c for ch in choices]
    for i, (ch, finish_reason) in enumerate(kept):
        delta: dict[str, Any] = {}
        if p.tools:
            msg = ch.message or {}
            delta = {"content": msg.get("content")}
            if msg.get("tool_calls"):
                delta["tool_calls"] = [{"index": j, **tc} for j, tc in enumerate(msg["tool_calls"])]
        lp = logprobs_of(gw, ch.c) if req.logprobs else None
        last = {"index": i, "delta": delta, "finish_reason": finish_reason, "logprobs": lp}
        ids = {"token_ids": ch.c.token_ids, "prompt_token_ids": p.prompt} if req.return_token_ids else {}
        yield chunk([{**last, **ids}])


@router.post("/v1/completions")
async def completions(request: Request, req: CompletionRequest, caller: CallAuth) -> Any:
    """OpenAI's (legacy) completions: text or token ids in; in a session, captured for training."""
    gw: Gateway = request.app.state.gw
    t0 = time.perf_counter()
    max_tokens = check(gw, req)
    p = await enter(gw, caller, req, max_tokens)
    head = {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": gw.s.gateway_model}
    if req.stream:
        include = bool(req.stream_options and req.stream_options.include_usage)
        chunk = sse(head, "text_completion")
        gen = completion_events(gw, p, req, chunk, t0)
        return StreamingResponse(framed(gw, p, "completions", include, chunk, gen), media_type="text/event-stream")
    kept = keep(gw, p, await outcome(gw, p), t0)
    gw.m.calls.labels("completions", "200").inc()
    choices = [
        {
            "index": i,
            "text": ch.c.text,
            "finish_reason": finish_reason,
            "logprobs": legacy_logprobs(gw, ch.c) if req.logprobs is not None else None,
        }
        for i, (ch, finish_reason) in enumerate(kept)
    ]
    outs = [ch.c for ch, _ in kept]
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
    choices: list[Choice] = []
    async for item in events(p):
        if isinstance(item, Delta):
            yield chunk([{"index": item.index, "text": item.text, "finish_reason": None, "logprobs": None}])
        else:
            choices = item
    kept = keep(gw, p, choices, t0)
    yield [ch.c for ch in choices]
    for i, (ch, finish_reason) in enumerate(kept):
        lp = legacy_logprobs(gw, ch.c) if req.logprobs is not None else None
        ids = {"token_ids": ch.c.token_ids, "prompt_token_ids": p.prompt} if req.return_token_ids else {}
        yield chunk([{"index": i, "text": "", "finish_reason": finish_reason, "logprobs": lp, **ids}])
