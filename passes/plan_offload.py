"""Decide, for every value saved for the backward, whether its storage may leave the device
(be offloaded to pinned host memory, or recomputed) or must stay.

The unit is a storage: the saved values that share one (a tensor and its views, or several views
of one buffer, such as q, k and v split from a fused QKV projection) are decided together, since
the device memory is freed only when none of them is held any more. This pass says which
storages *may* move (``action == "offload"``); ``plan_memory`` then decides what each one does.

Assumes: ``annotate_costs`` ran; the graphs are a partitioner's forward/backward pair.
Guarantees: ``graphs.storages`` is a new :class:`~storm_compile.fx.plan.StoragePlan` holding one
:class:`~storm_compile.fx.plan.Storage` per storage saved for the backward, in the order of the
saved values, each with its :class:`~storm_compile.fx.plan.Eligibility`. A storage is movable
only when it is owned by a forward op (not a graph input or a storm transfer), no user-visible
output shares it, it is not an output of a higher-order op (the RNG state of a checkpointed
region), it is dense and non-empty at the traced sizes, on a CUDA device (any device with
``transfer_cpu_tensors``), at least ``min_offload_bytes``, read by the backward, and every saved
view of it can be rebuilt in the backward from the storage alone; otherwise the first
:class:`~storm_compile.fx.plan.Rule` it breaks is recorded. Every decision is ``keep`` for the
storages that must stay and ``offload`` (a candidate: ``plan_memory`` decides) for the others.
Emits: no nodes; the graphs are not changed.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Container

import torch
from torch import fx

from storm_compile.fx.graphs import (
    COST_KEY,
    PassContext,
    StormGraphs,
    backward_inputs,
    first_backward_read,
    model_outputs,
    saved_values,
)
from storm_compile.fx.plan import (
    MOVABLE,
    Action,
    Decision,
    Eligibility,
    Rule,
    Storage,
    StoragePlan,
)
from storm_compile.fx.fp8 import link_bytes
from storm_compile.fx.torch_private import HigherOrderOperator
from storm_compile.fx.vocabulary import (
    hint,
    is_dense,
    is_transfer,
    node_order,
    storage_owner,
    view_chain,
)


def _replayable(member: fx.Node, saved: Container[fx.Node]) -> bool:
    """Whether the member's view chain uses nothing but the storage, constants and symbolic
    sizes that are themselves saved for the backward (so the backward has them as inputs)."""
    for view in view_chain(member):
        operands: list[fx.Node] = []
        fx.node.map_arg((view.args[1:], view.kwargs), operands.append)
        if any(n not in saved or not isinstance(n.meta.get("val"), torch.SymInt)
               for n in operands):
            return False
    return True


def _higher_order_output(root: fx.Node) -> bool:
    source = root.args[0] if root.target is operator.getitem else root
    return isinstance(getattr(source, "target", None), HigherOrderOperator)


def _eligibility(root: fx.Node, members: list[fx.Node], ctx: PassContext,
                 visible_roots: set[fx.Node], inputs: dict[fx.Node, fx.Node]) -> Eligibility:
    """Whether the storage owned by ``root`` may leave its device, or the rule that keeps it."""
    val = root.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return Eligibility(Rule.NOT_TENSOR)
    if _higher_order_output(root):
        return Eligibility(Rule.HIGHER_ORDER_OUTPUT)
    if root.op == "placeholder":
        return Eligibility(Rule.GRAPH_INPUT)
    if is_transfer(root):
        return Eligibility(Rule.TRANSFERRED)
    if root in visible_roots:
        return Eligibility(Rule.VISIBLE_OUTPUT)
    if hint(val.numel()) == 0:
        return Eligibility(Rule.EMPTY)
    if val.device.type != "cuda" and not ctx.config.transfer_cpu_tensors:
        return Eligibility(Rule.NOT_ON_CUDA, val.device.type)
    if not is_dense(val):
        return Eligibility(Rule.NOT_DENSE)
    if root.meta[COST_KEY].output_bytes < ctx.config.min_offload_bytes:
        return Eligibility(Rule.BELOW_MIN_BYTES, ctx.config.min_offload_bytes)
    if not any(inputs[m].users for m in members):
        return Eligibility(Rule.NOT_READ)
    if not all(_replayable(m, inputs) for m in members):
        return Eligibility(Rule.VIEW_DEPENDS)
    return MOVABLE


def plan_offload(graphs: StormGraphs, ctx: PassContext) -> StormGraphs:
    visible_roots = {storage_owner(n) for n in model_outputs(graphs)}
    groups: dict[fx.Node, list[fx.Node]] = {}
    for node in saved_values(graphs):
        groups.setdefault(storage_owner(node), []).append(node)
    order, inputs = node_order(graphs.backward), backward_inputs(graphs)
    storages, decisions = [], {}
    for root, members in groups.items():
        eligibility = _eligibility(root, members, ctx, visible_roots, inputs)
        cost = root.meta.get(COST_KEY)
        nbytes = cost.output_bytes if cost else 0
        storages.append(Storage(
            root=root, members=tuple(members), nbytes=nbytes,
            link_bytes=link_bytes(root.meta.get("val"), nbytes, ctx.config.offload_format),
            first_read=first_backward_read(inputs, members, order)
            if eligibility.movable else None,
            eligibility=eligibility))
        decisions[root] = Decision(Action.OFFLOAD if eligibility.movable else Action.KEEP,
                                   eligibility)
    return dataclasses.replace(graphs, storages=StoragePlan(tuple(storages), decisions))
