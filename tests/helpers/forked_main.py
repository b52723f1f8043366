"""A program for the fork server's tests (tests/actors/test_forkserver.py): says where and how it runs.

``main([OUT, WHAT, ...])`` writes its working directory, one environment variable, its
arguments, its session, its temporary directory and what its stdin holds to the JSON file OUT, a line to stderr,
then ``exit CODE`` returns CODE and ``sleep`` waits until it is killed.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time


def main(argv: list[str]) -> int:
    out, what, *rest = argv
    with open(out + ".tmp", "w") as f:
        json.dump({"cwd": os.getcwd(), "value": os.environ.get("FORKED_TEST_VALUE"), "argv": sys.argv[1:],
                   "pid": os.getpid(), "sid": os.getsid(0),
                   "tmp": tempfile.gettempdir(), "stdin": os.read(0, 16).decode()}, f)
    os.replace(out + ".tmp", out)
    print(f"forked_main says {what}", file=sys.stderr, flush=True)
    if what == "sleep":
        time.sleep(3600)
    return int(rest[0]) if what == "exit" else 0
