"""Choose the weights kept on the device whose gradients are summed there across a step's
backwards.

Assumes: ``graphs.storages.resident`` lists the weights kept on the device in the forward's order
of first read, and ``insert_transfers`` ran: each streamed weight's gradient goes home through
``storm.accumulate_grad(h, w)``; ``ctx.resident_room`` is the device memory the byte budget
leaves above the plan's predicted device peak
(:func:`~storm_compile.cost.simulate.device_bytes`, which counts the sums).
Guarantees: in that order, each resident weight whose gradient goes home and whose gradient's
bytes (the weight's) still fit in the room, and in what the budget leaves beside the step's
graphs (:meth:`StepView.left_bytes`; this graph's inputs on the device less its resident
weights, which its ``share`` counts), is ``summed``
(:class:`~storm_compile.fx.plan.ResidentWeight`), and ``graphs.share.resident_bytes`` counts its
sum: the sum stays on the device between backwards. With no room, or no resident weight, nothing
changes; a second run finds the room taken (idempotent).
Emits: no nodes; ``insert_transfers``, run again, gives the send of each summed weight's gradient
its weight.
"""

from __future__ import annotations

import dataclasses

from storm_compile.fx.graphs import PassContext, StormGraphs
from storm_compile.runtime import ops
from storm_compile.weights.streaming import device_weights


def plan_gradient_sums(graphs: StormGraphs, ctx: PassContext) -> StormGraphs:
    budget, plan = ctx.memory_budget.nbytes, graphs.storages
    if budget is None or not plan.resident:
        return graphs
    sent = {n.args[1].name for n in graphs.backward.graph.find_nodes(
        op="call_function", target=ops.accumulate_grad)}
    kept = sum(w.nbytes for w in plan.resident)     # inputs of the graph, and in its share
    inputs = device_weights(graphs.forward, ctx.prefetch_window_bytes).resident_bytes - kept
    room = min(ctx.others.left_bytes(budget - inputs, graphs.share), ctx.resident_room)
    resident = list(plan.resident)
    for index, weight in enumerate(resident):
        if not weight.summed and weight.name in sent and weight.nbytes <= room:
            resident[index] = dataclasses.replace(weight, summed=True)
            room -= weight.nbytes
    if resident == list(plan.resident):
        return graphs
    share = dataclasses.replace(graphs.share,
                                resident_bytes=sum(w.device_bytes for w in resident))
    return dataclasses.replace(graphs, share=share, storages=dataclasses.replace(
        plan, resident=tuple(resident)))
