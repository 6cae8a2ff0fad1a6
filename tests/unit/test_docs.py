"""The front door and the manual: the README stays short and its links lead somewhere; the generated reference
pages are what docs/gen_reference.py writes from the code today (`make lint` also builds the site, strict)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

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
