"""Place each planned transfer on the predicted timeline, and drop the ones that would not hide.

Assumes: ``annotate_costs`` gave every node its compute time; ``plan_offload`` marked the
storages that may be offloaded.
Guarantees: every ``offload`` decision carries ``offload_after`` (the forward node after which
the D2H copy is issued: the storage's producer, or the first later node long enough to cover
the op's host cost, ``HOST_COVER_S``), ``wait_after`` (the forward node after which the
compute stream waits on the copy: the first node, at or after the storage's last forward use,
whose predicted end is at or after the copy's predicted end) and ``prefetch_after`` (the
backward node after which the prefetch is issued, None for right after the graph inputs: the
latest point that leaves ``PREFETCH_SLACK_FRACTION`` of the copy time as slack before its first
read and before the next copy on the lane). Copies queue on their lane in order: D2H copies by
production order, H2D copies by first read (the first node reading the data; views of it do
not count). With ``offload="hidden"`` a storage whose D2H copy would end after the forward's last
compute node, whose H2D copy would end after its first backward read, or whose prefetch would
hold more than ``prefetch_window_bytes`` of prefetched-but-unread tensors, is turned back to
``keep`` with the figures in its reason; with ``offload="all"`` it stays and the compute stream
will wait.
Every placed decision's reason gives the predicted slack of both copies (positive: hidden).
Emits: no nodes; only decisions change.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from torch import fx

from storm_compile.graphs import (
    COST_KEY,
    DECISION_KEY,
    OffloadDecision,
    PassContext,
    StormGraphs,
    alias_root,
    backward_placeholder,
    is_view,
    saved_values,
    view_closure,
)

US = 1e6


def _timeline(gm: fx.GraphModule
              ) -> tuple[list[fx.Node], dict[fx.Node, float], dict[fx.Node, float]]:
    nodes, start, end, t = list(gm.graph.nodes), {}, {}, 0.0
    for node in nodes:
        start[node] = t
        t += node.meta[COST_KEY].compute_s
        end[node] = t
    return nodes, start, end


def _keep(members: list[fx.Node], reason: str) -> None:
    for node in members:
        node.meta[DECISION_KEY] = dataclasses.replace(node.meta[DECISION_KEY], action="keep",
                                                      reason=reason)


def _place(members: list[fx.Node], **placement) -> None:
    for node in members:
        node.meta[DECISION_KEY] = dataclasses.replace(node.meta[DECISION_KEY], **placement)


def _schedule_forward(graphs: StormGraphs, groups: dict[fx.Node, list[fx.Node]],
                      ctx: PassContext) -> None:
    nodes, _, end = _timeline(graphs.forward)
    order = {n: i for i, n in enumerate(nodes)}
    compute = [n for n in nodes if n.meta[COST_KEY].is_compute]
    lane_free = 0.0
    for root in sorted(groups, key=order.__getitem__):
        decision: OffloadDecision = root.meta[DECISION_KEY]
        issue = next((n for n in compute if order[n] >= order[root]
                      and n.meta[COST_KEY].compute_s >= HOST_COVER_S), root)
        copy_end = max(end[issue], lane_free) + ctx.cost.transfer_seconds(
            decision.storage_bytes, "d2h")
        last_use = max((order[u] for n in nodes if alias_root(n) is root for u in n.users
                        if u.op != "output" and not is_view(u)), default=order[root])
        later = [n for n in compute if order[n] >= last_use]
        hidden = [n for n in later if end[n] >= copy_end]
        if not hidden and ctx.config.offload == "hidden":
            forward_end = end[compute[-1]] if compute else 0.0
            _keep(groups[root] + [root], f"D2H copy would end {(copy_end - forward_end) * US:.0f} "
                                         f"µs after the forward's last compute node")
            continue
        anchor = hidden[0] if hidden else (later[-1] if later else nodes[last_use])
        if order[anchor] < order[issue]:
            anchor = issue
        _place(groups[root] + [root], offload_after=issue.name, wait_after=anchor.name,
               reason=f"D2H slack {(end[anchor] - copy_end) * US:+.0f} µs")
        lane_free = copy_end


HOST_COVER_S = 100e-6
"""An offload is issued after the first node, from its producer on, predicted to keep the GPU
busy this long: the op's host-side work (pool lookup, copy launch; ~100 µs measured under the
profiler) then runs while that kernel does, instead of leaving an idle GPU waiting for the next
launch, which happens early in the forward when little work is queued."""

PREFETCH_SLACK_FRACTION = 0.5
"""A prefetch is issued as late as still leaves this fraction of its copy time as predicted
slack before first use: late enough that its host-side cost lands while the GPU has queued work
(at the start of the backward the GPU has none), early enough to absorb a link 1.5x slower than
the profile says."""


def _in_flight(intervals: list[tuple[int, int, int]], at: int) -> int:
    return sum(nbytes for issue, use, nbytes in intervals if issue <= at < use)


def _fits(intervals: list[tuple[int, int, int]], issue: int, use: int, nbytes: int,
          window: int) -> bool:
    """Whether a prefetch issued at index ``issue`` and read at ``use`` keeps prefetched-but-unread
    bytes within the window: checked where they can rise, at its issue and at later issues."""
    checks = [issue] + [i for i, _, _ in intervals if issue <= i < use]
    return all(_in_flight(intervals, q) + nbytes <= window for q in checks)


def _schedule_backward(graphs: StormGraphs, groups: dict[fx.Node, list[fx.Node]],
                       ctx: PassContext) -> None:
    """Latest-first list scheduling on the H2D lane: storages are taken from the last read to
    the first, and each copy is placed to end ``PREFETCH_SLACK_FRACTION`` of its duration before
    its first read, or before the next copy on the lane starts, whichever is earlier; it is
    issued after the last compute node that ends before that start."""
    nodes, start, end = _timeline(graphs.backward)
    order = {n: i for i, n in enumerate(nodes)}
    inputs_end = max(order[n] for n in graphs.backward.graph.find_nodes(op="placeholder"))
    compute = [n for n in nodes if n.meta[COST_KEY].is_compute]
    first_read = {root: min((r for m in members
                             for r in view_closure(backward_placeholder(graphs, m))[1]),
                            key=order.__getitem__) for root, members in groups.items()}
    lane_start, intervals = float("inf"), []
    window = ctx.config.prefetch_window_bytes
    for root in sorted(groups, key=lambda r: order[first_read[r]], reverse=True):
        decision: OffloadDecision = root.meta[DECISION_KEY]
        use, nbytes = first_read[root], decision.storage_bytes
        copy = ctx.cost.transfer_seconds(nbytes, "h2d")
        copy_start = min(start[use] - PREFETCH_SLACK_FRACTION * copy, lane_start) - copy
        point = next((n for n in reversed(compute)
                      if order[n] < order[use] and end[n] <= copy_start), None)
        issue = inputs_end if point is None else order[point]
        late = max(0.0, -copy_start - PREFETCH_SLACK_FRACTION * copy)
        fits = _fits(intervals, issue, order[use], nbytes, window)
        if ctx.config.offload == "hidden" and (late > 0 or not fits):
            reason = (f"H2D copy would end {late * US:.0f} µs after its first backward read "
                      f"({use.name})" if late > 0 else
                      f"prefetch window ({window} bytes) full before its first backward read "
                      f"({use.name})")
            _keep(groups[root] + [root], reason)
            continue
        slack = start[use] - (max(copy_start, 0.0) + copy)
        _place(groups[root] + [root], prefetch_after=None if point is None else point.name,
               reason=f"{decision.reason}, H2D slack {slack * US:+.0f} µs")
        lane_start = max(copy_start, 0.0)
        intervals.append((issue, order[use], nbytes))


def _offload_groups(graphs: StormGraphs) -> dict[fx.Node, list[fx.Node]]:
    groups: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    for node in saved_values(graphs):
        if node.meta[DECISION_KEY].action == "offload":
            groups[alias_root(node)].append(node)
    return groups


def schedule_transfers(graphs: StormGraphs, ctx: PassContext) -> StormGraphs:
    _schedule_forward(graphs, _offload_groups(graphs), ctx)
    _schedule_backward(graphs, _offload_groups(graphs), ctx)
    return graphs
