"""A module whose import starts a thread (tests/actors/test_preload.py): what a node must not preload
silently, since the stages it forks would not have the thread."""

from __future__ import annotations

import threading

release = threading.Event()
worker = threading.Thread(target=release.wait, name="started-on-import", daemon=True)
worker.start()
