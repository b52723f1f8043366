"""The suite's own timeout ends a test hung in a uvloop wait (pytest-timeout's method, pyproject.toml).

Run: .venv/bin/python -m pytest -q tests/test_timeouts.py
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

HUNG = '''
import asyncio

import pytest


@pytest.mark.timeout(2)
async def test_hung() -> None:
    await asyncio.Event().wait()  # nothing will set it
'''

ON_UVLOOP = '''
def pytest_asyncio_loop_factories(config, item):
    import uvloop
    return {"uvloop": uvloop.new_event_loop}
'''


@pytest.mark.multiprocess
def test_a_test_hung_in_a_uvloop_wait_ends_at_its_timeout_with_every_threads_stack(tmp_path: Path) -> None:
    # With pytest-timeout's signal method this run waited for ever (the outer timeout below ended it).
    (tmp_path / "test_hung.py").write_text(HUNG)
    (tmp_path / "conftest.py").write_text(ON_UVLOOP)
    done = subprocess.run([sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "--rootdir",
                           str(tmp_path), "-p", "no:cacheprovider", "-q", str(tmp_path / "test_hung.py")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    said = done.stdout + done.stderr
    assert "+ Timeout +" in said and "Stack of MainThread" in said, said[-2000:]
