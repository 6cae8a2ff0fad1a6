"""An agent written with the `openai` SDK alone, trained by dapo-mesh through its OpenAI-compatible gateway.

It does what a user's own agent would: asks the gateway for a session (a task the mesh hands out, here the built-in
`calculator` environment's: "Multiply 47 by 8." with one example exchange), talks to the model with the session's
key as its API key, runs its own calculator when the model writes <calculator>47 * 8</calculator>, sends the
result back as a tool message, and ends the session when the model answers without a call, asking the mesh to
score the answer. The mesh captures every call token by token and trains on it; this script knows nothing of that.

    dapo-mesh up --config configs/agents-calculator-gateway.toml &      # the mesh, its one endpoint on :8010
    python examples/gateway_agent.py --base-url http://127.0.0.1:8010/v1 --workers 16

It opens sessions with the session-opening token (DAPO_SESSION_TOKEN, else the mesh's DAPO_AUTH_TOKEN; a local mesh
without one takes any) and does everything else with each session's own key: the credential an agent's code holds
opens its own session and nothing more. Needs only `pip install openai`. Runs until the gateway goes away (the mesh
finished) or --sessions are done.
"""

from __future__ import annotations

import argparse
import ast
import logging
import operator
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai

log = logging.getLogger("agent")
CALL = re.compile(r"<calculator>(.*?)</calculator>", re.DOTALL)
OPS: dict[type, Any] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculate(expression: str) -> str:
    """+ - * / on numbers, nothing else; an error message otherwise (the model reads it)."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError("only + - * / on numbers")

    try:
        value = ev(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e}"
    return str(int(value)) if float(value).is_integer() else f"{value:.10g}"


def episode(mesh: openai.OpenAI, base_url: str, max_turns: int, max_tokens: int) -> float:
    """One session: the task, the agent loop, the end (scored by the mesh). Its reward."""
    s: dict[str, Any] = mesh.post("/sessions", body={}, cast_to=object)  # type: ignore[arg-type]
    model = openai.OpenAI(base_url=base_url, api_key=s["api_key"], max_retries=5, timeout=300)
    messages: list[dict[str, Any]] = list(s["task"]["messages"])
    for turn in range(1, max_turns + 1):
        reply = model.chat.completions.create(model=s["model"], messages=messages, max_tokens=max_tokens)  # type: ignore[arg-type]
        text = reply.choices[0].message.content or ""
        calls = CALL.findall(text)
        if not calls:
            break
        messages.append({"role": "assistant", "content": text})
        messages += [
            {"role": "tool", "content": calculate(expr), "name": "calculator", "tool_call_id": f"call_{turn}_{i}"}
            for i, expr in enumerate(calls)
        ]
    end: dict[str, Any] = model.post(f"/sessions/{s['session_id']}/end", body={"score": True}, cast_to=object)  # type: ignore[arg-type]
    return float(end["reward"])


def worker(args: argparse.Namespace, stop: threading.Event, done: list[float]) -> None:
    token = os.environ.get("DAPO_SESSION_TOKEN") or os.environ.get("DAPO_AUTH_TOKEN") or "local"
    mesh = openai.OpenAI(base_url=args.base_url, api_key=token, max_retries=8, timeout=60)
    gone_since: float | None = None
    while not stop.is_set():
        try:
            reward = episode(mesh, args.base_url, args.max_turns, args.max_tokens)
        except openai.RateLimitError:  # no task handed out now (the mesh holds back): wait, ask again
            time.sleep(1.0)
            continue
        except openai.APIConnectionError:  # the mesh is not up yet, or has finished
            gone_since = gone_since or time.monotonic()
            if time.monotonic() - gone_since > args.patience_s:
                stop.set()
            time.sleep(2.0)
            continue
        except openai.APIStatusError as e:  # a session refused (e.g. it expired): log it, go on with the next
            log.warning("session failed: %s", e)
            continue
        gone_since = None
        done.append(reward)
        if len(done) % 50 == 0:
            recent = done[-50:]
            log.info("%d sessions, success over the last 50: %.0f%%", len(done), 100 * sum(r > 0 for r in recent) / 50)
        if args.sessions and len(done) >= args.sessions:
            stop.set()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8010/v1", help="The gateway's /v1.")
    p.add_argument("--workers", type=int, default=16, help="Sessions at once.")
    p.add_argument("--sessions", type=int, default=0, help="Stop after this many (0: until the mesh is gone).")
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=96, help="Per model turn.")
    p.add_argument("--patience-s", type=float, default=120.0, help="Give up once the gateway is gone this long.")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    stop, done = threading.Event(), []  # type: ignore[var-annotated]
    with ThreadPoolExecutor(args.workers) as pool:
        for _ in range(args.workers):
            pool.submit(worker, args, stop, done)
    log.info("%d sessions, success %.1f%%", len(done), 100 * sum(r > 0 for r in done) / max(1, len(done)))


if __name__ == "__main__":
    main()
