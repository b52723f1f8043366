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


@pytest.mark.parametrize("args", [["--heartbeat-interval", "0"], ["--heartbeat-interval", "-1"],
                                  ["--heartbeat-timeout", "nan"], ["--heartbeat-timeout", "7000"],
                                  ["--head-timeout", "0"], ["--log-level", "FOO"]])
def test_a_setting_that_cannot_work_is_refused_by_the_command_line(args: list[str],
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Found by review: --heartbeat-interval 0 was taken and the head's watch spun on a whole core, and
    --log-level FOO ended in a traceback."""
    from actors import HeadActor
    from actors.node import parse_args

    with pytest.raises(SystemExit) as refused:
        parse_args(["--head", *args])
    assert refused.value.code == 2 and f"argument {args[0]}" in capsys.readouterr().err
    with pytest.raises(ValueError, match="heartbeat interval must be > 0 seconds"):
        HeadActor(heartbeat_interval=0)


def test_a_silence_no_heartbeat_can_wait_out_is_refused_where_it_is_given() -> None:
    """Found by review: --heartbeat-timeout 7000 (under two hours) started a head at which no node could join
    (libzmq refused the watch's time to live as each registered, and the head listed it alive forever), and
    Cluster.connect(head_timeout=inf) hung in the end of its context, the refused socket left open."""
    from actors import Cluster, HeadActor, LocalCluster

    with pytest.raises(ValueError, match=r"heartbeat timeout must be seconds > 0 and <= 6553"):
        HeadActor(heartbeat_timeout=7000)
    with pytest.raises(ValueError, match=r"heartbeat_timeout must be seconds > 0 and <= 6553"):
        LocalCluster(nodes=1, heartbeat_timeout=7000)
    for bad in (float("inf"), 3e6, 0):
        with pytest.raises(ValueError, match=r"head_timeout must be seconds > 0 and <= 6553"):
            Cluster.connect("tcp://127.0.0.1:1", head_timeout=bad)
    HeadActor(heartbeat_timeout=6553)


def test_rank_zero_of_a_launcher_leaves_preload_to_the_workers(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Found by review: a launcher gives every rank the same arguments, and rank 0 (the head) refused the
    workers' --preload, so the documented flag could not be used with torchrun or srun."""
    import actors.node as node

    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29611"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    served = []
    monkeypatch.setattr(node, "serve_head", lambda config: served.append(config) or _done())
    monkeypatch.setattr(node, "run", lambda coroutine: coroutine.close() or 0, raising=False)
    code = node.main(["--insecure", "--preload", "json"])
    assert "--preload json is for the other ranks" in capsys.readouterr().err
    assert code != 2 and served
    assert node.main(["--head", "--insecure", "--preload", "json"]) == 2  # asked for by hand: still refused


async def _done() -> int:
    return 0


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


@pytest.mark.parametrize(("args", "says"), [
    (["--head", "--bind", "tcp://127.0.0.1:{port}"], "error: cannot listen: Address already in use (addr='tcp://127.0.0.1:"
                                                      "{port}'); another process holds that address: give --bind"),
    (["--join", "tcp://127.0.0.1:1", "--bind", "tcp://127.0.0.1:{port}", "--isolation", "thread"],
     "error: cannot listen: Address already in use"),
    (["--head", "--bind", "tcp://0.0.0.0:0"], "error: refusing to bind 'tcp://0.0.0.0:0': it is not a loopback address; "
                                             "pass allow_remote=True (a node: --allow-remote;"),
    (["--head", "--bind", "udp://127.0.0.1:0"], "error: unsupported transport 'udp'"),
    (["--head", "--bind", "ipc://", "--limit", "micro_batchez=3"], "error: unknown limit 'micro_batchez'; limits: "),
    (["--head", "--bind", "ipc://", "--keys", "{file}"], "error: {file} is a file, not a key directory"),
    (["--join-file", "{missing}", "--head-timeout", "0.2", "--isolation", "thread"],
     "error: the head wrote no address to {missing} within 0.2s"),
], ids=["port-taken", "worker-port-taken", "not-loopback", "scheme", "limit", "keys-a-file", "no-address-file"])
def test_a_node_that_cannot_start_says_why_in_one_line(args: list[str], says: str, tmp_path: object,
                                                       capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Each ended in a traceback: the port's a ZMQError from deep in the runtime, the others a ValueError,
    a FileExistsError or a TimeoutError from where the setting was first used."""
    import socket

    from actors.node import main

    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # main sets it: put back after

    file, missing = f"{tmp_path}/a-file", f"{tmp_path}/no-such-file"
    with open(file, "w") as f:
        f.write("not keys")
    with socket.socket() as taken:  # the address another process listens at
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        fill = {"port": taken.getsockname()[1], "file": file, "missing": missing}
        argv = [arg.format(**fill) for arg in args]
        if "--keys" not in argv:  # a head makes its keys; a worker needs some (or none at all)
            argv += ["--keys", f"{tmp_path}/keys"] if "--head" in argv else ["--insecure"]
        code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith(says.format(**fill)), err
    assert "Traceback" not in err
