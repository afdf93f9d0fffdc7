"""Choose the streamed weights that stay on the device.

Assumes: ``plan_memory`` decided every saved storage and ``graphs.plan`` holds the activation
target; the forward reads each streamed weight (a host graph input) through
``storm.fetch_weight``; ``ctx.resident_room`` is what the byte budget left above the predicted
device peak of this graph's plan without resident weights (the pipeline measures it on that
plan, placed and rewritten, and plans again with it).
Guarantees: ``graphs.storages.resident`` lists the streamed weights kept on the device, chosen
only under a byte ``memory_budget``, in the forward's order of first read (the earliest copies
have the least compute before them to hide under, and the first of all, an embedding's, none),
each one that still fits in the smaller of ``ctx.resident_room`` and what the user's budget (as
storm plans it, :attr:`MemoryBudget.planned`) leaves once the step's planned activations and
resident weights, and this graph's resident inputs, are paid (:meth:`StepView.left_bytes`, with
``graphs.share``). The search's lower budget (``Limits.budget_bytes``) aims the activations
alone: a plan that trades activations for weights kept gets the room its activations freed. A
weight kept on the device is held there once, and cloned while a graph reads it. A resident
weight is copied once per optimizer step instead of twice per micro-batch. With no room nothing
changes; a second run finds no ``fetch_weight`` left of a resident weight and changes nothing
(idempotent).
Emits: no nodes; ``insert_transfers`` reads the list, and ``graphs.share`` holds the bytes.
"""

from __future__ import annotations

import dataclasses

from storm_compile.fx.graphs import PassContext, StormGraphs
from storm_compile.fx.plan import ResidentWeight
from storm_compile.fx.vocabulary import tensor_bytes
from storm_compile.runtime import ops
from storm_compile.weights.streaming import device_weights


def plan_weights(graphs: StormGraphs, ctx: PassContext) -> StormGraphs:
    budget, plan = ctx.config.memory_budget.planned.nbytes, graphs.storages
    if budget is None or plan.resident:
        return graphs
    weights = device_weights(graphs.forward, ctx.prefetch_window_bytes)
    if not weights.streams or ctx.resident_room <= 0:
        return graphs
    room = min(ctx.others.left_bytes(budget - weights.resident_bytes, graphs.share),
               ctx.resident_room)
    resident = []
    fetches = graphs.forward.graph.find_nodes(op="call_function", target=ops.fetch_weight)
    for weight in dict.fromkeys(f.args[0] for f in fetches):
        nbytes = tensor_bytes(weight.meta["val"])
        if nbytes <= room:
            resident.append(ResidentWeight(weight.name, nbytes))
            room -= nbytes
    if not resident:
        return graphs
    share = dataclasses.replace(graphs.share, resident_bytes=sum(w.nbytes for w in resident))
    return dataclasses.replace(graphs, share=share, storages=dataclasses.replace(
        plan, resident=tuple(resident)))
