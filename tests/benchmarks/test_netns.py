"""The namespace helpers of the quantized benchmark: rates, commands, signals, and a real shaped link as root."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from benchmarks import _netns

pytestmark = pytest.mark.timeout(120)

needs_netns = pytest.mark.skipif(_netns.unavailable_reason() is not None,
                                 reason=str(_netns.unavailable_reason()))


@pytest.mark.parametrize(("text", "bps"), [
    ("unlimited", None), ("100mbit", 100_000_000), ("1gbit", 1_000_000_000), ("1.5Gbit", 1_500_000_000),
    ("500kbit", 500_000), (" 10 mbit ", 10_000_000), ("64bit", 64),
])
def test_parse_rate(text: str, bps: int | None) -> None:
    assert _netns.parse_rate(text) == bps


@pytest.mark.parametrize("text", ["", "fast", "100", "100mb", "0mbit", "-5mbit", "1e3mbit"])
def test_parse_rate_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="bad link rate"):
        _netns.parse_rate(text)


@pytest.mark.parametrize("text", ["unlimited", "100mbit", "1gbit", "500kbit", "1500mbit", "64bit"])
def test_rate_label_round_trips(text: str) -> None:
    assert _netns.rate_label(_netns.parse_rate(text)) == text


@pytest.mark.parametrize(("bps", "burst"), [(100_000_000, 32 * 1024), (1_000_000_000, 250_000), (10**6, 32 * 1024)])
def test_tbf_bucket_holds_two_milliseconds_but_at_least_32_kib(bps: int, burst: int) -> None:
    assert _netns.tbf_args(bps) == ["tbf", "rate", f"{bps}bit", "burst", str(burst), "latency", "50ms"]


def test_link_names_fit_linux_limits() -> None:
    link = _netns.make_link(4194304)  # the largest pid Linux hands out
    assert (link.ns_a, link.ns_b) == ("ap-a-4194304", "ap-b-4194304")
    assert max(len(link.dev_a), len(link.dev_b)) <= 15 and link.dev_a != link.dev_b


def test_setup_makes_the_pair_inside_the_namespaces() -> None:
    link = _netns.make_link(7)
    commands = [" ".join(argv) for argv in _netns.setup_commands(link)]
    assert commands[:3] == ["ip netns add ap-a-7", "ip netns add ap-b-7",
                            "ip link add apa7 netns ap-a-7 type veth peer name apb7 netns ap-b-7"]
    assert "ip -n ap-a-7 addr add 10.213.7.1/30 dev apa7" in commands
    assert "ip -n ap-b-7 addr add 10.213.7.2/30 dev apb7" in commands
    assert {c for c in commands if c.endswith(" up")} == {
        "ip -n ap-a-7 link set lo up", "ip -n ap-b-7 link set lo up",
        "ip -n ap-a-7 link set apa7 up", "ip -n ap-b-7 link set apb7 up"}


def test_unavailable_reason_names_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "root" in str(_netns.unavailable_reason())
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(_netns.shutil, "which", lambda tool: None)
    assert "iproute2" in str(_netns.unavailable_reason())


@pytest.mark.multiprocess
def test_signals_deferred_holds_a_ctrl_c_until_the_block_ends() -> None:
    """In a fresh interpreter: in pytest's, handlers and threads earlier tests left behind (an event
    loop's signal handling, a thread the kernel hands the signal to) made it fail on a busy machine."""
    code = """
import signal, threading
from benchmarks import _netns
# Ctrl-C as a terminal's Python meets it: a child inherits an ignored SIGINT (a job a non-interactive
# shell started in the background has one), and an ignored signal is ignored again after the block.
signal.signal(signal.SIGINT, signal.default_int_handler)
finished = False
try:
    with _netns.signals_deferred():
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)  # to this thread, at once
        finished = True
except KeyboardInterrupt:
    print("raised after the block" if finished else "raised inside the block")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert done.returncode == 0 and done.stdout.strip() == "raised after the block", done.stderr[-2000:]


@pytest.mark.multiprocess
def test_stop_processes_kills_what_ignores_sigterm() -> None:
    code = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        _netns.stop_processes([proc], grace=0.5)
        assert proc.returncode == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]


@needs_netns
@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_shaped_link_runs_at_its_rate_and_leaves_nothing_behind() -> None:
    link = _netns.make_link(f"t{os.getpid()}")
    with _netns.open_link(link):
        assert _netns.namespaces_left(link) == [link.ns_a, link.ns_b]
        _netns.set_rate(link, 100_000_000)
        assert _netns.shaped_rates(link) == [100_000_000, 100_000_000]
        # A shaped link never runs faster than its rate (its bucket holds 2 ms), however idle the machine;
        # how much slower a busy machine makes it is not this test's to say.
        assert 0 < _netns.measure_throughput(link, 4 << 20) < 110e6
        _netns.set_rate(link, None)
        assert _netns.shaped_rates(link) == [None, None]
        assert _netns.measure_throughput(link, 4 << 20) > 0
        sleeper = _netns.start_process(link.ns_b, ["sleep", "60"])
        _netns.stop_processes([sleeper])
        assert sleeper.returncode == -signal.SIGTERM
    assert _netns.namespaces_left(link) == []


@needs_netns
@pytest.mark.multiprocess
def test_a_failed_setup_leaves_another_runs_namespaces_alone() -> None:
    link = _netns.make_link(f"u{os.getpid()}")
    with _netns.open_link(link):
        with pytest.raises(_netns.LinkError, match="ip netns add"):
            with _netns.open_link(link):
                pass
        assert _netns.namespaces_left(link) == [link.ns_a, link.ns_b]
    assert _netns.namespaces_left(link) == []
