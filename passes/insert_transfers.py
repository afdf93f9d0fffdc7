"""Rewrite both graphs so every activation the planner chose to offload crosses the link.

Assumes: ``plan_offload`` wrote an ``OffloadDecision`` on every saved forward value.
Guarantees: for each ``offload`` decision on forward node ``x`` (saved as backward input ``h``):

Forward (``x`` no longer leaves the forward on the device)::

    x  = producer(...)
    x_host        = storm.offload(x, host_limit)        # right after the producer
    x_host_ready  = storm.record_event(x_host)
    ...           # offload_wait_distance compute nodes, and at least x's last forward use
    x_host_done   = storm.wait_event(x_host_ready, x)   # x's last use: its GPU memory is freed
    return (..., x_host_done, ...)                      # in place of x

Backward (``h`` now holds the host copy)::

    h = placeholder
    ...
    x_dev       = storm.prefetch(h, device)             # prefetch_distance compute nodes before
    x_dev_ready = storm.record_event(x_dev)             # the first use, never above a placeholder
    ...
    x_dev_done  = storm.wait_event(x_dev_ready, h)      # right before the first use
    first_use(x_dev_done, ...)                          # every former use of h reads x_dev_done

``meta["val"]`` of every new node, and of ``h``, is set from the ops' fake implementations.
Idempotent: a second run finds the saved values produced by storm ops and changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import fx

from storm_compile import ops
from storm_compile.graphs import (
    COST_KEY,
    DECISION_KEY,
    PassContext,
    StormGraphs,
    backward_placeholder,
    output_node,
    saved_values,
)


def _fake_call(target, args: Sequence[object], kwargs: dict[str, object]) -> torch.Tensor:
    def val(a):
        return a.meta["val"] if isinstance(a, fx.Node) else a

    fake_args = [val(a) for a in args]
    fake_kwargs = {k: val(v) for k, v in kwargs.items()}
    fake_mode = next(a.fake_mode for a in fake_args if hasattr(a, "fake_mode"))
    with fake_mode:
        return target(*fake_args, **fake_kwargs)


def _emit(graph: fx.Graph, target, args: tuple, kwargs: dict | None = None) -> fx.Node:
    kwargs = kwargs or {}
    node = graph.call_function(target, args, kwargs)
    node.meta["val"] = _fake_call(target, args, kwargs)
    return node


def _compute_nodes(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if COST_KEY in n.meta and n.meta[COST_KEY].is_compute]


def _offload_in_forward(graph: fx.Graph, x: fx.Node, ctx: PassContext) -> fx.Node:
    forward_users = [u for u in x.users if u.op != "output"]
    with graph.inserting_after(x):
        host = _emit(graph, ops.offload, (x, ctx.config.host_memory_limit))
    with graph.inserting_after(host):
        ready = _emit(graph, ops.record_event, (host,))

    order = {n: i for i, n in enumerate(graph.nodes)}
    compute_after = [n for n in _compute_nodes(graph) if order[n] > order[ready]]
    distance = min(ctx.config.offload_wait_distance, len(compute_after))
    anchors = [ready, *forward_users] + ([compute_after[distance - 1]] if distance else [])
    with graph.inserting_after(max(anchors, key=order.__getitem__)):
        return _emit(graph, ops.wait_event, (ready, x))


def _prefetch_in_backward(graph: fx.Graph, h: fx.Node, device: torch.device,
                          ctx: PassContext) -> None:
    users = list(h.users)
    order = {n: i for i, n in enumerate(graph.nodes)}
    first_use = min(users, key=order.__getitem__)
    compute_before = [n for n in _compute_nodes(graph) if order[n] < order[first_use]]
    distance = ctx.config.prefetch_distance
    if distance == 0:
        issue = graph.inserting_before(first_use)
    elif len(compute_before) > distance:
        issue = graph.inserting_after(compute_before[-distance - 1])
    else:
        issue = graph.inserting_after(graph.find_nodes(op="placeholder")[-1])
    with issue:
        dev = _emit(graph, ops.prefetch, (h, device))
    with graph.inserting_after(dev):
        ready = _emit(graph, ops.record_event, (dev,))
    with graph.inserting_before(first_use):
        done = _emit(graph, ops.wait_event, (ready, h))
    for user in users:
        user.replace_input_with(h, done)


def insert_transfers(graphs: StormGraphs, ctx: PassContext) -> StormGraphs:
    fw, bw = graphs.forward.graph, graphs.backward.graph
    chosen = [n for n in saved_values(graphs)
              if n.meta.get(DECISION_KEY) is not None and n.meta[DECISION_KEY].action == "offload"]
    out = output_node(graphs.forward)
    for x in chosen:
        h = backward_placeholder(graphs, x)
        device = x.meta["val"].device
        done = _offload_in_forward(fw, x, ctx)
        fw_outputs = list(out.args[0])
        index = fw_outputs.index(x, graphs.num_fwd_outputs)
        fw_outputs[index] = done
        out.args = (tuple(fw_outputs),)
        h.meta["val"] = done.meta["val"]
        h.meta.pop("tensor_meta", None)
        _prefetch_in_backward(bw, h, device, ctx)
    if chosen:
        graphs.forward.recompile()
        graphs.backward.recompile()
    return graphs
