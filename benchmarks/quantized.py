# Run: .venv/bin/python -m benchmarks.quantized                  (as root: veth unlimited, 1gbit, 100mbit)
#      .venv/bin/python -m benchmarks.quantized --loopback-only --steps 4   (anyone: loopback only)
"""Quantized activations and gradients between two pipeline stages, across a slow link, for real.

As root with iproute2, the benchmark makes two network namespaces joined by a veth pair
(``benchmarks._netns``) and shapes both ends with ``tc`` to each rate of ``--rates`` in
turn, checking every rate with a plain TCP transfer. The head, the driver and node0 run
in namespace A, node1 in namespace B, so every activation and gradient between the two
stages crosses the shaped link. The driver runs as a child of this process inside
namespace A (``--inner``); this process owns the namespaces and every node process and
removes them when it ends, by error and Ctrl-C included. Without root or iproute2 it
says why and runs the same comparison on loopback (a ``LocalCluster``).

Per link, one job per codec (activations and gradients alike) trains a learnable
regression task (``examples.data:regression_batches``) from the same seed on the same
batches, the stages reading the batches themselves so that only activations and
gradients cross the link. The steps run in rounds, one step of every job per round in
a rotated order, so that the machine's noise hits every codec alike. Reported per
codec: the median step time (and the best: on a shared, loaded machine the fastest
step is the least disturbed one), the bytes on the wire against ``none``, the relative
error of what crossed (the stages' own ``codec_stats``), the final loss and its
difference from ``none``. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks import _netns
from transport.codecs import CODEC_NAMES

MODEL = "examples.models:residual_mlp"
DATA = "examples.data:regression_batches"
DEFAULT_RATES = "unlimited,1gbit,100mbit"
DRIVER_TIMEOUT_S = 1800  # one link's comparison; a step that hangs fails sooner, by the job's step timeout
REQUIRED_KEYS = ("int8_bytes_ratio", "int4_bytes_ratio", "int8_loss_delta_pct", "int8_speedup_slow_link")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class BenchConfig:
    """The workload and how long to measure it; the same for every codec and link."""

    codecs: tuple[str, ...]
    steps: int = 10
    warmup: int = 1
    blocks: int = 4
    dim: int = 256
    batch_size: int = 64
    seq: int = 32
    micro_batches: int = 8
    lr: float = 0.5
    seed: int = 0

    def job_spec(self, codec: str) -> dict[str, Any]:
        """``cluster.train`` arguments of the job that sends everything with ``codec``."""
        return dict(
            model=MODEL, model_kwargs={"blocks": self.blocks, "dim": self.dim},
            loss="torch.nn.functional:mse_loss", optimizer=("torch.optim:SGD", {"lr": self.lr}),
            pipeline_stages=2, schedule="1f1b", micro_batches=self.micro_batches, seed=self.seed,
            activation_codec=codec, gradient_codec=codec,
            data=DATA, data_kwargs={"batch_size": self.batch_size, "seq": self.seq, "dim": self.dim,
                                    "seed": self.seed, "learnable": True},
        )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> BenchConfig:
        fields = json.loads(text)
        return cls(**{**fields, "codecs": tuple(fields["codecs"])})


@dataclasses.dataclass(slots=True)
class CodecRun:
    """What one codec's job measured on one link."""

    codec: str
    step_times_s: list[float] = dataclasses.field(default_factory=list)  # timed steps only
    losses: list[float] = dataclasses.field(default_factory=list)  # every step
    bytes_sent: int = 0  # of the last step
    rel_errors: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # "F"/"B" -> per edge and step

    def record(self, stats: Any, *, timed: bool) -> None:
        """Adds one step's StepStats."""
        self.losses.append(stats.loss)
        self.bytes_sent = stats.bytes_sent
        if timed:
            self.step_times_s.append(stats.step_time_s)
        for edge, edge_stats in (getattr(stats, "codec_stats", None) or {}).items():
            self.rel_errors.setdefault(edge.split()[0], []).append(float(edge_stats["rel_error"]))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LinkResult:
    """One link's table: its rate as shaped and as measured, and one row per codec."""

    label: str
    rate_bps: int | None  # None: unshaped (or loopback)
    measured_bps: float | None  # None: loopback, not measured
    shaper_drops: int | None
    rows: list[dict[str, Any]]


async def compare_codecs(cluster: Any, cfg: BenchConfig, label: str) -> list[CodecRun]:
    """Trains one job per codec on ``cluster``, in rounds of one step each; closes the jobs after."""
    jobs: dict[str, Any] = {}
    runs = {codec: CodecRun(codec) for codec in cfg.codecs}
    try:
        for codec in cfg.codecs:
            jobs[codec] = await cluster.train(**cfg.job_spec(codec))
        for step in range(cfg.warmup + cfg.steps):
            shift = step % len(cfg.codecs)
            times: dict[str, float] = {}
            for codec in cfg.codecs[shift:] + cfg.codecs[:shift]:
                stats = await jobs[codec].step()
                runs[codec].record(stats, timed=step >= cfg.warmup)
                times[codec] = stats.step_time_s
            kind = "warm-up" if step < cfg.warmup else "step"
            print(f"  [{label}] {kind} {step + 1}/{cfg.warmup + cfg.steps}: "
                  + "  ".join(f"{c} {times[c]:.3f}s" for c in cfg.codecs), flush=True)
    finally:
        for job in jobs.values():
            with contextlib.suppress(Exception):
                await job.close()
    return list(runs.values())


def summarize(runs: list[CodecRun]) -> list[dict[str, Any]]:
    """One table row per codec, measured against the ``none`` run."""
    base = next(r for r in runs if r.codec == "none")
    base_step, base_loss = statistics.median(base.step_times_s), base.losses[-1]
    rows = []
    for run in runs:
        step = statistics.median(run.step_times_s)
        errors = {d: statistics.fmean(v) if v else None for d, v in run.rel_errors.items()}
        rows.append({
            "codec": run.codec, "step_s": step, "speedup": base_step / step,
            "best_step_s": min(run.step_times_s), "best_speedup": min(base.step_times_s) / min(run.step_times_s),
            "bytes_ratio": run.bytes_sent / base.bytes_sent if base.bytes_sent else None,
            "rel_error_f": errors.get("F"), "rel_error_b": errors.get("B"),
            "final_loss": run.losses[-1], "loss_delta_pct": 100 * (run.losses[-1] - base_loss) / base_loss,
        })
    return rows


def _cell(value: Any, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def format_table(result: LinkResult) -> str:
    """The link's heading and its per-codec table, as Markdown."""
    if result.measured_bps is None:
        heading = f"### {result.label}"
    else:
        shaped = "unshaped veth" if result.rate_bps is None else f"shaped to {result.rate_bps / 1e6:g} Mbit/s"
        heading = (f"### {result.label}: {shaped}, measured {result.measured_bps / 1e6:,.0f} Mbit/s; "
                   f"{result.shaper_drops} packets dropped by the shaper during the steps")
    lines = [heading, "",
             "| codec | step s (median) | speedup vs none | best step s | best speedup | bytes vs none "
             "| rel err F | rel err B | final loss | loss delta % |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in result.rows:
        lines.append(
            f"| {row['codec']} | {row['step_s']:.3f} | {row['speedup']:.2f} | {row['best_step_s']:.3f} "
            f"| {row['best_speedup']:.2f} | {_cell(row['bytes_ratio'], '.3f')} "
            f"| {_cell(row['rel_error_f'], '.2e')} | {_cell(row['rel_error_b'], '.2e')} "
            f"| {row['final_loss']:.5f} | {row['loss_delta_pct']:+.3f} |")
    return "\n".join(lines)


# --- the driver: inside namespace A (--inner), or on loopback ---------------------


async def drive_remote(address: str, cfg: BenchConfig, label: str) -> list[CodecRun]:
    """Connects to the head at ``address`` (in this namespace), waits for both nodes, compares the codecs."""
    from schedulers import Cluster  # the outer process never needs the actor runtime

    # The head shares this namespace, so it reaches the driver on loopback.
    async with Cluster.connect(address, bind="tcp://127.0.0.1:0", timeout=30.0) as cluster:
        await cluster.wait_for_nodes(2, timeout=60.0)
        return await compare_codecs(cluster, cfg, label)


async def drive_loopback(cfg: BenchConfig) -> list[CodecRun]:
    """The same comparison on a LocalCluster: head and two nodes on 127.0.0.1."""
    from schedulers import LocalCluster

    async with LocalCluster(nodes=2) as cluster:
        return await compare_codecs(cluster, cfg, "loopback")


def run_inner(args: argparse.Namespace) -> None:
    """``--inner``: drives one link's comparison and writes its rows to ``--result-file``."""
    from transport.loop import run

    cfg = BenchConfig.from_json(args.inner_config)
    rows = summarize(run(drive_remote(args.connect, cfg, args.label)))
    staging = args.result_file + ".tmp"
    with open(staging, "w") as f:
        json.dump(rows, f)
    os.replace(staging, args.result_file)


# --- the outer process: namespaces, nodes, one driver per rate --------------------


def _python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def start_nodes(link: _netns.Link, workdir: str, processes: list[subprocess.Popen[bytes]]) -> str:
    """Starts the head and node0 in namespace A and node1 in B; returns the head's address.

    Every process started is appended to ``processes`` at once, so the caller stops it
    whatever happens next.
    """
    address_file = os.path.join(workdir, "head.address")
    # The cluster's keys: the head makes them on start; the nodes and the driver (children
    # of this process, in either namespace) find them through the environment.
    os.environ["ACTORPIPE_KEYS"] = os.path.join(workdir, "keys")
    common = ["--allow-remote", "--log-level", "WARNING"]
    with _netns.signals_deferred():  # a Ctrl-C between the start and the append would orphan the process
        processes.append(_netns.start_process(link.ns_a, _python_module(
            "actors.node", "--head", "--bind", f"tcp://{link.addr_a}:0", "--address-file", address_file, *common)))
    deadline = time.monotonic() + 60.0
    while not os.path.exists(address_file):
        if processes[0].poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the head did not start (exit code {processes[0].poll()}); see its log above")
        time.sleep(0.02)
    with open(address_file) as f:
        address = f.read().strip()
    for name, ns, addr in (("node0", link.ns_a, link.addr_a), ("node1", link.ns_b, link.addr_b)):
        with _netns.signals_deferred():
            processes.append(_netns.start_process(ns, _python_module(
                "actors.node", "--join", address, "--name", name, "--bind", f"tcp://{addr}:0", *common)))
    return address


def probe_bytes(rate_bps: int | None) -> int:
    """Bytes for the link check: about half a second at the rate, 4 to 256 MiB."""
    if rate_bps is None:
        return 256 << 20
    return min(256 << 20, max(4 << 20, rate_bps // 16))


def measure_link(link: _netns.Link, rate_bps: int | None, head: str, cfg: BenchConfig, workdir: str) -> LinkResult:
    """Shapes the link to ``rate_bps``, checks it, and runs the driver for it inside namespace A."""
    label = _netns.rate_label(rate_bps)
    _netns.set_rate(link, rate_bps)
    measured = _netns.measure_throughput(link, probe_bytes(rate_bps))
    print(f"link {label}: measured {measured / 1e6:,.0f} Mbit/s with a plain TCP transfer", flush=True)
    drops_before = _netns.qdisc_drops(link)
    result_file = os.path.join(workdir, f"{label}.json")
    drivers: list[subprocess.Popen[bytes]] = []
    try:
        with _netns.signals_deferred():
            drivers.append(_netns.start_process(link.ns_a, _python_module(
                "benchmarks.quantized", "--inner", "--connect", head, "--label", label,
                "--result-file", result_file, "--inner-config", cfg.to_json()), stdout=None))
        code = drivers[0].wait(timeout=DRIVER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the driver for link {label} did not finish within {DRIVER_TIMEOUT_S}s") from None
    finally:
        with _netns.signals_deferred():
            _netns.stop_processes(drivers)
    if code != 0:
        raise RuntimeError(f"the driver for link {label} failed with exit code {code}; see its output above")
    with open(result_file) as f:
        rows = json.load(f)
    return LinkResult(label=label, rate_bps=rate_bps, measured_bps=measured,
                      shaper_drops=_netns.qdisc_drops(link) - drops_before, rows=rows)


def run_netns(rates: list[int | None], cfg: BenchConfig) -> list[LinkResult]:
    """Every rate in turn across one pair of namespaces; everything is removed at the end.

    Raises:
        LinkError: the namespaces could not be made, shaped or measured.
    """
    link = _netns.make_link(os.getpid())
    print(f"namespaces {link.ns_a} ({link.addr_a}: head, driver, node0) and {link.ns_b} "
          f"({link.addr_b}: node1), veth {link.dev_a} <-> {link.dev_b}", flush=True)
    processes: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="actorpipe-quantized-") as workdir, _netns.open_link(link):
        try:
            head = start_nodes(link, workdir, processes)
            return [measure_link(link, rate, head, cfg, workdir) for rate in rates]
        finally:
            with _netns.signals_deferred():
                _netns.stop_processes(processes[1:])  # the workers first, so they can say goodbye to the head
                _netns.stop_processes(processes[:1])


# --- report -----------------------------------------------------------------------


def _rounded(value: Any) -> Any:
    return float(f"{value:.4g}") if isinstance(value, float) else value


def summary_json(results: list[LinkResult], *, mode: str, reason: str | None, cfg: BenchConfig,
                 wall_s: float) -> dict[str, Any]:
    """The last line: codec fidelity from the slowest link, step times per link, link rates.

    ``{codec}_speedup_slow_link`` is the step-time ratio none/codec on the slowest link
    measured, None when no link could be made (loopback only).
    """
    slowest = min(results, key=lambda r: float("inf") if r.rate_bps is None else r.rate_bps)
    out: dict[str, Any] = {"mode": mode, "loopback_reason": reason,
                           "slow_link": slowest.label if mode == "netns" else None}
    for row in slowest.rows:
        codec = row["codec"]
        errors = [e for e in (row["rel_error_f"], row["rel_error_b"]) if e is not None]
        out[f"{codec}_bytes_ratio"] = row["bytes_ratio"]
        out[f"{codec}_loss_delta_pct"] = row["loss_delta_pct"]
        out[f"{codec}_rel_error"] = max(errors) if errors else None
        out[f"{codec}_speedup_slow_link"] = row["speedup"] if mode == "netns" else None
        out[f"{codec}_best_speedup_slow_link"] = row["best_speedup"] if mode == "netns" else None
    for result in results:
        if result.measured_bps is not None:
            out[f"link_mbit_{result.label}"] = result.measured_bps / 1e6
            out[f"shaper_drops_{result.label}"] = result.shaper_drops
        for row in result.rows:
            out[f"{row['codec']}_step_s_{result.label}"] = row["step_s"]
            out[f"{row['codec']}_speedup_{result.label}"] = row["speedup"]
            out[f"{row['codec']}_best_step_s_{result.label}"] = row["best_step_s"]
    losses = [[row["final_loss"] for row in result.rows] for result in results]
    out["losses_identical_across_links"] = all(l == losses[0] for l in losses) if len(losses) > 1 else None
    for key in REQUIRED_KEYS:  # a codec left out of --codecs still has its key
        out.setdefault(key, None)
    out.update(model=f"residual_mlp blocks={cfg.blocks} dim={cfg.dim}", batch=[cfg.batch_size, cfg.seq, cfg.dim],
               micro_batches=cfg.micro_batches, steps=cfg.steps, warmup=cfg.warmup, lr=cfg.lr, wall_s=wall_s)
    return {key: _rounded(value) for key, value in out.items()}


# --- entry point ------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.quantized", description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default=DEFAULT_RATES,
                        help=f"comma-separated link rates, each shaped in turn (default {DEFAULT_RATES}); "
                        "units bit, kbit, mbit, gbit; 'unlimited' is the bare veth")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per codec and link (default 10)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    parser.add_argument("--codecs", default=",".join(CODEC_NAMES),
                        help=f"comma-separated codecs (default all: {','.join(CODEC_NAMES)}); none is always added")
    parser.add_argument("--loopback-only", action="store_true",
                        help="skip the namespaces and shaped links; measure on loopback only")
    parser.add_argument("--dim", type=int, default=256, help="model width (default 256; the reference is 512)")
    parser.add_argument("--blocks", type=int, default=4, help="residual blocks (default 4; the reference is 8)")
    parser.add_argument("--lr", type=float, default=0.5,
                        help="SGD learning rate (default 0.5: the loss moves within a few steps)")
    for hidden in ("--connect", "--label", "--result-file", "--inner-config"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)  # the driver, inside namespace A
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    try:
        args.rate_list = [_netns.parse_rate(r) for r in args.rates.split(",") if r.strip()]
        args.config = make_config(args)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def make_config(args: argparse.Namespace) -> BenchConfig:
    """The workload from the command line.

    Raises:
        ValueError: an unknown codec.
    """
    codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    unknown = [c for c in codecs if c not in CODEC_NAMES]
    if unknown:
        raise ValueError(f"unknown codecs {unknown}; known: {', '.join(CODEC_NAMES)}")
    ordered = ["none"] + [c for c in dict.fromkeys(codecs) if c != "none"]
    return BenchConfig(codecs=tuple(ordered), steps=args.steps, warmup=args.warmup, blocks=args.blocks,
                       dim=args.dim, lr=args.lr)


def measure(args: argparse.Namespace, cfg: BenchConfig) -> tuple[list[LinkResult], str, str | None]:
    """Runs across shaped namespaces when possible, else on loopback; returns the results, mode and why."""
    from transport.loop import run

    reason = "--loopback-only was given" if args.loopback_only else _netns.unavailable_reason()
    if reason is None:
        try:
            return run_netns(args.rate_list, cfg), "netns", None
        except _netns.LinkError as exc:
            reason = f"the shaped link could not be used: {exc}"
    print(f"measuring loopback only: {reason}", flush=True)
    rows = summarize(run(drive_loopback(cfg)))
    return [LinkResult(label="loopback", rate_bps=None, measured_bps=None, shaper_drops=None, rows=rows)], \
        "loopback", reason


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.inner:
        run_inner(args)
        return
    # SIGTERM unwinds like Ctrl-C, so the namespaces and nodes are removed either way.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cfg = args.config
    started, load_before = time.monotonic(), os.getloadavg()[0]
    print(f"residual_mlp blocks={cfg.blocks} dim={cfg.dim}, batch {cfg.batch_size}x{cfg.seq}x{cfg.dim} in "
          f"{cfg.micro_batches} micro-batches, 2 stages 1F1B, SGD lr {cfg.lr}; {cfg.warmup} warm-up + "
          f"{cfg.steps} timed steps per codec: {', '.join(cfg.codecs)}", flush=True)
    try:
        results, mode, reason = measure(args, cfg)
    except KeyboardInterrupt:
        print("interrupted; the namespaces and node processes are removed", file=sys.stderr)
        raise SystemExit(130) from None
    for result in results:
        print("\n" + format_table(result))
    print()
    # Other work on this machine moves step times more than a fast link does: say how busy it was.
    load = {"load_avg_1min_start": load_before, "load_avg_1min_end": os.getloadavg()[0], "num_cpus": os.cpu_count()}
    print(f"1-minute load average: {load['load_avg_1min_start']:.1f} at the start, "
          f"{load['load_avg_1min_end']:.1f} at the end, on {os.cpu_count()} CPUs")
    summary = summary_json(results, mode=mode, reason=reason, cfg=cfg, wall_s=time.monotonic() - started)
    print(json.dumps({**summary, **{k: _rounded(v) for k, v in load.items()}}))


if __name__ == "__main__":
    main()
