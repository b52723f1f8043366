"""A model factory module that records which processes import it (tests/schedulers/test_scheduler.py).

On import it appends this process's pid and process group, one pair per line, to the file that the
environment variable ``ACTORPIPE_IMPORT_LOG`` names (when set), so a test can show
that a cluster's head never imports a job's model module while a worker does.
"""

from __future__ import annotations

import os

from torch import nn

IMPORT_LOG_ENV = "ACTORPIPE_IMPORT_LOG"

if os.environ.get(IMPORT_LOG_ENV):
    with open(os.environ[IMPORT_LOG_ENV], "a") as log:
        log.write(f"{os.getpid()} {os.getpgid(0)}\n")


def linear_stack(layers: int = 4, dim: int = 16) -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(dim, dim) for _ in range(layers)])
