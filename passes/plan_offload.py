"""Decide, for every value saved for the backward, whether its storage may leave the device
(be offloaded to pinned host memory, or recomputed) or must stay.

The unit is a storage: the saved values that share one (a tensor and its views, or several views
of one buffer, such as q, k and v split from a fused QKV projection) are decided together, since
the device memory is freed only when none of them is held any more. This pass says which
storages *may* move (``action == "offload"``); ``plan_memory`` then decides what each one does.

Assumes: ``annotate_costs`` ran; the graphs are a partitioner's forward/backward pair.
Guarantees: every saved forward value, and the node owning its storage, has
``meta[DECISION_KEY]``, an :class:`~storm_compile.graphs.OffloadDecision`. ``offload`` is
chosen only when the storage is owned by a forward op (not a graph input or a storm transfer),
no user-visible output shares it, it is dense, non-empty, of static shape, on a CUDA device
(any device with ``transfer_cpu_tensors``), at least ``min_offload_bytes``, and every saved view
of it can be rebuilt in the backward from the storage alone. ``reason`` says which rule decided.
Emits: no nodes; the graphs are not changed.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import fx

from storm_compile.graphs import (
    COST_KEY,
    DECISION_KEY,
    OffloadDecision,
    PassContext,
    StormGraphs,
    alias_root,
    backward_placeholder,
    is_dense,
    is_transfer,
    model_outputs,
    saved_values,
    view_chain,
)

OFFLOAD_REASON = "can be offloaded"


def _replayable(member: fx.Node) -> bool:
    """Whether the member's view chain uses nothing but the storage and constants."""
    for view in view_chain(member):
        if any(isinstance(a, fx.Node) for a in (*view.args[1:], *view.kwargs.values())):
            return False
    return True


def _why_not(root: fx.Node, members: list[fx.Node], graphs: StormGraphs, ctx: PassContext,
             visible_roots: set[fx.Node]) -> str | None:
    """Why the storage owned by ``root`` must stay on its device, or None if it can move."""
    val = root.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return "not a tensor"
    if root.op == "placeholder":
        return "storage of a graph input (parameter, buffer or user input)"
    if is_transfer(root):
        return "already produced by a storm transfer"
    if root in visible_roots:
        return "storage shared with a user-visible output"
    if any(not isinstance(s, int) for s in (*val.shape, *val.stride())):
        return "dynamic shape"
    if val.numel() == 0:
        return "empty tensor"
    if val.device.type != "cuda" and not ctx.config.transfer_cpu_tensors:
        return f"on {val.device.type}, not a CUDA device"
    if not is_dense(val):
        return "storage owner not dense in memory"
    if root.meta[COST_KEY].output_bytes < ctx.config.min_offload_bytes:
        return f"smaller than min_offload_bytes ({ctx.config.min_offload_bytes})"
    if not any(backward_placeholder(graphs, m).users for m in members):
        return "not read by the backward"
    if not all(_replayable(m) for m in members):
        return "a saved view of it depends on other values"
    return None


def plan_offload(graphs: StormGraphs, ctx: PassContext) -> StormGraphs:
    visible_roots = {alias_root(n) for n in model_outputs(graphs)}
    groups: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    for node in saved_values(graphs):
        groups[alias_root(node)].append(node)
    for root, members in groups.items():
        reason = _why_not(root, members, graphs, ctx, visible_roots)
        cost = root.meta.get(COST_KEY)
        decision = OffloadDecision(
            action="keep" if reason else "offload",
            reason=reason or OFFLOAD_REASON,
            storage=root.name,
            storage_bytes=cost.output_bytes if cost else 0,
        )
        for node in (root, *members):
            node.meta[DECISION_KEY] = decision
    return graphs
