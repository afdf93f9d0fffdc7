"""Realise the planner's recompute decisions through AOTAutograd's own partitioner.

Assumes: ``plan_memory`` ran on the partitioner's first split and ``graphs.joint`` is the joint
graph that split came from.
Guarantees: when the plan recomputes nothing, the graphs come back unchanged. Otherwise every
joint-graph node named in ``plan.recompute`` (each recomputed storage's owner, its saved views
and the forward nodes between it and the values that stay saved) is tagged
``meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE`` — the tag selective activation
checkpointing uses — and the joint graph is split again by the same min-cut partitioner, which
then saves none of them and rebuilds them in the backward, ordered the way the autograd engine
would run them. The new pair carries the same ``joint`` and ``plan``; each recomputed storage's owner in
the new forward keeps its ``recompute`` decision (for the schedule's table); otherwise its nodes
carry no storm annotations yet (``annotate_costs``, ``plan_offload`` and ``plan_memory`` run
again on it).
Emits: no storm nodes; the partitioner's recomputation of the tagged nodes in the backward.
"""

from __future__ import annotations

from torch.utils.checkpoint import CheckpointPolicy

from storm_compile.graphs import DECISION_KEY, PassContext, StormGraphs

RECOMPUTE_TAG = "recompute"
"""The ``node.meta`` key the partitioner reads checkpoint policies from."""


def rematerialize(graphs: StormGraphs, ctx: PassContext) -> StormGraphs:
    if graphs.plan is None or not graphs.plan.recompute:
        return graphs
    names = set(graphs.plan.recompute)
    for node in graphs.joint.module.graph.nodes:
        if node.name in names:
            node.meta[RECOMPUTE_TAG] = CheckpointPolicy.MUST_RECOMPUTE
    decided = {n.name: n.meta[DECISION_KEY] for n in graphs.forward.graph.nodes
               if DECISION_KEY in n.meta and n.meta[DECISION_KEY].action == "recompute"}
    forward, backward = graphs.joint.split()
    for node in forward.graph.nodes:
        if node.name in decided:
            node.meta[DECISION_KEY] = decided[node.name]
    return StormGraphs(forward, backward, graphs.num_fwd_outputs, joint=graphs.joint,
                       plan=graphs.plan)
