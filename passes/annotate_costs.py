"""Annotate every node of both graphs with its :class:`~storm_compile.graphs.NodeCost`.

Assumes: nodes carry ``meta["val"]`` (fake tensors), as AOTAutograd leaves them.
Guarantees: every node has ``meta[COST_KEY]``: its output bytes, whether it runs on the compute
stream, and its predicted compute time from ``ctx.cost``; the graphs are otherwise untouched.
Emits: no nodes.
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch.utils._pytree import tree_leaves

from storm_compile.graphs import COST_KEY, NodeCost, PassContext, StormGraphs, is_transfer, is_view


def _output_bytes(node: fx.Node) -> int:
    total = 0
    for value in tree_leaves(node.meta.get("val")):
        if isinstance(value, torch.Tensor):
            nbytes = value.numel() * value.element_size()
            total += nbytes if isinstance(nbytes, int) else 0
    return total


def _is_compute(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target is not operator.getitem
            and not is_view(node) and not is_transfer(node))


def annotate_costs(graphs: StormGraphs, ctx: PassContext) -> StormGraphs:
    for gm in (graphs.forward, graphs.backward):
        for node in gm.graph.nodes:
            is_compute = _is_compute(node)
            node.meta[COST_KEY] = NodeCost(
                output_bytes=_output_bytes(node), is_compute=is_compute,
                compute_s=ctx.cost.compute_seconds(node) if is_compute else 0.0)
    return graphs
