"""Choose the streamed weights that stay on the device.

Assumes: ``plan_memory`` decided every saved storage and ``graphs.plan`` holds the activation
target; the forward reads each streamed weight (a host graph input) through
``storm.fetch_weight``.
Guarantees: ``graphs.storages.resident`` lists the streamed weights kept on the device, chosen
only under a byte ``memory_budget``, in the forward's order of first read (the earliest copies
have the least compute before them to hide under, and the first of all, an embedding's, none),
each one that still fits in the smaller of two rooms:

* what the budget leaves once the device's weights
  (:class:`~storm_compile.streaming.DeviceWeights`), the step's planned activations and the
  other graphs' resident weights are paid (:meth:`StepBudget.left_bytes`);
* what it leaves above this graph's predicted device peak: its device weights (prefetch window
  included) and the simulated peak of the graphs as split, before any copy is placed. A weight
  kept on the device raises the peak by its bytes, and the backward's peak is often above
  what the forward holds at its end.

A resident weight is copied once per optimizer step instead of twice per micro-batch. Without
a byte budget nothing changes; a second run finds no ``fetch_weight`` left of a resident
weight and changes nothing (idempotent).
Emits: no nodes; ``insert_transfers`` reads the list, and the step's ledger records the bytes.
"""

from __future__ import annotations

import dataclasses

from storm_compile import ops
from storm_compile.graphs import PassContext, StormGraphs
from storm_compile.plan import ResidentWeight
from storm_compile.simulate import simulate
from storm_compile.streaming import device_weights
from storm_compile.vocabulary import tensor_bytes


def plan_weights(graphs: StormGraphs, ctx: PassContext) -> StormGraphs:
    budget, plan = ctx.config.memory_budget, graphs.storages
    if not isinstance(budget, int) or plan.resident:
        return graphs
    weights = device_weights(graphs.forward, ctx.config.prefetch_window_bytes)
    if weights is None:
        return graphs
    peak = weights.nbytes + simulate(graphs, ctx.cost).peak_bytes
    room = min(ctx.step.left_bytes(ctx.graph, budget - weights.nbytes), budget - peak)
    resident = []
    fetches = graphs.forward.graph.find_nodes(op="call_function", target=ops.fetch_weight)
    for weight in dict.fromkeys(f.args[0] for f in fetches):
        nbytes = tensor_bytes(weight.meta["val"])
        if nbytes <= room:
            resident.append(ResidentWeight(weight.name, nbytes))
            room -= nbytes
    if not resident:
        return graphs
    ctx.step.keep_resident(ctx.graph, sum(w.nbytes for w in resident))
    return dataclasses.replace(graphs, storages=dataclasses.replace(plan,
                                                                    resident=tuple(resident)))
