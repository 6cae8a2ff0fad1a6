"""The package layout is the architecture: services/common is the ground and imports no service and not the
mesh; a service imports only the ground (services talk through the contracts there, never through each other's
code); the orchestrator (services/mesh) may import everything. And no function grows past 80 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GROUND = "services.common"
SERVICES = {"learner": "learner", "rollout": "rollout", "reward_server": "reward_server",
            "services/buffer": "services.buffer"}  # fmt: skip
MESH = "services.mesh"
MAX_FUNCTION_LINES = 80


def imported(source: str) -> set[str]:
    """Every module an absolute import names, at the top or inside a function (lazy imports count too)."""
    out: set[str] = set()
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            out.add(n.module)
            out.update(f"{n.module}.{a.name}" for a in n.names)  # `from services import mesh`
        elif isinstance(n, ast.Import):
            out.update(a.name for a in n.names)
    return out


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def crossings(package: str, source: str) -> list[str]:
    """The imports of a module of `package` that cross a line of the architecture."""
    if package == MESH:
        return []
    forbidden = [MESH, *(p for p in SERVICES.values() if p != package)]
    return sorted(m for m in imported(source) if any(within(m, f) for f in forbidden))


def modules(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def test_the_checker_sees_a_crossing() -> None:
    assert crossings(GROUND, "def f():\n    from services.buffer.settings import X\n") == [
        "services.buffer.settings",
        "services.buffer.settings.X",
    ]
    assert crossings(GROUND, "from services import mesh\n") == ["services.mesh"]
    assert crossings("rollout", "import learner.trainer\n") == ["learner.trainer"]
    assert crossings("rollout", "from services.common.datasets import Item\nimport rollout.engine\n") == []
    assert crossings(MESH, "import learner, rollout\n") == []


@pytest.mark.parametrize("folder", ["services/common", *SERVICES])
def test_no_package_reaches_past_the_ground(folder: str) -> None:
    package = GROUND if folder == "services/common" else SERVICES[folder]
    found = {str(p.relative_to(ROOT)): c for p in modules(folder) if (c := crossings(package, p.read_text()))}
    assert found == {}, f"{package} imports outside the ground: {found}"


def long_functions(source: str) -> list[str]:
    return [f"{n.name} ({n.end_lineno - n.lineno + 1} lines)" for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
            and (n.end_lineno or n.lineno) - n.lineno + 1 > MAX_FUNCTION_LINES]  # fmt: skip


def test_no_function_over_80_lines() -> None:
    assert long_functions("def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES) == ["f (81 lines)"]
    found = {str(p.relative_to(ROOT)): f for folder in ("services", *SERVICES, "bench") for p in modules(folder)
             if (f := long_functions(p.read_text()))}  # fmt: skip
    assert found == {}
