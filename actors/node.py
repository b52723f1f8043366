# Run: python -m actors.node --head --bind tcp://127.0.0.1:5555
#      python -m actors.node --join tcp://127.0.0.1:5555 --name worker0 [--device cpu]
#      torchrun --nproc-per-node 4 -m actors.node --keys DIR    (or under srun, or an Indexed Job)
"""A node process: the head (membership, later the scheduler) or a worker that hosts actors.

With neither ``--head`` nor ``--join``, the launcher it runs under says which (rank 0 is the
head, see :mod:`actors.launchers`)."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import sys

import zmq

from actors import launchers
from actors._liveness import check_silence
from actors._registry import DEFAULT_ALLOW
from actors.devices import device_argument, rank_device, visible_gpu_count
from actors.keys import DEFAULT_KEYS, KeyFileError
from actors._reach import HeadUnreachable, SecurityMismatch
from actors.plugins import head_modules
from actors._serve import ENCRYPTION_ENV, HeadConfig, WorkerConfig, serve_head, serve_worker
from transport.addresses import is_loopback
from transport.loop import run
from transport.wire import DEFAULT_MAX_MESSAGE_BYTES

import actors.probe  # noqa: F401  (registers the built-in actor classes)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m actors.node", description=__doc__)
    role = parser.add_mutually_exclusive_group()
    role.add_argument("--head", action="store_true", help="start the head node")
    role.add_argument("--join", metavar="ADDRESS", help="start a worker that joins the head at ADDRESS")
    role.add_argument("--join-file", metavar="PATH",
                      help="start a worker that joins the head whose address appears in PATH (the head's "
                      "--address-file): it may start before the head, and waits up to --head-timeout")
    parser.add_argument("--bind", help="address to listen on (head default tcp://127.0.0.1:5555, "
                        "worker default tcp://127.0.0.1:0, i.e. any free port)")
    parser.add_argument("--name", help="worker name (default: HOSTNAME-PID)")
    parser.add_argument("--device", default="cpu", type=device_argument, help="torch device this worker computes on: "
                        "cpu or cuda:K (a GPU this process sees; the worker pins itself to it), or auto: this rank's "
                        "GPU under a launcher (cuda:LOCAL_RANK under torchrun, cuda:SLURM_LOCALID under srun), cuda:0 "
                        "alone on a machine, cpu where no GPU is visible")
    parser.add_argument("--allow", action="append", default=[], metavar="PREFIX",
                        help="admit factories under this module prefix (repeatable); "
                        f"always admitted: {', '.join(DEFAULT_ALLOW)} (a LocalCluster also admits the examples' factories)")
    parser.add_argument("--allow-remote", action="store_true",
                        help="permit binding an address that is not loopback")
    parser.add_argument("--keys", metavar="DIR", default=os.environ.get("ACTORPIPE_KEYS", DEFAULT_KEYS),
                        help="the cluster's key directory (mode 0700); the head makes it on first start, workers "
                        "and consoles on other machines need a copy (default: $ACTORPIPE_KEYS or %(default)s)")
    parser.add_argument("--identity", metavar="NAME",
                        help="which keypair in --keys this process uses (default: head, or node for a worker)")
    parser.add_argument("--insecure", action="store_true",
                        help="no keys: plaintext, and every peer that reaches the address is trusted "
                        "(still loopback-only without --allow-remote)")
    parser.add_argument("--no-encryption", action="store_true",
                        help="with keys: messages between members travel authenticated (AES-GCM tags) but in the "
                        "clear, for a trusted network where encryption's cost matters; sets $ACTORPIPE_ENCRYPTION=off "
                        "for this process and those it starts (CURVE still admits only the cluster's keys)")
    parser.add_argument("--isolation", choices=("process", "thread"), default="process",
                        help="worker: 'process' hosts each actor the head asks for (each job's stage) in a process "
                        "of its own, forked from one made at start-up, so that a job's code that exits, crashes or "
                        "hangs stays in its job; 'thread' hosts them in this process (default: %(default)s)")
    parser.add_argument("--preload", action="append", default=[], metavar="MODULE",
                        help="worker: import MODULE once, before the first job's stage starts, so that every stage "
                        "process starts with it imported (repeatable; e.g. transformers.modeling_utils saves each "
                        "Hugging Face stage about a second); a module whose import starts a thread is warned of")
    parser.add_argument("--heartbeat-interval", type=_positive_seconds, default=0.5,
                        help="seconds between heartbeats (head)")
    parser.add_argument("--heartbeat-timeout", type=_silence, default=10.0,
                        help="seconds a node that is alive but answers nothing (stopped, frozen, cut off) stays a "
                             "member; a node whose process ends is lost at once, its connection closed (head)")
    parser.add_argument("--head-timeout", type=_positive_seconds, default=30.0,
                        help="seconds a worker keeps trying an unreachable head before it stops")
    parser.add_argument("--address-file", help="head: write the bound address to this file once listening")
    parser.add_argument("--plugin", action="append", default=None, metavar="MODULE",
                        help="head: import MODULE at start-up to register the actors it hosts "
                        "(repeatable; default: the installed 'head' plugin, the scheduler actor)")
    parser.add_argument("--checkpoint-root", metavar="DIR", default="checkpoints",
                        help="head: the directory clients' checkpoints go under, each client key in its own "
                        "subtree (DIR/NAME); the admin key may save anywhere (default: ./%(default)s)")
    parser.add_argument("--max-message-bytes", type=_positive_int, default=DEFAULT_MAX_MESSAGE_BYTES, metavar="N",
                        help="the largest message this process sends or takes, in bytes (default %(default)s = 1 GiB); "
                        "give the head, every worker and the driver the same value")
    parser.add_argument("--limit", action="append", default=[], metavar="NAME=VALUE",
                        help="head: a limit on what a job or a client may ask (repeatable; e.g. micro_batches=1024, "
                        "jobs_per_client=2, parameters=1e9; 'none' lifts one); see docs/security.md")
    parser.add_argument("--log-level", type=_log_level, default=os.environ.get("ACTORPIPE_LOG", "INFO"),
                        help="logging level: DEBUG, INFO, WARNING, ERROR or CRITICAL ($ACTORPIPE_LOG)")
    return parser.parse_args(argv)


def _from_launcher(args: argparse.Namespace) -> None:
    """Fills the role, the head's address and where to listen from the launcher's variables, when no
    flag gave the role; the flags given win over what the launcher says.

    Raises:
        ValueError: no role flag and no launcher, or a launched cluster across machines without keys.
    """
    if args.head or args.join or args.join_file:
        return
    role = launchers.from_environment()
    if role is None:
        raise ValueError("give --head, --join ADDRESS or --join-file PATH, or start this under torchrun, srun or a "
                         "Kubernetes Indexed Job, whose variables name the head (see docs/machines.md)")
    host = launchers.own_host(role.head_host, role.port)
    args.allow_remote = args.allow_remote or not role.loopback
    if not role.loopback and not args.insecure and not os.path.isdir(args.keys):
        raise ValueError(f"{role.launcher} rank {role.rank}: no key directory at {args.keys}; make one with "
                         "'python -m actors.keys init DIR' and hand it to every rank (a shared folder, a "
                         "Kubernetes Secret), then pass --keys DIR or set ACTORPIPE_KEYS")
    if role.is_head:
        args.head = True
        if not args.bind and not role.loopback and is_loopback(host):
            # The head's name is loopback here (/etc/hosts maps this host's name to 127.0.1.1) and the
            # other machines resolve it to this one's network address: listen on both, on every address
            # (the head names itself by its default route's, transport.addresses.advertised).
            host = "[::]" if ":" in host else "0.0.0.0"
        args.bind = args.bind or f"tcp://{host}:{role.port}"
    else:
        args.join = role.head_address
        args.bind = args.bind or f"tcp://{host}:0"
        args.name = args.name or f"rank{role.rank}"
        args.exit_with_head = True  # the launcher's job ends when rank 0's script (and the head) does


def _resolve_device(args: argparse.Namespace) -> None:
    """``--device auto`` as this rank's device on its machine (:func:`actors.devices.rank_device`).

    Raises:
        ValueError: a launcher's local rank that is not a whole number >= 0.
    """
    if args.device == "auto":
        args.device = rank_device(launchers.local_rank(), visible_gpu_count())


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):  # 0 made the head's watch spin on a whole core
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value


def _silence(text: str) -> float:
    value = _positive_seconds(text)
    try:
        check_silence("the heartbeat timeout", value)  # a longer one let no node join
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _log_level(text: str) -> str:
    if not isinstance(logging.getLevelName(text.upper()), int):
        raise argparse.ArgumentTypeError(f"not a logging level: {text!r}; use DEBUG, INFO, WARNING, ERROR or CRITICAL")
    return text


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    # Count GPUs through NVML, without starting CUDA in this process: a worker forks its stages'
    # processes (actors._processes) after --device is checked, and CUDA does not survive a fork.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    args = parse_args(argv)
    launched = not (args.head or args.join or args.join_file)
    try:
        _from_launcher(args)
        _resolve_device(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.head and args.preload:
        if not launched:
            print("error: --preload is for workers: the head never imports user code", file=sys.stderr)
            return 2
        # A launcher gives every rank the same arguments: rank 0's head leaves the workers' --preload to them.
        print(f"note: rank 0 is the head, which never imports user code: --preload {' '.join(args.preload)} is for "
              "the other ranks", file=sys.stderr)
        args.preload = []
    if args.no_encryption:
        os.environ[ENCRYPTION_ENV] = "off"
    name = "head" if args.head else (args.name or f"{os.uname().nodename}-{os.getpid()}")
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s [{name}] %(levelname)s %(name)s: %(message)s")
    if args.head:
        serve = serve_head(HeadConfig(
            bind=args.bind or "tcp://127.0.0.1:5555", allow_remote=args.allow_remote,
            heartbeat_interval=args.heartbeat_interval, heartbeat_timeout=args.heartbeat_timeout,
            address_file=args.address_file, allow=DEFAULT_ALLOW + tuple(args.allow),
            plugins=tuple(args.plugin) if args.plugin is not None else head_modules(),
            keys=None if args.insecure else args.keys, identity=args.identity or "head",
            max_message_bytes=args.max_message_bytes, limits=tuple(args.limit),
            checkpoint_root=os.path.abspath(args.checkpoint_root)))
    else:
        serve = serve_worker(WorkerConfig(
            join=args.join or "", join_file=args.join_file, name=name, device=args.device, bind=args.bind or "tcp://127.0.0.1:0",
            allow_remote=args.allow_remote, allow=DEFAULT_ALLOW + tuple(args.allow), head_timeout=args.head_timeout,
            keys=None if args.insecure else args.keys, identity=args.identity or "node",
            max_message_bytes=args.max_message_bytes, isolation=args.isolation,
            exit_with_head=getattr(args, "exit_with_head", False), preload=tuple(args.preload)))
    try:
        run(serve)
    except (KeyFileError, SecurityMismatch) as exc:  # keys it may not use, or none for a secure head
        print(f"error: {exc}", file=sys.stderr)  # one line says what to fix
        return 2
    except HeadUnreachable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (ValueError, OSError, zmq.ZMQError) as exc:  # a setting it cannot start with: say it, as argparse does
        logging.getLogger(__name__).debug("the node did not start", exc_info=True)
        print(f"error: {_start_error(exc)}", file=sys.stderr)
        return 2
    return 0


def _start_error(exc: BaseException) -> str:
    """One line for a node that could not start (the traceback is at ``--log-level DEBUG``)."""
    if isinstance(exc, zmq.ZMQError) and exc.errno == errno.EADDRINUSE:
        return f"cannot listen: {exc}; another process holds that address: give --bind another port (0: any free one)"
    return str(exc)


if __name__ == "__main__":
    code = main()
    # Everything this process owns is closed by now; a compute thread may still sit in
    # a native call (a collective whose peer died), and joining it at interpreter exit
    # would keep a stopped node alive. Flush and leave without waiting for it.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
