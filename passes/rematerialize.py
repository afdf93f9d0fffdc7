"""Realise the planner's recompute decisions through AOTAutograd's own partitioner.

Assumes: ``plan_memory`` ran on the partitioner's first split and ``graphs.joint`` is the joint
graph that split came from.
Guarantees: when the plan recomputes nothing, the graphs come back unchanged. Otherwise every
joint-graph node named in ``plan.recompute`` (each recomputed storage's owner, its saved views
and the forward nodes between it and the values that stay saved) is tagged
``meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE`` — the tag selective activation
checkpointing uses — and the joint graph is split again by the same min-cut partitioner, which
then saves none of them and rebuilds them in the backward, ordered the way the autograd engine
would run them. The new pair carries the same ``joint``, ``plan`` (whose ``recomputed`` keeps
the recomputed storages' decisions for the report) and ``share``, and no storage plan yet:
``annotate_costs``, ``plan_offload`` and ``plan_memory`` run again on it.
If the partitioner rejects the tags, they are taken off the joint graph again and
:class:`RecomputeRejectedError` is raised (the pipeline then plans without recomputation).
Emits: no storm nodes; the partitioner's recomputation of the tagged nodes in the backward.
"""

from __future__ import annotations

from torch.utils.checkpoint import CheckpointPolicy

from storm_compile.fx.graphs import PassContext, StormGraphs
from storm_compile.fx.vocabulary import RECOMPUTE_TAG


class RecomputeRejectedError(RuntimeError):
    """The partitioner could not split the joint graph with the planned recompute tags."""


def rematerialize(graphs: StormGraphs, ctx: PassContext) -> StormGraphs:
    if graphs.plan is None or not graphs.plan.recompute:
        return graphs
    names = set(graphs.plan.recompute)
    before = {}
    for node in graphs.joint.module.graph.nodes:
        if node.name in names:
            before[node] = node.meta.get(RECOMPUTE_TAG)
            node.meta[RECOMPUTE_TAG] = CheckpointPolicy.MUST_RECOMPUTE
    try:
        forward, backward = graphs.joint.split()
    except RuntimeError as error:
        for node, tag in before.items():
            if tag is None:
                node.meta.pop(RECOMPUTE_TAG)
            else:
                node.meta[RECOMPUTE_TAG] = tag
        raise RecomputeRejectedError(str(error).strip().splitlines()[0]) from error
    return StormGraphs(forward, backward, graphs.num_fwd_outputs, joint=graphs.joint,
                       plan=graphs.plan, share=graphs.share)
