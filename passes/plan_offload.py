"""Decide, for every tensor saved for the backward, whether it stays on the device or is offloaded.

This first placement offloads every activation that can be offloaded; later planners choose.

Assumes: ``annotate_costs`` ran; the graphs are a partitioner's forward/backward pair.
Guarantees: every saved forward value has ``meta[DECISION_KEY]``, an
:class:`~storm_compile.graphs.OffloadDecision` whose ``reason`` says why; ``offload`` is chosen
only for a dense, non-empty tensor of static shape on a CUDA device (or any device with
``transfer_cpu_tensors``) that is produced by an op of the forward (not a graph input, a view,
or a storm transfer), is not a user-visible output, shares its storage with no other output of
the forward, is at least ``min_offload_bytes``, and is read by the backward.
Emits: no nodes; the graphs are not changed.
"""

from __future__ import annotations

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
    is_view,
    model_outputs,
    saved_values,
)


def _why_not(node: fx.Node, graphs: StormGraphs, ctx: PassContext,
             user_visible: set[fx.Node], storage_owners: dict[fx.Node, int]) -> str | None:
    """The reason ``node`` must stay on its device, or None when it can be offloaded."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return "not a tensor"
    if node.op == "placeholder":
        return "graph input (parameter, buffer or user input)"
    if is_transfer(node):
        return "already produced by a storm transfer"
    if is_view(node):
        return "view of another tensor"
    if node in user_visible:
        return "user-visible output"
    if storage_owners.get(node, 0) > 1:
        return "its storage is shared with another forward output, so it would not be freed"
    if any(not isinstance(s, int) for s in (*val.shape, *val.stride())):
        return "dynamic shape"
    if val.numel() == 0:
        return "empty tensor"
    if val.device.type != "cuda" and not ctx.config.transfer_cpu_tensors:
        return f"on {val.device.type}, not a CUDA device"
    if not is_dense(val):
        return "not dense in memory"
    nbytes = node.meta[COST_KEY].output_bytes
    if nbytes < ctx.config.min_offload_bytes:
        return f"smaller than min_offload_bytes ({ctx.config.min_offload_bytes})"
    if not backward_placeholder(graphs, node).users:
        return "not read by the backward"
    return None


def plan_offload(graphs: StormGraphs, ctx: PassContext) -> StormGraphs:
    saved = saved_values(graphs)
    user_visible = set(model_outputs(graphs))
    storage_owners: dict[fx.Node, int] = {}
    for out in {*user_visible, *saved}:
        root = alias_root(out)
        storage_owners[root] = storage_owners.get(root, 0) + 1
    for node in saved:
        reason = _why_not(node, graphs, ctx, user_visible, storage_owners)
        node.meta[DECISION_KEY] = OffloadDecision(
            action="keep" if reason else "offload",
            reason=reason or "eligible: offload every eligible activation",
            nbytes=node.meta[COST_KEY].output_bytes,
        )
    return graphs
