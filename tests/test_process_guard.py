"""The guard in tests/helpers/process_guard.py: an unmarked test that starts a process fails.

Run with: `.venv/bin/python -m pytest -q tests/test_process_guard.py`

Every case here is itself unmarked and in the quick tier: each start below is refused
before any process exists, so none is started.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from actors import LocalCluster
from tests.helpers.process_guard import _is_native_compile, expect_refusal
from transport import _native
from tests.helpers import pythonpath

pytestmark = pytest.mark.timeout(60)


def _nothing() -> None:
    pass


def _fork() -> None:
    if os.fork() == 0:  # only if the guard let it through: the child must not run the suite
        os._exit(0)


def _forkpty() -> None:
    if os.forkpty()[0] == 0:
        os._exit(0)


STARTS: dict[str, Callable[[], object]] = {
    "Popen": lambda: subprocess.Popen([sys.executable, "-c", "pass"]),
    "run": lambda: subprocess.run(["true"], check=False),
    "check_output": lambda: subprocess.check_output("true", shell=True),
    "os.popen": lambda: os.popen("true"),
    "os.system": lambda: os.system("true"),
    "os.fork": _fork,
    "os.forkpty": _forkpty,
    "os.posix_spawn": lambda: os.posix_spawn("/bin/true", ["true"], os.environ),
    "multiprocessing spawn": lambda: multiprocessing.get_context("spawn").Process(target=_nothing).start(),
    "multiprocessing fork": lambda: multiprocessing.get_context("fork").Process(target=_nothing).start(),
}


@pytest.mark.parametrize("start", STARTS)
def test_an_unmarked_test_that_starts_a_process_is_refused(start: str) -> None:
    children_before = _children()
    with expect_refusal():
        STARTS[start]()
    assert _children() == children_before


async def test_an_unmarked_test_cannot_start_a_process_from_the_event_loop() -> None:
    # The suite's loop is uvloop's, which spawns without subprocess.Popen.
    with expect_refusal():
        await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
    with expect_refusal():
        await asyncio.create_subprocess_shell("true")


async def test_an_unmarked_test_cannot_start_a_local_cluster_and_nothing_is_left() -> None:
    local = LocalCluster(nodes=1, insecure=True)
    with expect_refusal():
        async with local:
            pass
    assert local.processes == {} and local._tempdir is None


def test_only_the_native_kernels_compile_command_is_let_through() -> None:
    source = str(_native._SOURCE)
    assert _is_native_compile(["cc", "-O3", "-shared", "-fPIC", source, "-o", "/tmp/x.so", "-lm"])
    assert not _is_native_compile(["cc", source])  # not the build: no library out
    assert not _is_native_compile([sys.executable, "-c", source])
    assert not _is_native_compile(f"cc -shared {source} -o x.so")  # a shell line is not the loader's command


CONFTEST = """
pytest_plugins = ("tests.helpers.process_guard",)
"""

INNER = """
import subprocess
import pytest

@pytest.fixture(scope="module")
def cluster():
    subprocess.Popen(["true"])

def test_swallows_the_refusal():
    try:
        subprocess.run(["true"])
    except BaseException:
        pass

def test_in_a_module_fixture(cluster):
    pass

def test_starts_nothing():
    pass
"""


def test_a_refusal_fails_the_test_even_when_caught_and_names_the_mark(pytester: pytest.Pytester,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\nmarkers =\n    multiprocess: starts a process\n")
    pytester.makepyfile(test_inner=INNER)
    # No plugin the machine has installed: one ran `git rev-parse` in the inner session on a GPU machine.
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-rfE")
    result.assert_outcomes(passed=1, failed=1, errors=1)
    result.stdout.fnmatch_lines([
        "test_inner.py::test_swallows_the_refusal starts a process through subprocess.Popen ('true') but is not "
        "marked multiprocess: mark it @pytest.mark.multiprocess*",
        "FAILED test_inner.py::test_swallows_the_refusal*",
    ])
    result.stdout.fnmatch_lines([
        "E   *Failed: test_inner.py::test_in_a_module_fixture starts a process*not marked multiprocess*",
        "ERROR test_inner.py::test_in_a_module_fixture*",
    ])


PLOTS = """
def test_plots():
    import matplotlib.font_manager

    assert matplotlib.font_manager.fontManager.ttflist is not None
"""


@pytest.mark.multiprocess
def test_matplotlibs_first_font_list_is_built_before_any_test(pytester: pytest.Pytester, tmp_path: Path) -> None:
    # On a machine with no font list cached, the first test to plot failed: matplotlib ran fc-list
    # (where fontconfig is installed, as here).
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\nmarkers =\n    multiprocess: starts a process\n")
    pytester.makepyfile(test_plots=PLOTS)
    root = str(Path(__file__).resolve().parents[1])
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MPLCONFIGDIR", str(tmp_path / "no-font-cache-yet"))
        patch.setenv("PYTHONPATH", pythonpath(root))
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist", "-rfE", timeout=240)
    result.assert_outcomes(passed=1)


def _children() -> set[int]:
    tasks = f"/proc/{os.getpid()}/task"
    children: set[int] = set()
    for task in os.listdir(tasks):
        with open(f"{tasks}/{task}/children") as f:
            children.update(int(pid) for pid in f.read().split())
    return children
