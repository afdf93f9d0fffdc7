"""Place each planned transfer on the predicted timeline.

Assumes: ``annotate_costs`` gave every node its compute time; ``plan_memory`` decided which
storages are offloaded (``Action.OFFLOAD`` in ``graphs.storages``).
Guarantees: every offload decision carries a :class:`~storm_compile.fx.plan.Placement`, made by
:func:`storm_compile.cost.placement.place` with every offload required (nothing is dropped: the
planner decided, this pass only places): ``offload_after`` (the forward node after which the
D2H copy is issued), ``wait_after`` (the forward node after which the compute stream waits on
it), ``prefetch_after`` (the backward node after which the prefetch is issued; None for right
after the graph inputs) and the predicted slack of both copies (positive: hidden). Other
decisions are unchanged. ``graphs.storages.fetches`` holds every streamed weight's fetch of
either graph (a ``storm.fetch_weight`` node that something reads), each with the node after
which its copy is issued: placed latest-first on the H2D lane, in the backward together with
the storages' prefetches, ending ``PREFETCH_SLACK_FRACTION`` of its copy time before its first
read where the lane allows. ``graphs.storages.sends`` holds every streamed weight's gradient
of the backward (a ``storm.grad_to_host`` node), each with the node after which its copy home
is issued (as soon as the gradient is produced) and the node after which the compute stream
waits for it, on the D2H lane in production order.
Emits: no nodes; only decisions change.
"""

from __future__ import annotations

import dataclasses

from storm_compile.cost.placement import place
from storm_compile.fx.graphs import PassContext, StormGraphs
from storm_compile.fx.plan import Action


def place_transfers(graphs: StormGraphs, ctx: PassContext) -> StormGraphs:
    plan = graphs.storages
    offloads = plan.with_action(Action.OFFLOAD)
    placed = place(graphs, offloads, {s.root for s in offloads}, ctx)
    plan = plan.decided({
        s.root: dataclasses.replace(plan.decisions[s.root], placement=placed.storages[s.root])
        for s in offloads})
    return dataclasses.replace(graphs, storages=dataclasses.replace(
        plan, fetches=placed.fetches, sends=placed.sends))
