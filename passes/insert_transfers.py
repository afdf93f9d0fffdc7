"""Rewrite both graphs so every storage the planner chose to offload crosses the link.

Assumes: ``plan_offload`` wrote an ``OffloadDecision`` on every saved forward value and
``schedule_transfers`` placed every ``offload`` one (``offload_after``, ``wait_after``,
``prefetch_after``).
Guarantees: for each offloaded storage, owned by forward node ``r`` and saved as values
``m1..mk`` (``r`` itself or views of it; backward inputs ``h1..hk``):

Forward (``r``'s storage no longer leaves the forward on the device)::

    r = producer(...)
    offload_after_node(...)                           # r's producer or a later node
    r_host       = storm.offload(r, host_limit)
    r_host_ready = storm.record_event(r_host)
    ...
    wait_after_node(...)
    r_host_done  = storm.wait_event(r_host_ready, r)  # r's last use: its memory is released
    return (..., r_host_done, ..., r_host_done, ...)  # in place of each of m1..mk

Backward (each of ``h1..hk`` now holds the host copy; only ``h1`` is read)::

    prefetch_after_node(...)                          # or the last graph input
    r_dev       = storm.prefetch(h1, device)
    r_dev_ready = storm.record_event(r_dev)
    ...
    r_dev_done  = storm.wait_event(r_dev_ready, h1)   # right before the first read of h1..hk
    mi = <the forward's view ops from r to mi, replayed on r_dev_done>   # for each i
    <the backward's views of h1..hk, moved here in their order>
    first_read(...)                                   # every former use of hi reads mi

A read is a non-view user of ``hi`` or of a view of it: the backward's views of a saved value
cost nothing and often sit at its top, so the wait goes before the first node that reads the
data, and those views move after the wait.

``meta["val"]`` of every new node, and of ``h1..hk``, comes from the ops' fake implementations;
the replayed views have the strides the backward was traced with.
Idempotent: a second run finds the saved values produced by storm ops and changes nothing.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
from torch import fx
from torch.utils._pytree import tree_leaves

from storm_compile import ops
from storm_compile.graphs import (
    DECISION_KEY,
    PassContext,
    StormGraphs,
    alias_root,
    backward_placeholder,
    first_backward_read,
    output_node,
    saved_values,
    view_chain,
    view_closure,
)


def _fake_call(target, args: Sequence[object], kwargs: dict[str, object]) -> torch.Tensor:
    def val(a):
        return a.meta["val"] if isinstance(a, fx.Node) else a

    fake_args = [val(a) for a in args]
    fake_kwargs = {k: val(v) for k, v in kwargs.items()}
    fake_mode = next(a.fake_mode for a in tree_leaves(fake_args) if hasattr(a, "fake_mode"))
    with fake_mode:
        return target(*fake_args, **fake_kwargs)


def _emit(graph: fx.Graph, target, args: tuple, kwargs: dict | None = None) -> fx.Node:
    kwargs = kwargs or {}
    node = graph.call_function(target, args, kwargs)
    node.meta["val"] = _fake_call(target, args, kwargs)
    return node


def _node(graph: fx.Graph, name: str) -> fx.Node:
    return next(n for n in graph.nodes if n.name == name)


def _offload_in_forward(graph: fx.Graph, root: fx.Node, offload_after: str, wait_after: str,
                        ctx: PassContext) -> fx.Node:
    issue = _node(graph, offload_after)
    with graph.inserting_after(issue):
        host = _emit(graph, ops.offload, (root, ctx.config.host_memory_limit))
    with graph.inserting_after(host):
        ready = _emit(graph, ops.record_event, (host,))
    anchor = _node(graph, wait_after)
    with graph.inserting_after(ready if anchor is issue else anchor):
        return _emit(graph, ops.wait_event, (ready, root))


def _prefetch_in_backward(graph: fx.Graph, members: dict[fx.Node, fx.Node],
                          prefetch_after: str | None, device: torch.device) -> None:
    """``members`` maps each backward input of the storage to the saved forward value."""
    placeholders = list(members)
    source = placeholders[0]
    users = {h: list(h.users) for h in placeholders}
    order = {n: i for i, n in enumerate(graph.nodes)}
    closures = [view_closure(h, order) for h in placeholders]
    first_use = min((r for _, readers in closures for r in readers), key=order.__getitem__)
    anchor = graph.find_nodes(op="placeholder")[-1] if prefetch_after is None \
        else _node(graph, prefetch_after)
    with graph.inserting_after(anchor):
        dev = _emit(graph, ops.prefetch, (source, device))
    with graph.inserting_after(dev):
        ready = _emit(graph, ops.record_event, (dev,))
    with graph.inserting_before(first_use):
        done = _emit(graph, ops.wait_event, (ready, source))
        for h, saved in members.items():
            rebuilt = done
            for view in view_chain(saved):
                rebuilt = _emit(graph, view.target, (rebuilt, *view.args[1:]), dict(view.kwargs))
            for user in users[h]:
                user.replace_input_with(h, rebuilt)
    for view in sorted((v for views, _ in closures for v in views), key=order.__getitem__):
        first_use.prepend(view)


def insert_transfers(graphs: StormGraphs, ctx: PassContext) -> StormGraphs:
    """Copies that share an anchor node are inserted last-first, so that each lane's queue (graph
    order) is the scheduler's: D2H by production, H2D by first read."""
    groups: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    for node in saved_values(graphs):
        decision = node.meta.get(DECISION_KEY)
        if decision is not None and decision.action == "offload":
            groups[alias_root(node)].append(node)
    out = output_node(graphs.forward)
    forward_order = {n: i for i, n in enumerate(graphs.forward.graph.nodes)}
    backward_order = {n: i for i, n in enumerate(graphs.backward.graph.nodes)}
    by_read = sorted(groups, key=lambda r: backward_order[
        first_backward_read(graphs, groups[r], backward_order)], reverse=True)
    for root in sorted(groups, key=forward_order.__getitem__, reverse=True):
        saved = groups[root]
        decision = saved[0].meta[DECISION_KEY]
        done = _offload_in_forward(graphs.forward.graph, root, decision.offload_after,
                                   decision.wait_after, ctx)
        out.args = (tuple(done if n in saved else n for n in out.args[0]),)
        for h in (backward_placeholder(graphs, m) for m in saved):
            h.meta["val"] = done.meta["val"]
            h.meta.pop("tensor_meta", None)
    for root in by_read:
        saved = groups[root]
        members = {backward_placeholder(graphs, m): m for m in saved}
        _prefetch_in_backward(graphs.backward.graph, members,
                              saved[0].meta[DECISION_KEY].prefetch_after,
                              root.meta["val"].device)
        for member in saved:
            for view in reversed(view_chain(member)):
                if not view.users:
                    graphs.forward.graph.erase_node(view)
    if groups:
        graphs.forward.recompile()
        graphs.backward.recompile()
    return graphs
