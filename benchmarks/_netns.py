# Run: python -m benchmarks._netns sink ADDRESS                  (started by the benchmarks, inside a namespace)
#      python -m benchmarks._netns source ADDRESS PORT NUM_BYTES
"""Two network namespaces joined by a rate-limited veth pair, for benchmarks that need a slow link.

``open_link(make_link(os.getpid()))`` creates namespaces ``ap-a-PID`` and ``ap-b-PID``
with one veth end in each (``10.213.7.1/30`` and ``10.213.7.2/30``: addresses that exist
only inside these namespaces) and deletes both on exit, whatever happened. ``set_rate``
shapes both veth ends with a token bucket (egress shaping works per direction, so both
ends are shaped); ``measure_throughput`` times a plain TCP transfer across the link.
Everything here shells out to iproute2 (``ip``, ``tc``) and needs root.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

__all__ = [
    "Link", "LinkError", "make_link", "open_link", "set_rate", "shaped_rates", "parse_rate", "rate_label", "tbf_args",
    "netns_exec", "namespaces_left", "signals_deferred", "unavailable_reason", "measure_throughput",
    "qdisc_drops", "setup_commands", "start_process", "stop_processes",
]

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
_CHUNK = 1 << 20


class LinkError(RuntimeError):
    """Setting up, shaping or measuring the link failed; the message has the command and its error."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Link:
    """Names and addresses of the two namespaces and the veth pair between them."""

    ns_a: str
    ns_b: str
    dev_a: str
    dev_b: str
    addr_a: str
    addr_b: str
    prefix_len: int = 30


def make_link(tag: int | str, *, subnet: str = "10.213.7") -> Link:
    """A link named after ``tag`` (e.g. the pid); interface names stay within Linux's 15 characters."""
    return Link(ns_a=f"ap-a-{tag}", ns_b=f"ap-b-{tag}", dev_a=f"apa{tag}"[:15], dev_b=f"apb{tag}"[:15],
                addr_a=f"{subnet}.1", addr_b=f"{subnet}.2")


def parse_rate(text: str) -> int | None:
    """``"100mbit"`` -> 100_000_000 bits/s; ``"unlimited"`` -> None (the bare veth).

    Raises:
        ValueError: not a positive number with a unit of bit, kbit, mbit or gbit.
    """
    cleaned = text.strip().lower()
    if cleaned in ("unlimited", "none", "inf"):
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit)", cleaned)
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(f"bad link rate {text!r}: use e.g. 100mbit, 1gbit, 500kbit or unlimited")
    return round(float(match.group(1)) * _UNITS[match.group(2)])


def rate_label(rate_bps: int | None) -> str:
    """The short name of a rate, usable in JSON keys: ``1gbit``, ``100mbit``, ``unlimited``."""
    if rate_bps is None:
        return "unlimited"
    for unit in ("gbit", "mbit", "kbit"):
        if rate_bps % _UNITS[unit] == 0:
            return f"{rate_bps // _UNITS[unit]}{unit}"
    return f"{rate_bps}bit"


def tbf_args(rate_bps: int) -> list[str]:
    """``tc ... tbf`` parameters for ``rate_bps``.

    The bucket holds 2 ms at the rate (at least 32 KiB, so a full-size segment always
    fits): a larger bucket lets whole micro-batches pass at veth speed after an idle
    moment and the link would look faster than its rate. The queue holds 50 ms.
    """
    burst = max(32 * 1024, rate_bps // 8 * 2 // 1000)
    return ["tbf", "rate", f"{rate_bps}bit", "burst", str(burst), "latency", "50ms"]


def netns_exec(namespace: str, argv: Sequence[str]) -> list[str]:
    """``argv`` run inside ``namespace`` (``ip netns exec`` execs it: the pid is the command's)."""
    return ["ip", "netns", "exec", namespace, *argv]


def setup_commands(link: Link) -> list[list[str]]:
    """The iproute2 commands that create ``link``, in order."""
    a, b = link.ns_a, link.ns_b
    return [
        ["ip", "netns", "add", a],
        ["ip", "netns", "add", b],
        ["ip", "link", "add", link.dev_a, "netns", a, "type", "veth", "peer", "name", link.dev_b, "netns", b],
        ["ip", "-n", a, "addr", "add", f"{link.addr_a}/{link.prefix_len}", "dev", link.dev_a],
        ["ip", "-n", b, "addr", "add", f"{link.addr_b}/{link.prefix_len}", "dev", link.dev_b],
        ["ip", "-n", a, "link", "set", "lo", "up"],
        ["ip", "-n", b, "link", "set", "lo", "up"],
        ["ip", "-n", a, "link", "set", link.dev_a, "up"],
        ["ip", "-n", b, "link", "set", link.dev_b, "up"],
    ]


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here (not root, no iproute2), or None if they may be."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return "network namespaces and tc need root (run as root, or with CAP_NET_ADMIN and CAP_SYS_ADMIN)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"iproute2 is not installed ({' and '.join(missing)} not found on PATH)"
    return None


def _run(argv: Sequence[str], *, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Runs one command; raises LinkError with its stderr when ``check`` and it fails."""
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise LinkError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def namespaces_left(link: Link) -> list[str]:
    """Which of the link's namespaces still exist."""
    listed = _run(["ip", "netns", "list"], check=False).stdout
    names = {line.split()[0] for line in listed.splitlines() if line.strip()}
    return [ns for ns in (link.ns_a, link.ns_b) if ns in names]


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Holds SIGINT and SIGTERM back for the block, so a second Ctrl-C cannot cut a clean-up short.

    The first signal that arrives meanwhile is raised again when the block ends, under
    the handler it would have met. Python runs signal handlers in the main thread only,
    so elsewhere this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = {sig: signal.signal(sig, lambda sig, _frame: pending.append(sig))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)  # None: set outside Python
        if pending:
            signal.raise_signal(pending[0])


@contextlib.contextmanager
def open_link(link: Link) -> Iterator[Link]:
    """Creates ``link`` for the life of the block and deletes it after, whatever happened.

    Stop every process started inside the namespaces before the block ends: a
    namespace lives on while a process holds it.

    Raises:
        LinkError: a set-up command failed (what was made is deleted again).
        RuntimeError: a namespace could not be deleted afterwards.
    """
    created: list[str] = []  # only these are deleted: a namespace of that name made by another run stays
    try:
        with signals_deferred():  # a Ctrl-C between making a namespace and noting it would leak it
            for argv in setup_commands(link):
                _run(argv)
                if argv[:3] == ["ip", "netns", "add"]:
                    created.append(argv[3])
        yield link
    finally:
        with signals_deferred():
            for namespace in created:
                _run(["ip", "netns", "del", namespace], check=False)
            left = [ns for ns in namespaces_left(link) if ns in created]
        if left:
            raise RuntimeError(f"could not delete namespaces {left}; remove them with: ip netns del NAME")


def set_rate(link: Link, rate_bps: int | None) -> None:
    """Shapes both veth ends to ``rate_bps`` (None: removes the shaping)."""
    for ns, dev in ((link.ns_a, link.dev_a), (link.ns_b, link.dev_b)):
        if rate_bps is None:
            _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)  # fails if none: fine
        else:
            _run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *tbf_args(rate_bps)])


def shaped_rates(link: Link) -> list[int | None]:
    """The rate each end's root qdisc shapes to, in bits per second (None: not shaped), as tc reports it."""
    rates: list[int | None] = []
    for ns, dev in ((link.ns_a, link.dev_a), (link.ns_b, link.dev_b)):
        shown = _run(["tc", "-n", ns, "-j", "qdisc", "show", "dev", dev], check=False).stdout
        root = [q for q in json.loads(shown or "[]") if q.get("root") and q.get("kind") == "tbf"]
        rates.append(int(root[0]["options"]["rate"]) * 8 if root else None)  # tc's JSON gives bytes a second
    return rates


def qdisc_drops(link: Link) -> int:
    """Packets the shaping qdiscs of both ends dropped so far (0 without shaping)."""
    total = 0
    for ns, dev in ((link.ns_a, link.dev_a), (link.ns_b, link.dev_b)):
        shown = _run(["tc", "-n", ns, "-s", "-j", "qdisc", "show", "dev", dev], check=False).stdout
        with contextlib.suppress(ValueError):
            total += sum(int(q.get("drops", 0)) for q in json.loads(shown or "[]") if q.get("root"))
    return total


# --- processes inside the namespaces ---------------------------------------------


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: the child gets SIGTERM if this process dies, so no child outlives the benchmark."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def start_process(
    namespace: str, argv: Sequence[str], *, log_path: str | None = None, stdout: int | None = subprocess.DEVNULL,
) -> subprocess.Popen[bytes]:
    """Starts ``argv`` inside ``namespace``, in the repository root, in its own session.

    Its own session: a terminal's Ctrl-C reaches the benchmark only, which then stops
    its children in order. stderr goes to ``log_path`` when given.
    """
    log = open(log_path, "ab") if log_path else None  # noqa: SIM115 - the child owns it from here
    try:
        return subprocess.Popen(netns_exec(namespace, argv), cwd=REPO_ROOT, stdin=subprocess.DEVNULL,
                                stdout=stdout, stderr=log, start_new_session=True,
                                preexec_fn=_die_with_parent)
    finally:
        if log is not None:
            log.close()


def stop_processes(processes: Sequence[subprocess.Popen[bytes]], *, grace: float = 5.0) -> None:
    """SIGTERM to each live process, then SIGKILL to those still alive after ``grace`` seconds."""
    for proc in processes:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in processes:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def measure_throughput(link: Link, num_bytes: int, *, timeout: float = 60.0) -> float:
    """Bits per second of one TCP transfer of ``num_bytes`` from namespace A to B.

    The clock runs from connecting until the receiver confirms it has every byte.

    Raises:
        LinkError: the transfer failed or took longer than ``timeout``.
    """
    python = [sys.executable, "-m", "benchmarks._netns"]
    sink = start_process(link.ns_b, [*python, "sink", link.addr_b], stdout=subprocess.PIPE)
    try:
        assert sink.stdout is not None
        port = sink.stdout.readline().decode().strip()
        if not port.isdigit():
            raise LinkError(f"the receiver in {link.ns_b} did not start (exit code {sink.poll()})")
        source = subprocess.run(netns_exec(link.ns_a, [*python, "source", link.addr_b, port, str(num_bytes)]),
                                cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
        if source.returncode != 0:
            raise LinkError(f"the transfer across {link.dev_a} failed: {source.stderr.strip()[-500:]}")
        seconds = float(json.loads(source.stdout.strip().splitlines()[-1])["seconds"])
        return num_bytes * 8 / seconds
    except subprocess.TimeoutExpired as exc:
        raise LinkError(f"the transfer of {num_bytes} bytes took over {timeout}s") from exc
    finally:
        with signals_deferred():
            stop_processes([sink], grace=2.0)
        if sink.stdout is not None:
            sink.stdout.close()


def _sink(address: str) -> None:
    """Accepts one connection, reads to its end, answers the byte count (8 bytes, big-endian)."""
    with socket.create_server((address, 0)) as server:
        print(server.getsockname()[1], flush=True)
        connection, _ = server.accept()
        with connection:
            buffer, total = bytearray(_CHUNK), 0
            while received := connection.recv_into(buffer):
                total += received
            connection.sendall(total.to_bytes(8, "big"))


def _source(address: str, port: int, num_bytes: int) -> None:
    """Sends ``num_bytes`` to the sink and prints the seconds until it confirmed them, as JSON."""
    chunk = memoryview(bytes(_CHUNK))
    start = time.perf_counter()
    with socket.create_connection((address, port), timeout=60) as connection:
        left = num_bytes
        while left:
            connection.sendall(chunk[: min(left, _CHUNK)])
            left -= min(left, _CHUNK)
        connection.shutdown(socket.SHUT_WR)
        confirmed = int.from_bytes(connection.recv(8), "big")
    seconds = time.perf_counter() - start
    if confirmed != num_bytes:
        raise SystemExit(f"the sink received {confirmed} of {num_bytes} bytes")
    print(json.dumps({"bytes": num_bytes, "seconds": seconds}), flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "sink":
        _sink(sys.argv[2])
    elif len(sys.argv) == 5 and sys.argv[1] == "source":
        _source(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        sys.exit(__doc__.splitlines()[0] + "\nusage: python -m benchmarks._netns sink ADDRESS | "
                 "source ADDRESS PORT NUM_BYTES")
