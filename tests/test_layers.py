"""The house rules: which room imports which, checked on the source.

Layers point down only: ``schedulers`` -> ``stages`` -> ``actors`` -> ``transport``.
The runtime (modules directly under ``actors/``) imports no torch; the instruction set,
the mesh, the records and the job spec's sections are stdlib-only leaves that both sides import cheaply.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LEAVES = ["stages/program.py", "stages/mesh.py", "stages/records.py", "stages/sections.py", "stages/spec_checks.py",
          "stages/state/state_precision.py", "stages/state/weight_decay.py", "stages/monitor_configs.py",
          "actors/records.py", "actors/events.py", "transport/records.py"]
# What each package may never import (imports point down only).
ABOVE = {"transport": {"actors", "stages", "schedulers"}, "actors": {"stages", "schedulers"}, "stages": {"schedulers"}}


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


@pytest.mark.parametrize("leaf", LEAVES)
def test_the_shared_leaves_import_only_the_standard_library_and_each_other(leaf: str) -> None:
    roots = {name for name in _imported_modules(ROOT / leaf)}
    allowed = set(sys.stdlib_module_names) | {"__future__"}
    assert {r for r in roots if r.split(".")[0] not in allowed} <= {m[:-3].replace("/", ".") for m in LEAVES}, roots


@pytest.mark.parametrize("package", sorted(ABOVE))
def test_imports_point_down_only(package: str) -> None:
    for path in sorted((ROOT / package).rglob("*.py")):
        roots = {name.split(".")[0] for name in _imported_modules(path)}
        assert not roots & ABOVE[package], (path, roots & ABOVE[package])


def test_the_runtime_imports_no_torch() -> None:
    for path in sorted((ROOT / "actors").glob("*.py")):
        roots = {name.split(".")[0] for name in _imported_modules(path)}
        assert "torch" not in roots and "numpy" not in roots, path


def _code_strings(path: Path) -> list[str]:
    """The string constants of a module that are not docstrings."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


def test_the_runtime_names_no_module_above_it_in_code() -> None:
    # The stage package and the scheduler come in through entry points (actors/plugins.py).
    for path in sorted((ROOT / "actors").rglob("*.py")):
        assert not [s for s in _code_strings(path) if "schedulers" in s or "stages" in s], path


def test_the_upper_layers_use_only_what_actors_exports() -> None:
    import actors

    for package in ("stages", "schedulers"):
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("actors"):
                    if package == "stages":
                        continue  # the stage actor is an actor: it may use the runtime's internals
                    assert node.module == "actors", f"{path}: from {node.module} import ..."
                    assert all(alias.name in actors.__all__ for alias in node.names), path
                elif isinstance(node, ast.Import) and package == "schedulers":
                    assert not [a.name for a in node.names if a.name.startswith("actors.")], path


# The library calls endpoints through ``ref.endpoint(Cls.method)``, which a type checker
# follows; a method name in a string is a call it cannot check.
TYPED_CALLERS = ["actors", "stages", "schedulers", "examples", "benchmarks"]


def _calls_by_name(source: str) -> list[str]:
    """Each ``x.ask("m", ...)`` and ``x.tell("m", ...)`` in ``source`` (a string or f-string first argument)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("ask", "tell") and node.args):
            continue
        first = node.args[0]
        if isinstance(first, ast.JoinedStr) or (isinstance(first, ast.Constant) and isinstance(first.value, str)):
            found.append(f"{node.lineno}: .{node.func.attr}({ast.unparse(first)}, ...)")
    return found


@pytest.mark.parametrize("package", TYPED_CALLERS)
def test_no_library_code_calls_an_endpoint_by_name(package: str) -> None:
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        found += [f"{path.relative_to(ROOT)}:{call}" for call in _calls_by_name(source)]
        if '.ask("' in source or '.tell("' in source:  # in a docstring's example too: examples get copied
            found.append(f"{path.relative_to(ROOT)}: .ask(\"...\") or .tell(\"...\") in its text")
    assert not found, "call endpoints as ref.endpoint(Cls.method).call(...):\n" + "\n".join(found)


def test_the_scan_finds_calls_by_name() -> None:
    source = ('async def f(ref, m):\n    await ref.ask("nodes", timeout=1)\n    await ref.tell(f"on_{m}", 1)\n'
              '    await ref.endpoint(C.nodes).call()\n    await ref.ask(m)\n')
    assert _calls_by_name(source) == ["2: .ask('nodes', ...)", "3: .tell(f'on_{m}', ...)"]


# What a call's first step may not use before Python 3.12 when its endpoint says it needs no task.
_NEEDS_A_TASK = {"timeout", "timeout_at", "TaskGroup", "current_task"}


def _taskless_starts_needing_a_task(source: str) -> list[str]:
    """Each ``@endpoint(..., taskless_start=True)`` method of ``source`` whose own body names what needs a task."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.AsyncFunctionDef):
            continue
        marked = any(isinstance(d, ast.Call) and any(k.arg == "taskless_start" and isinstance(k.value, ast.Constant)
                                                       and k.value.value is True for k in d.keywords)
                     for d in node.decorator_list)
        names = {n.attr if isinstance(n, ast.Attribute) else n.id for n in ast.walk(node)
                 if isinstance(n, (ast.Attribute, ast.Name))}
        if marked and names & _NEEDS_A_TASK:
            found.append(f"{node.lineno}: {node.name} uses {sorted(names & _NEEDS_A_TASK)}")
    return found


@pytest.mark.parametrize("package", ["actors", "stages", "schedulers"])
def test_no_taskless_start_endpoint_uses_what_needs_a_task(package: str) -> None:
    found = [f"{path.relative_to(ROOT)}:{hit}" for path in sorted((ROOT / package).rglob("*.py"))
             for hit in _taskless_starts_needing_a_task(path.read_text(encoding="utf-8"))]
    assert not found, "an endpoint marked taskless_start runs its first step in no task of its own before " \
                      "Python 3.12 (actors/_actor.py):\n" + "\n".join(found)


def test_the_scan_finds_a_taskless_start_that_needs_a_task() -> None:
    source = ("class A:\n    @endpoint(concurrent=True, taskless_start=True)\n    async def f(self):\n"
              "        async with asyncio.timeout(1):\n            pass\n"
              "    @endpoint\n    async def g(self):\n        asyncio.current_task()\n")
    assert _taskless_starts_needing_a_task(source) == ["3: f uses ['timeout']"]


@pytest.mark.multiprocess
def test_a_driver_and_the_console_start_without_torchs_symbolic_shapes() -> None:
    """sympy and torch's symbolic shapes took a second of every driver's and console's start (a
    traced stage's module imported them at its top); only a stage that traces needs them."""
    import subprocess

    code = ("import sys, schedulers.client, schedulers.control, schedulers.console.repl\n"
            "print(sorted(m for m in ('sympy', 'torch.fx.experimental.symbolic_shapes') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
