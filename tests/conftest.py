"""Shared test settings: hypothesis profiles (CI runs the long one), the guard that a
test starting a process is marked ``multiprocess`` (tests/helpers/process_guard.py), and
GPUs hidden from the suite."""
from __future__ import annotations

import asyncio
import faulthandler
import os

# The suite is the CPU's: its clusters expect CPU nodes (on a GPU machine devices="auto" put
# every node on cuda:0, and data-parallel jobs were refused for sharing it). A GPU's own
# checks are `make gpu-check` (benchmarks/gpu.py); ACTORPIPE_TEST_GPUS=1 leaves them visible.
if not os.environ.get("ACTORPIPE_TEST_GPUS"):
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch  # noqa: E402 - after the GPUs are hidden
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings

pytest_plugins = ("tests.helpers.process_guard", "pytester")

torch.set_num_threads(1)

settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "ci", deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.hookimpl(trylast=True)  # after pytest's own faulthandler plugin, which points it at stderr
def pytest_configure(config: pytest.Config) -> None:
    """Where ``ACTORPIPE_FAULT_DIR`` is set (.ci/run sets it), a fatal signal in this pytest process (a
    segfault, an abort) writes every thread's stack to ``<dir>/<worker>.log``: an xdist worker that
    dies that way is otherwise reported only as "node down: Not properly terminated"."""
    folder = os.environ.get("ACTORPIPE_FAULT_DIR")
    if folder:
        log = open(os.path.join(folder, f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.log"), "w")
        config.stash[_FAULT_LOG] = log  # open for as long as the process runs
        faulthandler.enable(file=log, all_threads=True)
        os.register_at_fork(after_in_child=faulthandler.disable)  # a test's forked child is not this worker


_FAULT_LOG = pytest.StashKey[object]()


def pytest_asyncio_loop_factories(config: object, item: object) -> dict[str, object]:
    """Runs the channel suite on both loops and everything else on the runtime's own."""
    from transport.loop import new_event_loop

    factories: dict[str, object] = {"uvloop": new_event_loop}
    if getattr(item, "module", None) is not None and item.module.__name__.endswith("test_channel"):  # type: ignore[attr-defined]
        factories["asyncio"] = asyncio.new_event_loop
    return factories


# The run's order by folder. pytest-xdist's worksteal hands each of the two workers a contiguous half
# of the collected tests and lets one that runs out take half of the other's rest. Collected by name,
# the first half held every folder whose tests start processes (actors, benchmarks, examples,
# schedulers) and the second only in-process tests: for its first minutes one worker sat in actors'
# tests that wait on timeouts and silences while the other ran single-threaded unit tests, and the
# cores idled a third of the time. In this order the halves meet in transport's unit tests: actors'
# waiting tests run beside schedulers' computing ones, and the unit tests fill the gaps.
_FOLDER_ORDER = ("actors", "stages", "transport", "", "benchmarks", "examples", "schedulers")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def folder(item: pytest.Item) -> int:
        parts = item.nodeid.split("::")[0].split("/")
        name = parts[1] if len(parts) > 2 else ""
        return _FOLDER_ORDER.index(name) if name in _FOLDER_ORDER else len(_FOLDER_ORDER)

    items.sort(key=folder)  # stable: each module's tests stay together and in their order
