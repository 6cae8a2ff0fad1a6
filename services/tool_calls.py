"""Tool calls written in a model's text. The `hermes` format (Hermes, Qwen2.5/3 and many chat templates):

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "417 * 38"}}
    </tool_call>

`parse_calls(text)` finds every call; a block that is not such a JSON object (or is never closed) is reported
as malformed with the reason, never raised. `instructions(tools)` is the paragraph an environment puts in its
system prompt for a model whose chat template has no tool support of its own (SmolLM2's has none). The `tags`
format, for tools of one string argument, is `<calculator>417 * 38</calculator>` (`parse_tag_calls`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from services.episodes import CalledFunction, ToolCall, ToolSpec

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)


@dataclass
class ParsedCalls:
    calls: list[ToolCall] = field(default_factory=list)
    malformed: list[str] = field(default_factory=list)  # why each unreadable block was refused

    @property
    def any(self) -> bool:
        return bool(self.calls or self.malformed)


def parse_calls(text: str, prefix: str = "call") -> ParsedCalls:
    """Every <tool_call> block of `text`, in order; call ids are `{prefix}_{i}`."""
    out = ParsedCalls()
    for i, m in enumerate(_BLOCK.finditer(text)):
        if not m.group(0).endswith(CLOSE):
            out.malformed.append(f"a {OPEN} is never closed with {CLOSE}")
            continue
        try:
            obj: Any = json.loads(m.group(1).strip())
        except json.JSONDecodeError as e:
            out.malformed.append(f"not JSON ({e.msg} at character {e.pos})")
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            out.malformed.append('not an object with a "name" string')
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string, as OpenAI's API does
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            out.malformed.append(f'"arguments" of {obj["name"][:64]!r} is not an object')
            continue
        name = obj["name"][:256]
        out.calls.append(ToolCall(id=f"{prefix}_{i}", function=CalledFunction(name=name, arguments=json.dumps(args))))
    return out


def without_calls(text: str) -> str:
    """The text around its <tool_call> blocks (an unclosed one runs to the end, as `parse_calls` reads it)."""
    return _BLOCK.sub("", text).strip()


def parse_tag_calls(text: str, tools: dict[str, str], prefix: str = "call") -> ParsedCalls:
    """The `tags` format, for tools of one string argument: `<calculator>12 * 34</calculator>` calls `calculator`
    with that text as its argument (`tools`: name -> the argument's name). Simpler for a small model than JSON, as
    Search-R1's <search>...</search>; a tag that names no tool is text, an opened tool tag never closed is
    malformed."""
    out = ParsedCalls()
    if not tools:
        return out
    names = "|".join(re.escape(n) for n in sorted(tools, key=len, reverse=True))
    for i, m in enumerate(re.finditer(rf"<({names})>(.*?)(?:</\1>|$)", text, re.DOTALL)):
        name = m.group(1)
        if not m.group(0).endswith(f"</{name}>"):
            out.malformed.append(f"a <{name}> is never closed with </{name}>")
            continue
        args = {tools[name]: m.group(2).strip()}
        out.calls.append(ToolCall(id=f"{prefix}_{i}", function=CalledFunction(name=name, arguments=json.dumps(args))))
    return out


def render_tag_call(name: str, argument: str) -> str:
    return f"<{name}>{argument}</{name}>"


def render_call(name: str, arguments: dict[str, Any]) -> str:
    """How a model writes one call (the examples in `instructions`, and tests)."""
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CLOSE}"


def instructions(tools: list[ToolSpec]) -> str:
    """The system-prompt paragraph that teaches the format and lists the tools."""
    lines = [
        "You can call tools. To call one, write exactly:",
        render_call("tool_name", {"argument": "value"}),
        "Then stop and wait: the result comes back in the next message. Tools:",
    ]
    for t in tools:
        params = t.function.parameters.get("properties", {})
        sig = ", ".join(f"{k}: {v.get('type', 'any')}" for k, v in params.items())
        lines.append(f"- {t.function.name}({sig}): {t.function.description}")
    return "\n".join(lines)
