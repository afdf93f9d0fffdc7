"""Where the copies of offloaded storages go on the predicted timeline: the placement the
``place_transfers`` pass applies and ``plan_memory`` queries.

Copies queue on their lane in order: D2H copies by production order, H2D copies by first read
(the first node reading the data; views of it do not count). An offload is issued after the
storage's producer, or the first later node long enough to cover the op's host cost
(``HOST_COVER_S``); the compute stream waits on it after the first compute node, at or after
the storage's last forward read, whose predicted end is at or after the copy's predicted end
(else the last one). A prefetch is issued at the latest point that leaves
``PREFETCH_SLACK_FRACTION`` of the copy time as slack before its first read and before the next
copy on the lane.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Sequence

from torch import fx

from storm_compile.fx.graphs import COST_KEY, PassContext, StormGraphs
from storm_compile.fx.plan import GradSend, Placement, Storage, Unplaced, WeightFetch
from storm_compile.fx.vocabulary import Lane, node_order, tensor_bytes, view_closure
from storm_compile.runtime import ops

HOST_COVER_S = 100e-6
"""An offload is issued after the first node, from its producer on, predicted to keep the GPU
busy this long: the op's host-side work (pool lookup, copy launch; ~100 µs measured under the
profiler) then runs while that kernel does, instead of leaving an idle GPU waiting for the next
launch, which happens early in the forward when little work is queued."""

PREFETCH_SLACK_FRACTION = 0.5
"""A prefetch is issued as late as still leaves this fraction of its copy time as predicted
slack before first read: late enough that its host-side cost lands while the GPU has queued work
(at the start of the backward the GPU has none), early enough to absorb a link 1.5x slower than
the profile says."""


STREAMED_COPIES = (ops.fetch_weight, ops.grad_to_host)
"""Streamed parameters' copies, which the traced graphs run on the compute stream and
``insert_transfers`` moves to the copy lanes."""


class _Timeline:
    """A graph's nodes in order with predicted start/end, and its compute nodes for bisection.
    Streamed weights' fetches and gradients' copies home take no compute time: they are placed
    on the copy lanes."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.nodes = list(gm.graph.nodes)
        self.order = node_order(gm)
        self.start, self.end, t = {}, {}, 0.0
        computes = {n: n.meta[COST_KEY].is_compute and n.target not in STREAMED_COPIES
                    for n in self.nodes}
        for node in self.nodes:
            self.start[node] = t
            t += node.meta[COST_KEY].compute_s if computes[node] else 0.0
            self.end[node] = t
        self.compute = [n for n in self.nodes if computes[n]]
        self.compute_order = [self.order[n] for n in self.compute]
        self.compute_end = [self.end[n] for n in self.compute]
        covering, self.next_cover = None, [None] * len(self.compute)
        for i in range(len(self.compute) - 1, -1, -1):
            if self.compute[i].meta[COST_KEY].compute_s >= HOST_COVER_S:
                covering = self.compute[i]
            self.next_cover[i] = covering

    def first_compute_from(self, index: int) -> int:
        """Position in ``compute`` of the first compute node at or after node ``index``."""
        return bisect.bisect_left(self.compute_order, index)


@dataclasses.dataclass(frozen=True)
class _Offload:
    """A D2H copy placed: issued after ``issue``, waited on after ``wait``."""

    issue: fx.Node
    wait: fx.Node
    slack_s: float


@dataclasses.dataclass(frozen=True)
class _Prefetch:
    """An H2D copy placed: issued after ``issue`` (None: after the graph inputs)."""

    issue: fx.Node | None
    slack_s: float


@dataclasses.dataclass(frozen=True)
class _Outgoing:
    """A D2H copy to place: ``source``'s ``nbytes``, read on the device last at index
    ``last_read``; ``key`` names it (a storage's root, or a gradient's ``grad_to_host``)."""

    key: fx.Node
    source: fx.Node
    nbytes: int
    last_read: int


@dataclasses.dataclass(frozen=True)
class _Request:
    """An H2D copy to place: ``nbytes`` needed by ``first_read``; ``key`` names it (a storage's
    root, or a weight's fetch node)."""

    key: fx.Node
    nbytes: int
    first_read: fx.Node


def weight_fetches(gm: fx.GraphModule, resident: set[str] = frozenset()) -> list[WeightFetch]:
    """The streamed weights' fetches of a graph that something reads, unplaced, but those of
    the weights named in ``resident``."""
    order = node_order(gm)
    fetches = []
    for node in gm.graph.find_nodes(op="call_function", target=ops.fetch_weight):
        readers = view_closure(node, order)[1]
        if readers and node.args[0].name not in resident:
            fetches.append(WeightFetch(node, tensor_bytes(node.meta["val"]), readers[0]))
    return fetches


def _last_read(line: _Timeline, source: fx.Node) -> int:
    """Index of the last node reading ``source`` or a view of it, the output aside (the
    source's own index when nothing else reads it)."""
    readers = view_closure(source, line.order)[1]
    return max((line.order[r] for r in readers if r.op != "output"),
               default=line.order[source])


def _outgoing(line: _Timeline, storage: Storage) -> _Outgoing:
    return _Outgoing(storage.root, storage.root, storage.link_bytes,
                     _last_read(line, storage.root))


def _gradients(line: _Timeline) -> list[_Outgoing]:
    """The streamed weights' gradients of the backward, each read last by its ``grad_to_host``
    or by a later compute node."""
    return [_Outgoing(node, node.args[0], tensor_bytes(node.args[0].meta["val"]),
                      _last_read(line, node.args[0]))
            for node in line.nodes if node.target is ops.grad_to_host]


def _d2h(line: _Timeline, copies: Sequence[_Outgoing], required: set[fx.Node],
         ctx: PassContext) -> dict[fx.Node, _Offload | Unplaced]:
    """Earliest-first list scheduling on the D2H lane: each copy is issued as soon as its source
    is produced (after ``HOST_COVER_S`` of queued work), and waited on after the first compute
    node that is predicted to end after the copy and after the source's last read."""
    placed: dict[fx.Node, _Offload | Unplaced] = {}
    lane_free = 0.0
    graph_end = line.compute_end[-1] if line.compute else 0.0
    for copy in sorted(copies, key=lambda c: line.order[c.source]):
        position = line.first_compute_from(line.order[copy.source])
        issue = line.next_cover[position] if position < len(line.compute) else None
        issue = issue or copy.source
        copy_end = max(line.end[issue], lane_free) + ctx.cost.transfer_seconds(copy.nbytes,
                                                                               Lane.D2H)
        after = max(line.first_compute_from(copy.last_read),
                    bisect.bisect_left(line.compute_end, copy_end))
        if after >= len(line.compute) and copy.key not in required:
            placed[copy.key] = Unplaced(Lane.D2H, None, copy_end - graph_end)
            continue
        if after < len(line.compute):
            anchor = line.compute[after]
        else:
            anchor = line.compute[-1] if line.compute else line.nodes[copy.last_read]
        if line.order[anchor] < line.order[issue]:
            anchor = issue
        placed[copy.key] = _Offload(issue, anchor, line.end[anchor] - copy_end)
        lane_free = copy_end
    return placed


class _InFlight:
    """Bytes prefetched but not yet read on the H2D lane, over the copies placed so far
    (``intervals``: issue index, first-read index, bytes; a copy is in flight from its issue up
    to, not including, its read, so one issued at or after its read never is), and their peak
    from an index up to a read at index ``use``. Built once per copy to place (the placed copies
    do not change while it looks for its issue point): each query is then a bisection instead of
    a pass over every placed copy."""

    def __init__(self, intervals: Sequence[tuple[int, int, int]], use: int) -> None:
        live = [(issue, read, nbytes) for issue, read, nbytes in intervals if issue < read]
        self._issues, self._issued = _running_sum([(i, n) for i, _, n in live])
        self._reads, self._read = _running_sum([(r, n) for _, r, n in live])
        self._points = sorted({i for i, _, _ in live if i < use})
        peaks = [self.at(point) for point in self._points]
        self._peak_from = list(itertools.accumulate(reversed(peaks), max))[::-1]

    def at(self, index: int) -> int:
        """Bytes in flight at node ``index``: issued at or before it, read after it."""
        issued = bisect.bisect_right(self._issues, index)
        read = bisect.bisect_right(self._reads, index)
        return (self._issued[issued - 1] if issued else 0) - (self._read[read - 1] if read else 0)

    def peak(self, issue: int) -> int:
        """The most bytes in flight at ``issue`` or at any later issue before the read: they
        rise only where a copy is issued."""
        later = bisect.bisect_left(self._points, issue)
        return max(self.at(issue), self._peak_from[later] if later < len(self._points) else 0)


def _running_sum(points: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """``points`` (index, bytes) sorted by index, as their indices and the bytes summed up to
    and including each."""
    points.sort()
    return [index for index, _ in points], list(itertools.accumulate(n for _, n in points))


def _fits(flight: _InFlight, issue: int, nbytes: int, window: int) -> bool:
    """Whether a prefetch issued at index ``issue`` keeps prefetched-but-unread bytes within the
    window until its read (``flight``'s): checked where they can rise, at its issue and at
    later issues."""
    return flight.peak(issue) + nbytes <= window


def _clear_of(reserved: Sequence[tuple[float, float]], end: float, length: float) -> float:
    """The latest end, at or before ``end``, of a copy of ``length`` seconds that overlaps none
    of the ``reserved`` (start, end) spans of the lane (disjoint, sorted by start)."""
    for start, stop in reversed(reserved):
        if start >= end:
            continue
        if stop <= end - length:
            return end
        end = start
    return end


def _h2d(gm: fx.GraphModule, line: _Timeline, requests: Sequence[_Request],
         required: set[fx.Node], ctx: PassContext) -> dict[fx.Node, _Prefetch | Unplaced]:
    """Latest-first list scheduling on the H2D lane, the copies in ``required`` first: copies
    are taken from the last read to the first, and each is placed to end
    ``PREFETCH_SLACK_FRACTION`` of its duration before its first read, or before the next copy
    on the lane starts, whichever is earlier; it is issued after the last compute node that
    ends before that start. A copy in ``required`` that would pass ``prefetch_window_bytes``
    there is issued later instead, after the first compute node from which it fits (a streamed
    weight waits for room rather than filling the device with the whole model's weights when
    the link cannot keep up). The other copies then take only the lane time the required ones
    leave: a prefetch that hides by pushing a streamed weight's fetch early or late does not
    hide (when the link is the bound, every activation offloaded would otherwise look free
    while the weights it displaced ran late)."""
    inputs_end = max(line.order[n] for n in gm.graph.find_nodes(op="placeholder"))
    placed: dict[fx.Node, _Prefetch | Unplaced] = {}
    intervals, reserved = [], []
    window = ctx.prefetch_window_bytes
    latest_first = sorted(requests, key=lambda r: line.order[r.first_read], reverse=True)
    for placing_required in (True, False):
        lane_start = float("inf")
        reserved.sort()
        for request in latest_first:
            root, use, nbytes = request.key, request.first_read, request.nbytes
            if (root in required) is not placing_required:
                continue
            copy = ctx.cost.transfer_seconds(nbytes, Lane.H2D)
            copy_end = min(line.start[use] - PREFETCH_SLACK_FRACTION * copy, lane_start)
            copy_start = _clear_of(reserved, copy_end, copy) - copy
            position = min(bisect.bisect_right(line.compute_end, copy_start),
                           line.first_compute_from(line.order[use])) - 1
            point = line.compute[position] if position >= 0 else None
            issue = inputs_end if point is None else line.order[point]
            late = max(0.0, -copy_start - PREFETCH_SLACK_FRACTION * copy)
            flight = _InFlight(intervals, line.order[use])
            fits = _fits(flight, issue, nbytes, window)
            if not placing_required and (late > 0 or not fits):
                placed[root] = Unplaced(Lane.H2D, use, late, None if late > 0 else window)
                continue
            last = line.first_compute_from(line.order[use]) - 1
            while not fits and position < last:
                position += 1
                point = line.compute[position]
                issue = line.order[point]
                copy_start = line.end[point]
                fits = _fits(flight, issue, nbytes, window)
            lane_start = max(copy_start, 0.0)
            placed[root] = _Prefetch(point, line.start[use] - (lane_start + copy))
            intervals.append((issue, line.order[use], nbytes))
            if placing_required:
                reserved.append((lane_start, lane_start + copy))
    return placed


@dataclasses.dataclass(frozen=True)
class Placed:
    """What :func:`place` placed."""

    storages: dict[fx.Node, Placement | Unplaced]
    """Each storage's copies, by root, or why they were not placed."""
    fetches: tuple[WeightFetch, ...]
    sends: tuple[GradSend, ...]


MAX_PLACEMENT_ROUNDS = 4
"""Rounds of placing forward then backward copies: a storage whose prefetch cannot hide frees
D2H time for the others, so placement repeats without it until nothing more is dropped."""


def _requests(fetches: Sequence[WeightFetch]) -> list[_Request]:
    return [_Request(f.node, f.nbytes, f.first_read) for f in fetches]


def _placed(fetch: WeightFetch, prefetch: _Prefetch) -> WeightFetch:
    return dataclasses.replace(fetch, issue_after=prefetch.issue, slack_s=prefetch.slack_s)


def place(graphs: StormGraphs, storages: Sequence[Storage], required: set[fx.Node],
          ctx: PassContext) -> Placed:
    """Place the copies of every storage in ``storages`` (by root), of every streamed weight's
    fetch in either graph (but the resident weights'), which share the H2D lane with the
    storages' prefetches, and of every streamed weight's gradient on the backward's D2H lane.
    Storages whose root is in ``required``, and every fetch and gradient, are always placed;
    the other storages only if both their copies are predicted to hide, else they map to why
    not."""
    forward, backward = _Timeline(graphs.forward), _Timeline(graphs.backward)
    resident = {w.name for w in graphs.storages.resident}
    fw_fetches = weight_fetches(graphs.forward, resident)
    bw_fetches = weight_fetches(graphs.backward, resident)
    fetched = {f.node for f in (*fw_fetches, *bw_fetches)}
    dropped: dict[fx.Node, Unplaced] = {}
    for _ in range(MAX_PLACEMENT_ROUNDS):
        candidates = [s for s in storages if s.root not in dropped]
        fw = _d2h(forward, [_outgoing(forward, s) for s in candidates], required, ctx)
        dropped.update({r: why for r, why in fw.items() if isinstance(why, Unplaced)})
        requests = [_Request(s.root, s.link_bytes, s.first_read) for s in candidates
                    if s.root not in dropped] + _requests(bw_fetches)
        bw = _h2d(graphs.backward, backward, requests, required | fetched, ctx)
        late = {r: why for r, why in bw.items() if isinstance(why, Unplaced)}
        dropped.update(late)
        if not late:
            break
    placements: dict[fx.Node, Placement | Unplaced] = dict(dropped)
    for root, prefetch in bw.items():
        if isinstance(prefetch, _Prefetch) and root not in fetched:
            offload = fw[root]
            placements[root] = Placement(offload.issue, offload.wait, prefetch.issue,
                                         offload.slack_s, prefetch.slack_s)
    fw_placed = _h2d(graphs.forward, forward, _requests(fw_fetches), fetched, ctx)
    fetches = tuple([_placed(f, fw_placed[f.node]) for f in fw_fetches]
                    + [_placed(f, bw[f.node]) for f in bw_fetches])
    gradients = _gradients(backward)
    sent = _d2h(backward, gradients, {g.key for g in gradients}, ctx)
    sends = tuple(GradSend(g.key, g.nbytes, sent[g.key].issue, sent[g.key].wait,
                           sent[g.key].slack_s) for g in gradients)
    return Placed(placements, fetches, sends)
