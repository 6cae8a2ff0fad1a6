"""The package layout is the architecture, and import-linter holds its lines (contracts in pyproject.toml,
`lint-imports` in `make lint`): the orchestrator (mesh) on top, the four services (buffer, learner, rollout,
reward_server) as independent siblings, the ground (services) below, no import cycle inside a package. These
tests run the real linter on the tree, and on a copy of it with a line crossed, to show each contract bites.
Also: no function grows past 80 lines, and formatting opt-outs stay rare in production code."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("services", "buffer", "learner", "rollout", "reward_server", "env_server", "router", "mesh")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
MAX_FUNCTION_LINES = 80
MAX_FMT_SKIPS = 30


def lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    # run from the tree itself: its packages shadow the installed (editable) ones
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=tree, capture_output=True, text=True, timeout=120, check=False
    )


def test_the_tree_keeps_every_contract() -> None:
    done = lint_imports(ROOT)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "3 kept, 0 broken" in done.stdout


@pytest.mark.parametrize(
    ("module", "line", "broken"),
    [
        ("rollout/settings.py", "import learner.loss\n", "never import each other"),
        ("services/schemas.py", "import buffer.settings\n", "Layers"),
        ("services/schemas.py", "import mesh.layout\n", "Layers"),
        ("services/arrays.py", "import services.schemas\n", "No import cycle"),
    ],
)
def test_a_crossed_line_breaks_its_contract(tmp_path: Path, module: str, line: str, broken: str) -> None:
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    target = tmp_path / module
    target.write_text(target.read_text() + "\n" + line)
    done = lint_imports(tmp_path)
    assert done.returncode != 0, done.stdout[-3000:]
    assert f"{broken}" in done.stdout.split("Broken contracts")[-1]


def modules(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def long_functions(source: str) -> list[str]:
    return [
        f"{n.name} ({n.end_lineno - n.lineno + 1} lines)"
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
        and (n.end_lineno or n.lineno) - n.lineno + 1 > MAX_FUNCTION_LINES
    ]


def test_no_function_over_80_lines() -> None:
    assert long_functions("def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES) == ["f (81 lines)"]
    found = {
        str(p.relative_to(ROOT)): f
        for folder in (*PACKAGES, "bench")
        for p in modules(folder)
        if (f := long_functions(p.read_text()))
    }
    assert found == {}


def test_formatting_opt_outs_are_rare_in_production_code() -> None:
    skips = {
        str(p.relative_to(ROOT)): n
        for folder in PACKAGES
        for p in modules(folder)
        if (n := p.read_text().count("# fmt: skip") + p.read_text().count("# fmt: off"))
    }
    assert sum(skips.values()) <= MAX_FMT_SKIPS, f"{sum(skips.values())} opt-outs: {skips}"
