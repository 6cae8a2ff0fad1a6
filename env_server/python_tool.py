"""The `python` tool: an agent's program run in the sandbox service, its output (bounded) the tool message.

    configure(settings)            # once, at start-up: --sandbox-url and the sandbox role's token
    tools = [python_tool()]        # in an environment's tools(), in either tool format:
        hermes: {"name": "python", "arguments": {"code": "print(2 ** 100)"}}
        tags:   <python>print(2 ** 100)</python>

The program runs as the sandbox runs any program (no network, its own PID 1, limits: docs/services/sandbox.md) for at
most --python-timeout-s; the tool message is its stdout, then its stderr, cut to --python-output-chars, and a last
line when it did not end well ("[exit status 1]", "[timeout]"). A sandbox that does not answer is a tool error the
model sees, not an exception: the episode goes on.
"""

from __future__ import annotations

import httpx

from env_server.base import Tool
from env_server.settings import EnvSettings
from services.sandbox_api import RunResult
from services.settings import role_token

_client: httpx.Client | None = None
_limits: dict[str, float] = {}
_output_chars = 2000


def configure(settings: EnvSettings) -> bool:
    """Point the tool at the settings' sandbox; False when none is set (no environment may then use the tool)."""
    global _client, _output_chars
    if settings.sandbox_url is None:
        return False
    token = role_token(settings, "sandbox_token")
    headers = {"Authorization": f"Bearer {token.get_secret_value()}"} if token else {}
    timeout = settings.python_timeout_s
    _client = httpx.Client(base_url=str(settings.sandbox_url), headers=headers, timeout=timeout + 10)
    _limits.update(wall_s=timeout, cpu_s=timeout)
    _output_chars = settings.python_output_chars
    return True


def python(code: str) -> str:
    if _client is None:
        raise RuntimeError("the python tool has no sandbox: start the environment service with --sandbox-url")
    try:
        r = _client.post("/v1/run", json={"language": "python", "source": str(code), "limits": _limits})
    except httpx.HTTPError as e:
        raise RuntimeError(f"the sandbox did not answer ({type(e).__name__})") from None
    if r.status_code != 200:
        raise RuntimeError(f"the sandbox refused the program ({r.status_code}): {r.text[:200]}")
    return tool_message(RunResult.model_validate_json(r.content), _output_chars)


def tool_message(run: RunResult, limit: int) -> str:
    """stdout, then stderr, cut to `limit` characters, and how it ended when that was not well."""
    text = run.stdout + (("\n" if run.stdout and not run.stdout.endswith("\n") else "") + run.stderr)
    if len(text) > limit:
        text = text[:limit] + f"\n[output cut at {limit} characters]"
    if run.verdict == "error":
        text += f"\n[exit status {run.exit_code}]"
    elif run.verdict != "ok":
        text += f"\n[{run.verdict}]"
    return text.strip() or "[no output]"


def python_tool() -> Tool:
    """The tool, for an environment's tools()."""
    return Tool.of(
        python,
        "Runs a Python 3 program in a sandbox and returns what it prints. Use print() to see a value.",
        {"code": {"type": "string", "description": "the program"}},
    )


def available() -> bool:
    return _client is not None
