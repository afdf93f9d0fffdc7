"""Place each planned transfer on the predicted timeline.

Assumes: ``annotate_costs`` gave every node its compute time; ``plan_memory`` decided which
storages are offloaded (``action == "offload"``).
Guarantees: every ``offload`` decision carries ``offload_after`` (the forward node after which
the D2H copy is issued: the storage's producer, or the first later node long enough to cover
the op's host cost, ``HOST_COVER_S``), ``wait_after`` (the forward node after which the compute
stream waits on the copy: the first compute node, at or after the storage's last forward read,
whose predicted end is at or after the copy's predicted end, else the last one) and
``prefetch_after`` (the backward node after which the prefetch is issued, None for right after
the graph inputs: the latest point that leaves ``PREFETCH_SLACK_FRACTION`` of the copy time as
slack before its first read and before the next copy on the lane). Copies queue on their lane in
order: D2H copies by production order, H2D copies by first read (the first node reading the
data; views of it do not count). Every decision's reason gains the predicted slack of both
copies (positive: hidden). Nothing is dropped: the planner decided, this pass only places.
Emits: no nodes; only decisions change.

:func:`place` is the same placement as a query: the planner asks it which of a set of optional
storages would hide beside the required ones.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import defaultdict

from torch import fx

from storm_compile.graphs import (
    COST_KEY,
    DECISION_KEY,
    PassContext,
    StormGraphs,
    alias_root,
    first_backward_read,
    saved_values,
    view_closure,
)

US = 1e6

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


@dataclasses.dataclass(frozen=True)
class Placement:
    offload_after: str
    wait_after: str
    prefetch_after: str | None
    d2h_slack_s: float
    h2d_slack_s: float


class _Timeline:
    """A graph's nodes in order with predicted start/end, and its compute nodes for bisection."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.nodes = list(gm.graph.nodes)
        self.order = {n: i for i, n in enumerate(self.nodes)}
        self.start, self.end, t = {}, {}, 0.0
        for node in self.nodes:
            self.start[node] = t
            t += node.meta[COST_KEY].compute_s
            self.end[node] = t
        self.compute = [n for n in self.nodes if n.meta[COST_KEY].is_compute]
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


def storage_groups(graphs: StormGraphs, action: str | None = None) -> dict[fx.Node, list[fx.Node]]:
    """Saved values by the forward node owning their storage; with ``action``, only the
    storages whose decision has that action."""
    groups: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    for node in saved_values(graphs):
        decision = node.meta.get(DECISION_KEY)
        if action is None or (decision is not None and decision.action == action):
            groups[alias_root(node)].append(node)
    return groups


def _forward(line: _Timeline, groups: dict[fx.Node, list[fx.Node]], required: set[fx.Node],
             ctx: PassContext) -> dict[fx.Node, tuple | str]:
    placed: dict[fx.Node, tuple | str] = {}
    lane_free = 0.0
    forward_end = line.compute_end[-1] if line.compute else 0.0
    for root in sorted(groups, key=line.order.__getitem__):
        position = line.first_compute_from(line.order[root])
        issue = line.next_cover[position] if position < len(line.compute) else None
        issue = issue or root
        nbytes = root.meta[DECISION_KEY].storage_bytes
        copy_end = max(line.end[issue], lane_free) + ctx.cost.transfer_seconds(nbytes, "d2h")
        readers = view_closure(root, line.order)[1]
        last_read = max((line.order[r] for r in readers if r.op != "output"),
                        default=line.order[root])
        after = max(line.first_compute_from(last_read),
                    bisect.bisect_left(line.compute_end, copy_end))
        if after >= len(line.compute) and root not in required:
            placed[root] = (f"D2H copy would end {(copy_end - forward_end) * US:.0f} µs after "
                            f"the forward's last compute node")
            continue
        if after < len(line.compute):
            anchor = line.compute[after]
        else:
            anchor = line.compute[-1] if line.compute else line.nodes[last_read]
        if line.order[anchor] < line.order[issue]:
            anchor = issue
        placed[root] = (issue.name, anchor.name, line.end[anchor] - copy_end)
        lane_free = copy_end
    return placed


def _in_flight(intervals: list[tuple[int, int, int]], at: int) -> int:
    return sum(nbytes for issue, use, nbytes in intervals if issue <= at < use)


def _fits(intervals: list[tuple[int, int, int]], issue: int, use: int, nbytes: int,
          window: int) -> bool:
    """Whether a prefetch issued at index ``issue`` and read at ``use`` keeps prefetched-but-unread
    bytes within the window: checked where they can rise, at its issue and at later issues."""
    checks = [issue] + [i for i, _, _ in intervals if issue <= i < use]
    return all(_in_flight(intervals, q) + nbytes <= window for q in checks)


def _backward(graphs: StormGraphs, line: _Timeline, groups: dict[fx.Node, list[fx.Node]],
              required: set[fx.Node], ctx: PassContext) -> dict[fx.Node, tuple | str]:
    """Latest-first list scheduling on the H2D lane: storages are taken from the last read to
    the first, and each copy is placed to end ``PREFETCH_SLACK_FRACTION`` of its duration before
    its first read, or before the next copy on the lane starts, whichever is earlier; it is
    issued after the last compute node that ends before that start."""
    inputs_end = max(line.order[n] for n in graphs.backward.graph.find_nodes(op="placeholder"))
    first_read = {root: first_backward_read(graphs, members, line.order)
                  for root, members in groups.items()}
    placed: dict[fx.Node, tuple | str] = {}
    lane_start, intervals = float("inf"), []
    window = ctx.config.prefetch_window_bytes
    for root in sorted(groups, key=lambda r: line.order[first_read[r]], reverse=True):
        use, nbytes = first_read[root], root.meta[DECISION_KEY].storage_bytes
        copy = ctx.cost.transfer_seconds(nbytes, "h2d")
        copy_start = min(line.start[use] - PREFETCH_SLACK_FRACTION * copy, lane_start) - copy
        position = min(bisect.bisect_right(line.compute_end, copy_start),
                       line.first_compute_from(line.order[use])) - 1
        point = line.compute[position] if position >= 0 else None
        issue = inputs_end if point is None else line.order[point]
        late = max(0.0, -copy_start - PREFETCH_SLACK_FRACTION * copy)
        if root not in required and (late > 0 or not _fits(intervals, issue, line.order[use],
                                                           nbytes, window)):
            placed[root] = (f"H2D copy would end {late * US:.0f} µs after its first backward "
                            f"read ({use.name})" if late > 0 else
                            f"prefetch window ({window} bytes) full before its first backward "
                            f"read ({use.name})")
            continue
        lane_start = max(copy_start, 0.0)
        placed[root] = (None if point is None else point.name,
                        line.start[use] - (lane_start + copy))
        intervals.append((issue, line.order[use], nbytes))
    return placed


MAX_PLACEMENT_ROUNDS = 4
"""Rounds of placing forward then backward copies: a storage whose prefetch cannot hide frees
D2H time for the others, so placement repeats without it until nothing more is dropped."""


def place(graphs: StormGraphs, groups: dict[fx.Node, list[fx.Node]], required: set[fx.Node],
          ctx: PassContext) -> dict[fx.Node, Placement | str]:
    """Place the copies of every storage in ``groups`` (roots carry decisions with their bytes).
    Storages in ``required`` are always placed; the others only if both copies are predicted to
    hide, else they map to the reason they would not."""
    forward, backward = _Timeline(graphs.forward), _Timeline(graphs.backward)
    dropped: dict[fx.Node, str] = {}
    for _ in range(MAX_PLACEMENT_ROUNDS):
        candidates = {r: m for r, m in groups.items() if r not in dropped}
        fw = _forward(forward, candidates, required, ctx)
        dropped.update({r: why for r, why in fw.items() if isinstance(why, str)})
        bw = _backward(graphs, backward, {r: m for r, m in candidates.items() if r not in dropped},
                       required, ctx)
        late = {r: why for r, why in bw.items() if isinstance(why, str)}
        dropped.update(late)
        if not late:
            break
    placements: dict[fx.Node, Placement | str] = dict(dropped)
    for root, placed in bw.items():
        if not isinstance(placed, str):
            offload_after, wait_after, d2h_slack = fw[root]
            placements[root] = Placement(offload_after, wait_after, placed[0], d2h_slack,
                                         placed[1])
    return placements


def schedule_transfers(graphs: StormGraphs, ctx: PassContext) -> StormGraphs:
    groups = storage_groups(graphs, "offload")
    for root, placement in place(graphs, groups, set(groups), ctx).items():
        reason = (f"{root.meta[DECISION_KEY].reason}; D2H slack {placement.d2h_slack_s * US:+.0f}"
                  f" µs, H2D slack {placement.h2d_slack_s * US:+.0f} µs")
        for node in (root, *groups[root]):
            node.meta[DECISION_KEY] = dataclasses.replace(
                node.meta[DECISION_KEY], offload_after=placement.offload_after,
                wait_after=placement.wait_after, prefetch_after=placement.prefetch_after,
                reason=reason)
    return graphs
