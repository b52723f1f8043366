"""A step as a Chrome/Perfetto trace and a PNG timeline: pure functions over step results.

This is the one trace writer: measured steps use it directly, and
:func:`schedulers.simulate.to_chrome_trace` turns a simulated timeline into the same
records (one per rank, on one clock) and writes them here.

Each stage actor reports its spans ``[action, start_s, end_s]`` relative to its own
wall clock at the step's start (``started_at``). Nodes' clocks disagree, so each is
put on the head's clock with an offset estimated from round trips (NTP's way): the
head notes ``t_send``, the stage answers its ``clock``, the head notes ``t_recv``;
``offset = stage_clock - (t_send + t_recv) / 2``, and the sample with the shortest
round trip is the one to trust (its error is at most half that round trip).

The trace has one track per stage actor, a span per action (with its stage and
micro-batch), the step's tail after them (``REDUCE``, ``BARRIER``: the wait for every
stage's vote, ``STEP``; category ``tail``), and a flow arrow per transfer from the
``SEND`` that posted the value to the ``RECV`` that took it. Open it at
https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from stages import Action, ActionKind, Placement, transfer_partner

__all__ = ["StageRecord", "estimate_offset", "match_transfers", "plot_trace", "to_chrome_trace"]

_US = 1e6
_CATEGORY = {
    ActionKind.F: "forward", ActionKind.B: "backward", ActionKind.I: "backward", ActionKind.W: "backward",
    ActionKind.SEND_F: "send", ActionKind.SEND_B: "send", ActionKind.RECV_F: "recv", ActionKind.RECV_B: "recv",
}
_COLOURS = {"F": "tab:blue", "B": "tab:orange", "I": "tab:red", "W": "tab:green"}
_IDLE = "#e8e8e8"
_TAIL = "tab:purple"


@dataclass(frozen=True, slots=True, kw_only=True)
class StageRecord:
    """One stage actor's part of a step, as it reported it.

    Attributes:
        member: the actor's global rank in the mesh (its track).
        name: the track's label, e.g. ``"stage 1"`` or ``"stage 1 dp 0"``.
        pipeline_rank: its pipeline rank (which programs' actions it ran).
        replica: the pipeline replica it belongs to (data and tensor coordinates);
            transfers stay within one replica.
        started_at: its own wall clock at the step's start, in seconds.
        offset_s: its clock minus the head's (see :func:`estimate_offset`).
        spans: ``(action, start_s, end_s)`` relative to ``started_at``.
    """

    member: int
    name: str
    pipeline_rank: int
    replica: tuple[int, ...] = ()
    started_at: float
    offset_s: float = 0.0
    spans: Sequence[Sequence[Any]] = field(default_factory=list)

    @property
    def head_start(self) -> float:
        """The step's start on the head's clock."""
        return self.started_at - self.offset_s


def estimate_offset(samples: Iterable[tuple[float, float, float]]) -> tuple[float, float]:
    """A node's clock offset from round trips ``(t_send, remote_clock, t_recv)``, head clock at both ends.

    Returns:
        ``(offset_s, round_trip_s)`` of the sample with the shortest round trip:
        ``offset = remote_clock - (t_send + t_recv) / 2``.

    Raises:
        ValueError: no samples.
    """
    best = min(samples, key=lambda s: s[2] - s[0], default=None)
    if best is None:
        raise ValueError("estimate_offset needs at least one round trip")
    t_send, remote, t_recv = best
    return remote - (t_send + t_recv) / 2, t_recv - t_send


def match_transfers(records: Sequence[StageRecord], num_ranks: int,
                    placement: Placement = "loop") -> list[tuple[int, int, int, int]]:
    """Pairs every ``SEND`` span with the ``RECV`` span that took its value.

    Args:
        records: the stage actors' spans.
        num_ranks: pipeline ranks (to place model stages on ranks when interleaved).
        placement: how the model stages sit on the ranks (``v`` for ZB-V and DualPipeV).

    Returns:
        ``(sender index, send span index, receiver index, recv span index)``, indices
        into ``records`` and their ``spans``; a send whose receive is missing (a
        failed step) is left out.
    """
    by_place = {(r.replica, r.pipeline_rank): i for i, r in enumerate(records)}
    recv_at = {(i, str(span[0])): j for i, r in enumerate(records) for j, span in enumerate(r.spans)}
    pairs = []
    for i, record in enumerate(records):
        for j, span in enumerate(record.spans):
            action = Action.parse(str(span[0]))
            if action.kind not in (ActionKind.SEND_F, ActionKind.SEND_B):
                continue
            rank, recv = transfer_partner(action, num_ranks, placement)
            receiver = by_place.get((record.replica, rank))
            if receiver is not None and (receiver, str(recv)) in recv_at:
                pairs.append((i, j, receiver, recv_at[receiver, str(recv)]))
    return pairs


def to_chrome_trace(
    records: Sequence[StageRecord], *, num_ranks: int, title: str = "step", metadata: Mapping[str, Any] | None = None,
    placement: Placement = "loop",
) -> dict[str, Any]:
    """The step as Chrome/Perfetto trace JSON, on the head's clock.

    Times are microseconds from the earliest stage's start. Spans carry
    ``args = {stage, microbatch, kind}``; flows (``ph`` ``s``/``f``, category
    ``transfer``) run from each send's start to the end of the receive that took it.
    ``otherData`` holds ``clock`` (``"head"``) and each track's ``clock_offsets_s``,
    then ``metadata``, which may override them.

    Args:
        records: one per stage actor.
        num_ranks: pipeline ranks.
        placement: how the model stages sit on them.
        title: the process name shown above the tracks.
        metadata: extra facts for ``otherData`` (job, step...).
    """
    origin = min((r.head_start for r in records), default=0.0)
    events: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": title}}]
    for record in records:
        tid = record.member
        events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": tid, "args": {"name": record.name}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": 0, "tid": tid, "args": {"sort_index": tid}})
    for record in records:
        shift = record.head_start - origin
        for text, start, end in (tuple(span[:3]) for span in record.spans):
            action = Action.parse(str(text))
            events.append({
                "name": str(text), "cat": _CATEGORY.get(action.kind, "tail"), "ph": "X", "pid": 0,
                "tid": record.member, "ts": (shift + float(start)) * _US, "dur": (float(end) - float(start)) * _US,
                "args": {"stage": action.stage, "microbatch": action.microbatch, "kind": action.kind.value},
            })
    for flow_id, (i, j, k, n) in enumerate(match_transfers(records, num_ranks, placement)):
        send, recv = records[i].spans[j], records[k].spans[n]
        leaves = (records[i].head_start - origin + float(send[1])) * _US
        recv_start = (records[k].head_start - origin + float(recv[1])) * _US
        recv_end = (records[k].head_start - origin + float(recv[2])) * _US
        # Bound to the receive's slice: just inside its end, where the value was taken.
        arrives = max(recv_start, recv_end - min(1.0, (recv_end - recv_start) / 2))
        common = {"name": f"{send[0]} -> {recv[0]}", "cat": "transfer", "pid": 0, "id": flow_id}
        events.append({**common, "ph": "s", "tid": records[i].member, "ts": leaves})
        events.append({**common, "ph": "f", "bp": "e", "tid": records[k].member, "ts": arrives})
    other = {"clock": "head", "clock_offsets_s": {r.name: r.offset_s for r in records}, **(metadata or {})}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def plot_trace(trace: Mapping[str, Any], path: str | os.PathLike[str], *, title: str | None = None) -> None:
    """Draws a trace from :func:`to_chrome_trace` as a PNG: stages as rows, time across.

    Forward, backward, input- and weight-gradient spans have their own colours;
    sends and receives are thin grey ticks, the step's tail (reduce, the stages' vote,
    optimizer step) a thin purple one; the rest of each row is shaded idle, so the
    bubble is what you see.

    Raises:
        ImportError: matplotlib is not installed (``pip install matplotlib``).
    """
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    events = list(trace.get("traceEvents", []))
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    rows = sorted(names or {e["tid"] for e in spans})
    end_ms = max((float(e["ts"]) + float(e["dur"]) for e in spans), default=0.0) / 1e3
    fig, ax = plt.subplots(figsize=(10, 1.6 + 0.5 * max(1, len(rows))))
    kinds_seen = set()
    for y, tid in enumerate(rows):
        ax.broken_barh([(0.0, end_ms)], (y - 0.4, 0.8), facecolors=_IDLE)  # idle unless covered
        for e in (e for e in spans if e["tid"] == tid):
            start, width, kind = float(e["ts"]) / 1e3, float(e["dur"]) / 1e3, e["args"].get("kind")
            if kind in _COLOURS:
                kinds_seen.add(kind)
                ax.broken_barh([(start, width)], (y - 0.4, 0.8), facecolors=_COLOURS[kind], edgecolors="white",
                               linewidth=0.5)
                if width > end_ms / 60:  # room for the micro-batch number
                    ax.text(start + width / 2, y, str(e["args"].get("microbatch")), ha="center", va="center",
                            fontsize=7, color="white")
            elif e.get("cat") in ("send", "recv"):
                kinds_seen.add("comm")
                ax.broken_barh([(start, max(width, end_ms * 1e-3))], (y + 0.28, 0.12), facecolors="tab:gray")
            elif e.get("cat") == "tail":
                kinds_seen.add("tail")
                ax.broken_barh([(start, max(width, end_ms * 1e-3))], (y - 0.4, 0.12), facecolors=_TAIL)
    ax.set_yticks(range(len(rows)), [names.get(t, f"member {t}") for t in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, end_ms * 1.01 if end_ms else 1.0)
    ax.set_xlabel(f"time (ms, {trace.get('otherData', {}).get('clock', 'head')} clock)")
    process = next((e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"),
                   "pipeline step")
    ax.set_title(title or str(trace.get("otherData", {}).get("title", process)))
    labels = {"F": "forward", "B": "backward", "I": "input grad", "W": "weight grad"}
    legend = [Patch(color=_COLOURS[k], label=label) for k, label in labels.items() if k in kinds_seen]
    if "comm" in kinds_seen:
        legend.append(Patch(color="tab:gray", label="send / recv wait"))
    if "tail" in kinds_seen:
        legend.append(Patch(color=_TAIL, label="reduce, vote, optimizer step"))
    legend.append(Patch(color=_IDLE, label="idle"))
    fig.legend(handles=legend, loc="lower center", ncol=len(legend), fontsize="small", frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(os.fspath(path), dpi=100)
    plt.close(fig)
