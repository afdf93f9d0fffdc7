"""Fetch every streamed weight again in the backward instead of saving its device copy.

Assumes: ``joint`` is AOTAutograd's joint forward-backward graph, not yet partitioned; a
streamed weight's reads are ``storm.fetch_weight(host_weight, device)`` nodes
(:mod:`storm_compile.weights.streaming`), followed, for a weight held in a host format, by the plain
ops that rebuild it (:func:`storm_compile.weights.quantize.dequantize`).
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

from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from storm_compile.fx.vocabulary import RECOMPUTE_TAG, is_constant, rebuilds_weight
from storm_compile.runtime import ops


def refetch_weights(joint: fx.GraphModule) -> fx.GraphModule:
    fetched: set[fx.Node] = set()
    constants: set[fx.Node] = set()
    for node in joint.graph.nodes:
        if node.target is ops.fetch_weight or rebuilds_weight(node, fetched, constants):
            fetched.add(node)
            node.meta[RECOMPUTE_TAG] = CheckpointPolicy.MUST_RECOMPUTE
        elif is_constant(node, constants):
            constants.add(node)
    return joint
