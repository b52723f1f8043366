"""A driver script that fails while its cluster is open exits with its traceback, and its cluster goes with it.

Found in a profiling script: a ``LocalCluster`` entered without ``async with`` (kept open by
an object of the script's own), then an exception. ``asyncio.run`` closed the driver's
runtime as it finalized its async generator, before anything closed the cluster's watch of
the head; ending the runtime's ZeroMQ context waited for the watch's sockets, whose thread
never closed them, and the script hung silently for ever, its traceback never printed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.helpers import pythonpath

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

DRIVER = """
import asyncio
from schedulers import LocalCluster

async def main():
    local = LocalCluster(nodes=1)
    await local.__aenter__()  # kept open, as an object of the script's own might keep it
    print(*local.pids, flush=True)
    raise RuntimeError("the script failed while its cluster was open")

asyncio.run(main())
"""


def test_a_script_that_fails_with_its_cluster_open_exits_with_its_traceback() -> None:
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": pythonpath(os.getcwd())})
    try:
        out, err = driver.communicate(timeout=240)  # start-up takes seconds; before the fix it never ended
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    assert driver.returncode == 1, err.decode()[-2000:]
    assert b"RuntimeError: the script failed while its cluster was open" in err
    pids = [int(pid) for pid in out.split()]  # the head's and the node's
    deadline = time.monotonic() + 120  # the node goes once it has not seen the head for HEAD_GONE_S
    while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in pids if os.path.exists(f"/proc/{pid}")], "the driver's cluster outlived it"
