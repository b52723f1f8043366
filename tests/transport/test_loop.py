"""transport.loop.run: a fresh loop per call, and the process as it was afterwards."""

from __future__ import annotations

import asyncio
import signal

from transport.loop import run


def test_run_leaves_the_processs_signal_handlers_as_it_found_them() -> None:
    """A node's serve adds SIGINT and SIGTERM handlers to its loop; uvloop's loop, once closed, left
    them pointing at itself, and a process that went on (a test calling actors.node.main, a notebook)
    then ignored Ctrl-C and SIGTERM without a word."""
    signals = (signal.SIGINT, signal.SIGTERM)
    before = {sig: signal.getsignal(sig) for sig in signals}

    async def serve() -> int:
        loop = asyncio.get_running_loop()
        for sig in signals:
            loop.add_signal_handler(sig, lambda: None)
        return 7

    assert run(serve()) == 7
    assert {sig: signal.getsignal(sig) for sig in signals} == before
