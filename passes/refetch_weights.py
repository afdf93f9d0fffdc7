"""Fetch every streamed weight again in the backward instead of saving its device copy.

Assumes: ``joint`` is AOTAutograd's joint forward-backward graph, not yet partitioned; a
streamed weight's reads are ``storm.fetch_weight(host_weight, device)`` nodes
(:mod:`storm_compile.streaming`).
Guarantees: every ``storm.fetch_weight`` node carries ``meta["recompute"] =
CheckpointPolicy.MUST_RECOMPUTE``, the tag selective activation checkpointing uses, so the
partitioner never saves a weight's device copy for the backward and fetches it again where the
backward first needs it; no node is added, removed or moved. Running it again changes nothing;
a graph with no fetch comes back as it was.
Emits: no node; the recompute tag on each ``storm.fetch_weight``.
"""

from __future__ import annotations

from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from storm_compile import ops
from storm_compile.vocabulary import RECOMPUTE_TAG


def refetch_weights(joint: fx.GraphModule) -> fx.GraphModule:
    for node in joint.graph.find_nodes(op="call_function", target=ops.fetch_weight):
        node.meta[RECOMPUTE_TAG] = CheckpointPolicy.MUST_RECOMPUTE
    return joint
