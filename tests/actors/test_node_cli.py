"""The node command line: --help, and a clean stop on SIGTERM and SIGINT."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


@pytest.mark.multiprocess
def test_sigterm_and_sigint_stop_a_node_cleanly(tmp_path: object) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        address_file = f"{tmp_path}/addr-{sig}"
        proc = subprocess.Popen(
            [sys.executable, "-m", "actors.node", "--head", "--bind", "ipc://", "--address-file", address_file,
             "--keys", f"{tmp_path}/keys"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        try:
            line = proc.stdout.readline()  # type: ignore[union-attr]
            assert line.startswith("actorpipe head listening at ipc://")
            socket_path = line.split("ipc://")[1].strip().partition("|")[0]  # the address carries the head's key
            assert os.path.exists(socket_path)
            proc.send_signal(sig)
            assert proc.wait(timeout=20) == 0
            assert not os.path.exists(socket_path)
            assert "[head] INFO actors._serve: head stopping" in proc.stderr.read()  # type: ignore[union-attr]
        finally:
            proc.kill()
            proc.wait()


@pytest.mark.multiprocess
def test_help_documents_every_flag() -> None:
    out = subprocess.run([sys.executable, "-m", "actors.node", "--help"], capture_output=True, text=True, check=True)
    for flag in ("--head", "--join", "--bind", "--name", "--device", "--allow", "--allow-remote",
                 "--heartbeat-interval", "--heartbeat-timeout", "--head-timeout", "--address-file", "--log-level",
                 "--keys", "--identity", "--insecure", "--max-message-bytes", "--checkpoint-root", "--preload"):
        assert flag in out.stdout


def test_the_node_command_line_takes_the_message_limit() -> None:
    from actors.node import parse_args

    assert parse_args(["--head", "--max-message-bytes", "2048"]).max_message_bytes == 2048
    assert parse_args(["--join", "tcp://127.0.0.1:1"]).max_message_bytes == 1 << 30
    with pytest.raises(SystemExit):
        parse_args(["--head", "--max-message-bytes", "0"])


def test_the_heads_checkpoint_root_defaults_to_checkpoints_in_its_working_directory() -> None:
    from actors.node import parse_args

    assert parse_args(["--head"]).checkpoint_root == "checkpoints"  # made absolute from the head's directory
    assert parse_args(["--head", "--checkpoint-root", "/srv/ckpt"]).checkpoint_root == "/srv/ckpt"


def test_encryption_is_on_unless_turned_off_explicitly_and_off_is_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from actors._serve import ENCRYPTION_ENV, bulk_mode
    from actors.node import parse_args

    monkeypatch.delenv(ENCRYPTION_ENV, raising=False)
    assert bulk_mode() == "encrypt" and not caplog.records
    assert parse_args(["--head", "--no-encryption"]).no_encryption and not parse_args(["--head"]).no_encryption
    monkeypatch.setenv(ENCRYPTION_ENV, "off")
    with caplog.at_level(logging.WARNING):
        assert bulk_mode() == "authenticate"
    assert "CLEAR" in caplog.text
    monkeypatch.setenv(ENCRYPTION_ENV, "maybe")
    with pytest.raises(ValueError, match="on \\(the default\\) or off"):
        bulk_mode()


@pytest.mark.multiprocess
@pytest.mark.parametrize(("join", "code", "says"), [
    (f"tcp://127.0.0.1:{{port}}|{'ab' * 32}", 2, "error: the head at tcp://127.0.0.1:{port} is secure (its address "
                                                 "carries its public key), and this process has no keys: start this "
                                                 "node with --keys"),
    ("tcp://127.0.0.1:{port}", 1, "error: the head at tcp://127.0.0.1:{port} did not answer this node within 2s: "
                                  "nothing listens there: tcp://127.0.0.1:{port} refused the connection"),
])
def test_a_worker_that_cannot_reach_its_head_says_why_in_one_line(join: str, code: int, says: str) -> None:
    """Both ended in a traceback, the second after "no reply from head.register ... within 1.0s"."""
    import socket

    with socket.socket() as probe:  # a port nothing listens at once this closes
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    done = subprocess.run([sys.executable, "-m", "actors.node", "--join", join.format(port=port), "--insecure",
                           "--name", "w", "--head-timeout", "2"], capture_output=True, text=True, timeout=100)
    assert done.returncode == code, done.stderr
    assert says.format(port=port) in done.stderr and "Traceback" not in done.stderr
