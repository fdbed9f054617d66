"""The layers import downward only: the kit knows nothing above it, the controller no flows.

Checked twice: statically, by reading every import statement (and every
``importlib.import_module`` string) of each source file with ``ast``; and
dynamically, by importing every module of a layer in a fresh interpreter and
looking at ``sys.modules``.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

FORBIDDEN = {
    "sched_core": {"flows", "sched_node", "ops", "scripts", "controller", "sched_cli", "sched_ops"},
    "controller": {"flows", "sched_node", "ops", "scripts", "sched_cli", "sched_ops"},
    # The operator's commands are a client: HTTP to the controller, Prefect's client.
    "sched_ops": {"flows", "sched_node", "ops", "scripts", "controller", "sched_cli"},
    # The node and the flows are the agent: neither reaches the center's code.
    "sched_node": {"ops", "scripts", "controller", "sched_cli", "sched_ops"},
    "flows": {"ops", "scripts", "controller", "sched_cli", "sched_ops"},
}


def _modules(package: str) -> list[str]:
    """Return the dotted names of every module of package (its __init__ included)."""
    names = []
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if "migrations" in parts:  # alembic's scripts, loaded by alembic, not imported
            continue
        if parts[-1] == "__main__":  # ``python -m package``: importing it runs the program
            continue
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def imported_names(source: str) -> set[str]:
    """Return the top-level package of every module source imports, statically."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
            in ("import_module", "__import__")
        ):
            # A module named in a string, loaded at run time: invisible to import tools.
            for arg in ast.walk(node):
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    found.add(arg.value.split(".")[0])
    return found


def test_the_static_check_sees_each_kind_of_import() -> None:
    source = (
        "import controller.api\nfrom flows import agent\nimport importlib\n"
        "importlib.import_module('ops.serve')\nfrom . import sibling\n"
    )
    assert imported_names(source) >= {"controller", "flows", "ops"}
    assert "sibling" not in imported_names(source)


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_no_source_file_of_a_layer_imports_a_layer_above(layer: str) -> None:
    offenders = {}
    for path in sorted((ROOT / layer).rglob("*.py")):
        above = imported_names(path.read_text("utf-8")) & FORBIDDEN[layer]
        if above:
            offenders[str(path.relative_to(ROOT))] = sorted(above)
    assert offenders == {}


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_importing_every_module_of_a_layer_loads_nothing_above(layer: str) -> None:
    modules = _modules(layer)
    assert len(modules) > 3
    code = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = set(json.loads(done.stdout.strip().splitlines()[-1]))
    assert layer in loaded
    assert loaded & FORBIDDEN[layer] == set()


def test_the_sched_command_is_composed_at_the_top() -> None:
    import sched_cli
    from sched_core import cli as kit_cli

    names = {group.name for group in sched_cli.app.registered_groups}
    assert "controller" in names
    assert sched_cli.app is kit_cli.app
    pyproject = (ROOT / "pyproject.toml").read_text("utf-8")
    assert 'sched = "sched_cli:app"' in pyproject
    assert '"sched_cli.py"' in pyproject  # shipped in the wheel
