"""A node's role and its head, from the variables of the launcher it runs under.

People start training on many machines with the launcher their cluster has, and none of
these needs ssh: ``torchrun`` (and Kubeflow's PyTorchJob / Trainer, which set its
variables), Slurm's ``srun``, and a Kubernetes Indexed Job or JobSet. Under any of them
``python -m actors.node`` with no ``--head`` or ``--join`` finds its rank: rank 0 is the
head, every other rank a worker that joins it (retrying until it answers, within
``--head-timeout``). Explicit flags always win.

=============  ===========================================  =====================================
launcher       rank, world                                  the head
=============  ===========================================  =====================================
torchrun       ``RANK``, ``WORLD_SIZE`` (Kubeflow: as is,   ``MASTER_ADDR``, port ``MASTER_PORT``
               or ``PET_NODE_RANK``, ``PET_NNODES``)        + 1 (torchrun's own store holds
                                                            ``MASTER_PORT``)
Slurm          ``SLURM_PROCID``, ``SLURM_NTASKS``           the first host of the step's
                                                            ``SLURM_STEP_NODELIST`` (else
                                                            ``SLURM_JOB_NODELIST``), port 20000 +
                                                            ``SLURM_JOB_ID`` mod 20000
Kubernetes     ``JOB_COMPLETION_INDEX``,                    ``ACTORPIPE_HEAD_HOST`` (index 0's
               ``ACTORPIPE_WORLD_SIZE``                     stable name behind a headless
                                                            Service), port 29400
=============  ===========================================  =====================================

``ACTORPIPE_PORT`` names the head's port under any of them. A driver given the same
variables (and keys) connects with ``Cluster.connect()`` and no address. A training script
that the launcher starts on every rank calls :func:`serve_unless_rank_zero` first: rank 0
goes on to drive, with the head beside it; every other rank serves as a node.
"""

from __future__ import annotations

import atexit
import errno
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from actors._processes import _die_with_parent
from transport.addresses import is_loopback, route_source, url_host

__all__ = ["HeadStartError", "LaunchRole", "first_host", "from_environment", "own_host", "serve_unless_rank_zero"]

_KUBERNETES_PORT = 29400
# How long rank 0 waits for the head it started to listen: its start is imports and one bind,
# seconds on a busy machine; a head that neither listens nor exits in this time is stuck.
HEAD_START_TIMEOUT_S = 60.0


class HeadStartError(RuntimeError):
    """Rank 0's head did not start: it exited (a port in use, say) or never listened. The message says which."""


@dataclass(frozen=True, slots=True)
class LaunchRole:
    """This process's place in a launched cluster."""

    launcher: str  # "torchrun", "slurm" or "kubernetes"
    rank: int
    world_size: int
    head_host: str
    port: int

    @property
    def is_head(self) -> bool:
        return self.rank == 0

    @property
    def head_address(self) -> str:
        """Where the head listens (without its key: the key directory completes it)."""
        return f"tcp://{url_host(self.head_host)}:{self.port}"

    @property
    def loopback(self) -> bool:
        """Every process on this machine (a single-host launch): nothing need listen beyond loopback."""
        return is_loopback(self.head_host)


def from_environment(env: Mapping[str, str] | None = None) -> LaunchRole | None:
    """The role the launcher's variables give this process, or None outside a launcher.

    Raises:
        ValueError: a launcher's variables that do not make sense (named in the message).
    """
    env = os.environ if env is None else env
    port = ("ACTORPIPE_PORT", env["ACTORPIPE_PORT"]) if env.get("ACTORPIPE_PORT") else None
    for rank_name, world_name, master, master_port in (("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"),
                                             ("PET_NODE_RANK", "PET_NNODES", "PET_MASTER_ADDR", "PET_MASTER_PORT")):
        if rank_name in env and world_name in env:
            if not env.get(master, "").strip():  # else each rank ran the script alone, or bound every address
                raise ValueError(f"torchrun's {rank_name} and {world_name} are set but {master} is "
                                 f"{'empty' if master in env else 'not'}: it names the host of rank 0, where the "
                                 "head listens")
            base = env.get(master_port, "29500")
            return _role("torchrun", env, rank_name, world_name, env[master].strip(),
                         port or (f"{master_port}+1", str(_integer(base, master_port) + 1)))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        # Task 0 runs on the first host of its step, which need not be the allocation's first (srun -N2
        # --relative=1, -w, --exclude, a second step beside the first): the step's own list where srun gives it.
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not nodelist:
            raise ValueError("Slurm set SLURM_PROCID but no SLURM_JOB_NODELIST: run under srun or sbatch")
        job = env.get("SLURM_JOB_ID", "0")
        return _role("slurm", env, "SLURM_PROCID", "SLURM_NTASKS", first_host(nodelist),
                     port or ("20000 + SLURM_JOB_ID mod 20000",
                              str(20000 + _integer(job, "SLURM_JOB_ID") % 20000)))
    if "JOB_COMPLETION_INDEX" in env:
        host = env.get("ACTORPIPE_HEAD_HOST")
        if not host or not env.get("ACTORPIPE_WORLD_SIZE"):
            raise ValueError("a Kubernetes Indexed Job needs ACTORPIPE_HEAD_HOST (index 0's stable host name, e.g. "
                             "train-0.train) and ACTORPIPE_WORLD_SIZE (its completions) in the pod's environment")
        if env.get("JOB_INDEX", "0") != "0":  # a JobSet's job index: its Jobs each number their pods from 0
            raise ValueError(f"JOB_INDEX={env['JOB_INDEX']!r:.20}: a JobSet of several replicated Jobs numbers each "
                             "Job's pods from 0 (JOB_COMPLETION_INDEX), so each Job would start a head; run one "
                             "Indexed Job (replicas: 1) of ACTORPIPE_WORLD_SIZE completions")
        return _role("kubernetes", env, "JOB_COMPLETION_INDEX", "ACTORPIPE_WORLD_SIZE", host,
                     port or ("the Kubernetes default", str(_KUBERNETES_PORT)))
    return None


def local_rank(env: Mapping[str, str] | None = None) -> int | None:
    """This process's rank on its machine, as the launcher says it (torchrun's ``LOCAL_RANK``, srun's
    ``SLURM_LOCALID``); None where none does (a Kubernetes pod is alone on its machine's GPUs).

    Raises:
        ValueError: a variable that is not a whole number >= 0, named.
    """
    env = os.environ if env is None else env
    for name in ("LOCAL_RANK", "SLURM_LOCALID"):
        if name in env:
            value = _integer(env[name], name)
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
            return value
    return None


def serve_unless_rank_zero(node_args: Sequence[str] = (), *,
                           start_timeout: float = HEAD_START_TIMEOUT_S) -> LaunchRole | None:
    """The one call at the top of a training script that a launcher starts on every rank.

    Rank 0 starts the head beside itself (``python -m actors.node`` with ``node_args``, a child
    process it stops at exit) and returns its role: the script goes on, connects with
    ``Cluster.connect()`` and drives. Every other rank becomes a worker node (this process is
    replaced by ``python -m actors.node`` with ``node_args``), serving until the head is gone
    (its liveness connection to the head closed for a few seconds), then exiting cleanly. Outside a launcher it returns None
    and the script goes on as it is (a ``LocalCluster``, say).

    Rank 0 returns once its head listens.

    Raises:
        ValueError: the launcher's variables do not make sense.
        HeadStartError: rank 0's head exited before it listened (its port taken, say: the
            message says so) or did not listen within ``start_timeout`` s.
    """
    role = from_environment()
    if role is None:
        return None
    command = [sys.executable, "-m", "actors.node", *node_args]
    if not role.is_head:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, command)  # never returns: this rank is a node now
    # The head goes with rank 0 however it ends (at exit it is stopped cleanly; killed, the kernel kills it).
    # It writes its address once it listens: rank 0 goes on only then, and a head that could not
    # start (its port taken) fails rank 0 at once, by name, instead of every rank's connect timing out.
    folder = tempfile.mkdtemp(prefix="actorpipe-head-")
    ready = os.path.join(folder, "head.address")
    head = subprocess.Popen([*command, "--address-file", ready], preexec_fn=_die_with_parent)
    try:
        _await_head(head, ready, role, start_timeout)
    except BaseException:
        _stop_head(head, folder)
        raise
    atexit.register(_stop_head, head, folder)
    return role


def _await_head(head: subprocess.Popen[bytes], ready: str, role: LaunchRole, timeout: float) -> None:
    """Returns once the head listens (its address file exists).

    Raises:
        HeadStartError: the head exited first (saying so, and whether its port is taken), or
            neither listened nor exited within ``timeout`` s (the caller stops it).
    """
    deadline = time.monotonic() + timeout
    while not os.path.exists(ready):
        code = head.poll()
        if code is not None:
            cause = "its error is printed above"
            if _port_taken(role):
                default = " (torchrun's default is MASTER_PORT + 1)" if role.launcher == "torchrun" else ""
                cause = (f"port {role.port} is in use on {role.head_host}: free it, or set ACTORPIPE_PORT to a free "
                         f"port on every rank{default}")
            raise HeadStartError(f"{role.launcher} rank 0: the head (python -m actors.node at "
                                 f"{role.head_address}) exited with code {code} before it listened; {cause}")
        if time.monotonic() > deadline:
            raise HeadStartError(f"{role.launcher} rank 0: the head (python -m actors.node at {role.head_address}) "
                                 f"did not listen within {timeout:g}s; it was stopped")
        time.sleep(0.05)


def _port_taken(role: LaunchRole) -> bool:
    """Whether something else holds the head's port on this machine (a bind to it is refused)."""
    host = role.head_host.strip("[]")
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.bind((host if is_loopback(host) else "", role.port))
    except OSError as exc:
        return exc.errno == errno.EADDRINUSE
    return False


def _stop_head(head: subprocess.Popen[bytes], folder: str | None = None) -> None:
    if head.poll() is None:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(timeout=10)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: ``gpu[03-05,9],cpu1`` -> ``gpu03``; a name goes on after its
    brackets (``node[01-02]-ib`` -> ``node01-ib``), and each bracket of a name gives its first value
    (``rack[1-2]-blade[3-4]`` -> ``rack1-blade3``), as ``scontrol show hostnames`` lists them."""
    text, depth = nodelist.strip(), 0
    for end, char in enumerate(text):  # the first name: up to the first comma outside brackets
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            text = text[:end]
            break
    host = re.sub(r"\[([^\[\]]*)\]", lambda m: m.group(1).split(",")[0].split("-")[0], text)
    if not host or text.startswith("[") or "[" in host or "]" in host or "," in host:
        raise ValueError(f"not a Slurm node list: {nodelist[:80]!r}")
    return host


def own_host(head_host: str, head_port: int = 1) -> str:
    """The address other hosts reach this process at, as it goes in a ``tcp://`` address (an IPv6
    one in brackets): ``ACTORPIPE_HOST`` when set; loopback when the head is on this machine's
    loopback (IPv6's when the head's is); else the address this host sends from toward the head.

    That address is the kernel's choice of route (a UDP socket "connected" to the head, which sends
    nothing), so it is one the head can answer: this host's name resolved by itself is often a
    loopback address (``127.0.1.1`` on Debian and Ubuntu, whose ``/etc/hosts`` maps the host's name
    there), which no other host reaches, and never IPv6. Where no route to the head is found (a head
    name that does not resolve yet) this host's name resolved is the fallback. A head whose own name
    resolves to loopback on its machine (``--master-addr $(hostname)`` on Debian) gets loopback here;
    ``python -m actors.node`` then listens on every address (see ``actors.node``).
    """
    if "ACTORPIPE_HOST" in os.environ:
        return url_host(os.environ["ACTORPIPE_HOST"])
    bare = head_host.strip("[]")
    if is_loopback(bare):  # the loopback address given (127.0.1.1 is one): where the others look for the head
        return url_host(bare) if bare != "localhost" else "127.0.0.1"
    source = route_source(bare, head_port)
    return url_host(source) if source is not None else socket.gethostbyname(socket.gethostname())


def _role(launcher: str, env: Mapping[str, str], rank: str, world: str, host: str,
          port: tuple[str, str]) -> LaunchRole:
    """The role from the variables named ``rank`` and ``world`` in ``env``; ``port``: ``(where it came from,
    its text)``."""
    role = LaunchRole(launcher, _integer(env[rank], rank), _integer(env[world], world), host,
                      _integer(port[1], port[0]))
    if not 0 <= role.rank < role.world_size:
        raise ValueError(f"{launcher}: {rank}={role.rank} is outside a world of {world}={role.world_size}")
    if not 0 < role.port < 65536:
        raise ValueError(f"{launcher}: the head's port {role.port} (from {port[0]}) is not a TCP port; set "
                         "ACTORPIPE_PORT to one")
    return role


def _integer(text: str, name: str) -> int:
    """``text`` as an int, digits only (``int`` takes ``12_3`` and spaces)."""
    if not re.fullmatch(r"-?[0-9]+", text.strip()):
        raise ValueError(f"{name} is not a whole number: {text[:40]!r}")
    return int(text)

