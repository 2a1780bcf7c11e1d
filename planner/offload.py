"""Offloading: storages parked in host memory across their idle stretch, and the step time a
plan predicts.

A storage idle between two uses (typically an activation between its last forward use and its
backward use) may be *offloaded*: copied to the host pool after the use before the gap, released
from the device once the copy is done, and copied back into fresh device memory before the use
after the gap. Copies run on one channel (a CUDA copy stream, or a copy thread on CPU) beside
the compute, at the bandwidth measured on the machine (``executor.offload.measure_bandwidth``).

The plan fixes *positions*, so the device bytes are exact whatever the copies cost in time:

* the copy out starts after the op at ``start`` (the last use before the gap);
* the device copy is released after the op at ``released``: the first position by which the
  compute since ``start`` takes as long as the copy (the executor waits there if it has not
  landed, so a slow copy costs time, never memory);
* the copy back starts before the op at ``prefetch``: the last position from which the compute
  up to the next use takes as long as the copy; the device memory is allocated there;
* so the storage is off the device at positions ``released + 1 .. prefetch - 1``.

A storage qualifies when that stretch is not empty, it is local to the step, nobody reads it
from Python, and it is not written in the gap (a write is a use). Whether it is offloaded is
one more keep-or-not decision in :mod:`planner.remat`'s model, exclusive with dropping its
producer, and with dropping a reader whose recomputation would need it inside the gap. The
channel is shared: the model bounds, at every position, the sum over the copies in flight of
the share of the channel each needs to land in its window; :func:`predict_seconds` replays the
plan with the copies in order (first come, first served) and is the time reported.
"""

from __future__ import annotations

from dataclasses import dataclass

from .graph import LOCAL, PlanningGraph, longest_gap
from .schedule import Bandwidth


@dataclass(frozen=True)
class OffloadCandidate:
    """A storage that may be parked on the host: off the device at positions
    ``released + 1 .. prefetch - 1`` (see the module docstring)."""

    sid: int
    nbytes: int
    start: int
    released: int
    prefetch: int
    use: int
    out_seconds: float
    in_seconds: float
    producer: int  # the op that allocates it (exclusive with dropping that op)
    index: int  # which of the producer's storages it is

    @property
    def off(self) -> range:
        return range(self.released + 1, self.prefetch)


def _op_seconds(g: PlanningGraph, order: list[int]) -> list[float]:
    return [g.ops[v].seconds for v in order]


def offload_candidates(g: PlanningGraph, order: list[int], bw: Bandwidth) -> list[OffloadCandidate]:
    """The storages that may be offloaded in ``order``, with their windows, by position."""
    from .simulate import needed_at  # (the simulator reads offload candidates)

    n = len(order)
    seconds = _op_seconds(g, order)
    found = []
    for sid, ps in needed_at(g, order).items():
        s = g.storages[sid]
        gap = longest_gap(ps)
        if s.kind != LOCAL or s.fetched or s.nbytes <= 0 or gap is None:
            continue
        a, b = gap
        t_out, t_in = bw.out_seconds(s.nbytes), bw.in_seconds(s.nbytes)
        released, spent = a + 1, seconds[a + 1] if a + 1 < n else 0.0
        while spent < t_out and released < b - 1:
            released += 1
            spent += seconds[released]
        prefetch, spent = b - 1, seconds[b - 1]
        while spent < t_in and prefetch > released + 1:
            prefetch -= 1
            spent += seconds[prefetch]
        if prefetch - released < 2:
            continue
        producer = g.ops[s.producer]
        found.append(
            OffloadCandidate(
                sid, s.nbytes, a, released, prefetch, b, t_out, t_in,
                s.producer, producer.allocates.index(sid),
            )
        )  # fmt: skip
    return sorted(found, key=lambda o: (o.start, o.sid))


def channel_shares(g: PlanningGraph, order: list[int], offs: list[OffloadCandidate]) -> list[dict[int, float]]:
    """Per position, the share of the copy channel each candidate's copy needs there if it is
    to land within its window (its seconds over the window's compute seconds)."""
    seconds = _op_seconds(g, order)
    shares: list[dict[int, float]] = [dict() for _ in order]
    for o in offs:
        for window, t in ((range(o.start + 1, o.released + 1), o.out_seconds), (range(o.prefetch, o.use), o.in_seconds)):
            total = sum(seconds[p] for p in window)
            share = 1.0 if total <= 0 else min(1.0, t / total)
            for p in window:
                shares[p][o.sid] = max(shares[p].get(o.sid, 0.0), share)
    return shares


def predict_seconds(
    g: PlanningGraph, order: list[int], recompute_at: dict[int, float], offs: list[OffloadCandidate]
) -> tuple[float, float]:
    """The step's time and the part of it spent waiting for copies: ops in ``order`` one after
    another, ``recompute_at[p]`` seconds of recomputation before the op at ``p``, and the copies
    of ``offs`` first come, first served on one channel beside the compute."""
    n = len(order)
    starts_out: dict[int, list[OffloadCandidate]] = {}
    waits: dict[int, list[OffloadCandidate]] = {}
    prefetches: dict[int, list[OffloadCandidate]] = {}
    uses: dict[int, list[OffloadCandidate]] = {}
    for o in offs:
        starts_out.setdefault(o.start, []).append(o)
        waits.setdefault(o.released, []).append(o)
        prefetches.setdefault(o.prefetch, []).append(o)
        uses.setdefault(o.use, []).append(o)
    now = channel = stalled = 0.0
    landed: dict[tuple[str, int], float] = {}
    for t in range(n):
        for o in prefetches.get(t, ()):
            channel = max(channel, now, landed["out", o.sid]) + o.in_seconds
            landed["in", o.sid] = channel
        now += recompute_at.get(t, 0.0)
        ready = max([now, *(landed["in", o.sid] for o in uses.get(t, ()))])
        stalled += ready - now
        now = ready + g.ops[order[t]].seconds
        for o in starts_out.get(t, ()):
            channel = max(channel, now) + o.out_seconds
            landed["out", o.sid] = channel
        ready = max([now, *(landed["out", o.sid] for o in waits.get(t, ()))])
        stalled += ready - now
        now = ready
    return now, stalled
