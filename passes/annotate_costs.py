"""Annotate every node of both graphs with its :class:`~storm_compile.fx.graphs.NodeCost`.

Assumes: nodes carry ``meta["val"]`` (fake tensors), as AOTAutograd leaves them.
Guarantees: every node has ``meta[COST_KEY]``: its output bytes, whether it runs on the compute
stream, and its predicted compute time from ``ctx.cost``; the graphs are otherwise untouched.
Emits: no nodes.
"""

from __future__ import annotations

from storm_compile.fx.graphs import COST_KEY, NodeCost, PassContext, StormGraphs
from storm_compile.fx.vocabulary import is_compute, tensor_bytes


def annotate_costs(graphs: StormGraphs, ctx: PassContext) -> StormGraphs:
    for gm in (graphs.forward, graphs.backward):
        for node in gm.graph.nodes:
            computes = is_compute(node)
            node.meta[COST_KEY] = NodeCost(
                output_bytes=tensor_bytes(node.meta.get("val")), is_compute=computes,
                compute_s=ctx.cost.compute_seconds(node) if computes else 0.0)
    return graphs
