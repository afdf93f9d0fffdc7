"""Fetch every streamed weight again in the backward instead of saving its device copy.

Assumes: ``joint`` is AOTAutograd's joint forward-backward graph, not yet partitioned; a
streamed weight's reads are ``storm.fetch_weight(host_weight, device)`` nodes
(:mod:`storm_compile.streaming`), followed, for a weight held in a host format, by the plain
ops that rebuild it (:func:`storm_compile.quantize.dequantize`).
Guarantees: every ``storm.fetch_weight`` node, and every node computed only from fetched
weights and constants by an op without a FLOP formula (the ops that rebuild a packed weight,
casts, views), carries ``meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE``, the tag
selective activation checkpointing uses, so the partitioner never saves a weight's device copy,
packed or rebuilt, for the backward and fetches and rebuilds it again where the backward first
needs it; no node is added, removed or moved. Running it again changes nothing; a graph with no
fetch comes back as it was.
Emits: no node; the recompute tag on each ``storm.fetch_weight`` and the nodes that rebuild
what it fetched.
"""

from __future__ import annotations

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy
from torch.utils.flop_counter import flop_registry

from storm_compile import ops
from storm_compile.torch_private import OpOverload
from storm_compile.vocabulary import RECOMPUTE_TAG


def _constant(node: fx.Node, constants: set[fx.Node]) -> bool:
    """Whether ``node`` is a constant of the graph (a ``get_attr``, such as a code book), or
    made from constants alone by an op that draws no random numbers."""
    if node.op == "get_attr":
        return True
    return (node.op == "call_function" and isinstance(node.target, OpOverload)
            and torch.Tag.nondeterministic_seeded not in node.target.tags
            and all(i in constants for i in node.all_input_nodes))


def _rebuilds_weight(node: fx.Node, fetched: set[fx.Node], constants: set[fx.Node]) -> bool:
    """Whether ``node`` computes only from fetched weights and constants, cheaply."""
    inputs = node.all_input_nodes
    return (node.op == "call_function" and any(i in fetched for i in inputs)
            and all(i in fetched or i in constants for i in inputs)
            and getattr(node.target, "overloadpacket", None) not in flop_registry)


def refetch_weights(joint: fx.GraphModule) -> fx.GraphModule:
    fetched: set[fx.Node] = set()
    constants: set[fx.Node] = set()
    for node in joint.graph.nodes:
        if node.target is ops.fetch_weight or _rebuilds_weight(node, fetched, constants):
            fetched.add(node)
            node.meta[RECOMPUTE_TAG] = CheckpointPolicy.MUST_RECOMPUTE
        elif _constant(node, constants):
            constants.add(node)
    return joint
