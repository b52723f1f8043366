"""A node's --preload (actors._processes.preloader), in one process: what its zygote runs before the
first fork. That a cluster's stages then start with the module imported is tested with a real node in
tests/schedulers/test_scheduler.py."""

from __future__ import annotations

import logging
import sys

import pytest

from actors._processes import preloader
from actors.node import main


def test_no_modules_leave_the_plugins_preload_as_it_is() -> None:
    def plugin() -> None: ...

    assert preloader(plugin, []) is plugin
    assert preloader(None, ()) is None


def test_the_plugin_runs_first_then_each_module_is_imported_and_a_failing_one_is_skipped(
        caplog: pytest.LogCaptureFixture) -> None:
    ran: list[str] = []
    sys.modules.pop("tests.helpers.import_marker", None)
    preload = preloader(lambda: ran.append("plugin"), ["no_such_module_here", "tests.helpers.import_marker"])
    assert preload is not None
    with caplog.at_level(logging.ERROR, logger="actors._processes"):
        preload()
    assert ran == ["plugin"]
    assert "tests.helpers.import_marker" in sys.modules  # the one after the failure was still imported
    assert "--preload no_such_module_here failed" in caplog.text


def test_a_module_whose_import_starts_a_thread_is_named_in_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    sys.modules.pop("tests.helpers.starts_a_thread", None)
    preload = preloader(None, ["tests.helpers.starts_a_thread"])
    assert preload is not None
    with caplog.at_level(logging.WARNING, logger="actors._processes"):
        preload()
    module = sys.modules["tests.helpers.starts_a_thread"]
    module.release.set()
    module.worker.join(10)
    assert "--preload tests.helpers.starts_a_thread started a thread in the zygote" in caplog.text


def test_a_quiet_module_is_not_warned_of(caplog: pytest.LogCaptureFixture) -> None:
    preload = preloader(None, ["json"])
    assert preload is not None
    with caplog.at_level(logging.WARNING, logger="actors._processes"):
        preload()
    assert "started a thread" not in caplog.text


def test_the_head_refuses_preload(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--head", "--preload", "transformers.modeling_utils", "--insecure"]) == 2
    assert "--preload is for workers: the head never imports user code" in capsys.readouterr().err
