"""The front door and the manual: the README stays short and its links lead somewhere; the generated reference
pages are what docs/gen_reference.py writes from the code today (`make lint` also builds the site, strict)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def test_the_readme_is_a_front_door() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move the manual into docs/"
    assert "make up" in README.read_text() and "make test" in README.read_text()  # the two commands


def test_every_relative_link_of_the_readme_exists() -> None:
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text())
    local = [link for link in links if "://" not in link]
    assert local, "the README links into the docs"
    assert [link for link in local if not (ROOT / link).exists()] == []


def test_the_generated_reference_is_current() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "gen_reference.py"), "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_your_own_environment_example_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/services/environments.md's example class, copied as it is into a package: the service loads it by name
    and runs an episode — a tool call in the hermes format answered, a wrong guess told, the right one rewarded."""
    from env_server.app import load_envs
    from services.episodes import ChatMessage

    page = (ROOT / "docs" / "services" / "environments.md").read_text()
    section = page[page.index("### Your own environment") :]
    code = section[section.index("```python") + len("```python") : section.index("```", section.index("```python") + 9)]
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "envs.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    guess = load_envs(["mypkg.envs:Guess"])["guess"]
    task = guess.check({"secret": 4})
    _, state = guess.start(task)
    call = '<tool_call>\n{"name": "parity", "arguments": {"n": 4}}\n</tool_call>'
    out = guess.step(state, ChatMessage(role="assistant", content=call), 1)
    assert [m.content for m in out.messages] == ["even"] and out.tools.valid == 1 and not out.done
    assert guess.step(state, ChatMessage(role="assistant", content="7"), 2).messages[0].content == "No."
    won = guess.step(state, ChatMessage(role="assistant", content="It is 4."), 3)
    assert won.done and won.reward == 1.0
    with pytest.raises(ValueError):
        guess.check({"secret": 11})
