"""Rewrite both graphs so every storage the planner chose to offload, and every streamed weight
and its gradient, crosses the link on a copy stream.

Assumes: ``graphs.storages`` holds every saved storage and ``place_transfers`` gave every
``Action.OFFLOAD`` decision its :class:`~storm_compile.fx.plan.Placement` (``offload_after``,
``wait_after``, ``prefetch_after``).
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

Under ``offload_format="fp8"`` a storage :func:`~storm_compile.fx.fp8.compresses` crosses
packed: the forward emits, right after ``offload_after_node``::

    e = clamp_max(clamp_min(ceil(log2(convert_element_type(amax(abs(r)), float32) / 448)),
                            -127), 127)
    q = convert_element_type(convert_element_type(r, float32) / exp2(e), float8_e4m3fn)
    p = cat([view(convert_element_type(e + 127, uint8), [1]),
             view(view.dtype(q, uint8), [-1])])
    r_host = storm.offload(p, host_limit); ...; storm.wait_event(r_host_ready, p)

and the backward rebuilds ``r`` right after the prefetch's wait, before the views' replays::

    e     = convert_element_type(slice(r_dev_done, 0, 0, 1), float32) - 127
    r_dev = convert_element_type(convert_element_type(view(view.dtype(
        slice(r_dev_done, 0, 1, 1 + numel), float8_e4m3fn), r.shape), float32)
        * exp2(e), r.dtype)

A read is a non-view user of ``hi`` or of a view of it: the backward's views of a saved value
cost nothing and often sit at its top, so the wait goes before the first node that reads the
data, and those views move after the wait.

Streamed weights (``graphs.storages.fetches``): each ``w_dev = storm.fetch_weight(w, device)``
of either graph becomes, with ``issue_after`` and ``first_read`` from its :class:`WeightFetch`::

    issue_after(...)                                  # or the last graph input
    w_dev       = storm.prefetch(w, device)
    w_dev_ready = storm.record_event(w_dev)
    ...
    w_dev_done  = storm.wait_event(w_dev_ready, w)
    <views of the fetch, moved here>
    first_read(...)

and each ``w_dev = storm.fetch_weight(w, device)`` of a weight in
``graphs.storages.resident`` becomes, in both graphs, at the same place::

    w_dev       = storm.resident_weight(w, device)    # the device copy kept across steps

and each ``storm.grad_to_host(g, w)`` of the backward (``graphs.storages.sends``) becomes::

    issue_after(...)                                  # g's producer or a later node
    g_host       = storm.send_grad(g, host_limit, w)   # w where folding g on the device beats
                                                      # the host's addition (folds_faster)
    g_host_ready = storm.record_event(g_host)
    ...
    wait_after(...)
    g_host_done  = storm.wait_event(g_host_ready, g)  # g's last use: its memory is released
    g_token      = storm.accumulate_grad(g_host_done, w)   # a host thread adds it into w.grad
    ...
    storm.wait_host([g_token, ...])                   # every send's token, before the output:
                                                      # the additions are done by the end of
                                                      # the backward pass
    return (...)

The send of the gradient of a weight whose gradients are summed on the device
(``ResidentWeight.summed``) is given ``summed``, here or in a later run::

    g_host       = storm.send_grad(g, host_limit, w, True)

``meta["val"]`` of every new node, and of ``h1..hk``, comes from the ops' fake implementations;
the replayed views have the strides the backward was traced with.
Idempotent: a second run finds the offloaded storages no longer saved (the forward returns
their ``wait_event`` instead), no ``fetch_weight`` or ``grad_to_host`` left and every summed
weight's send given ``summed``, and changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import fx

from storm_compile.fx import fp8
from storm_compile.fx.graphs import (
    PassContext,
    StormGraphs,
    backward_inputs,
    output_node,
    saved_values,
)
from storm_compile.fx.plan import Action, GradSend, WeightFetch
from storm_compile.fx.torch_private import tree_leaves
from storm_compile.fx.vocabulary import (
    SUMMED_ARG,
    node_order,
    tensor_bytes,
    sums_on_device,
    view_chain,
    view_closure,
)
from storm_compile.runtime import ops

aten = torch.ops.aten
prims = torch.ops.prims

PASS_THROUGH = frozenset({ops.record_event, ops.wait_event, ops.accumulate_grad})
"""storm's ops whose fake implementation returns its first argument itself (events and the host
thread's token only order work on the tensor they are given), so a call's value is that
argument's: read from it instead of dispatched through the fake-tensor mode, which takes about
0.2 ms a call (most nodes this pass adds are these; dispatching them all takes the pass 0.32 s
instead of 0.17-0.19 s on the streamed 3B, `storm schedule ... --timings` on a 2-core CPU)."""


def _fake_call(target, args: Sequence[object], kwargs: dict[str, object]) -> torch.Tensor:
    """``target``'s value on the values of ``args`` and ``kwargs``, under their fake mode; a
    storm op's own fake implementation is called directly (``ops.FAKE_IMPLS``)."""
    fake_args, fake_kwargs = fx.node.map_arg((tuple(args), kwargs), lambda a: a.meta["val"])
    fake_mode = next(a.fake_mode for a in tree_leaves(fake_args) if hasattr(a, "fake_mode"))
    with fake_mode:
        return ops.FAKE_IMPLS.get(target, target)(*fake_args, **fake_kwargs)


def _emit(graph: fx.Graph, target, args: tuple, kwargs: dict | None = None) -> fx.Node:
    kwargs = kwargs or {}
    node = graph.call_function(target, args, kwargs)
    node.meta["val"] = args[0].meta["val"] if target in PASS_THROUGH \
        else _fake_call(target, args, kwargs)
    return node


def _chain(graph: fx.Graph, after: fx.Node, calls: Callable[[Callable], fx.Node]) -> fx.Node:
    """Emit the nodes ``calls(emit)`` makes one after another, right after ``after``: the node
    it returns."""
    last = [after]

    def emit(target, *args: object) -> fx.Node:
        with graph.inserting_after(last[0]):
            last[0] = _emit(graph, target, args)
        return last[0]

    return calls(emit)


def _pack_fp8(x: fx.Node) -> Callable[[Callable], fx.Node]:
    """``x`` packed as :mod:`storm_compile.fx.fp8` holds it: its scale's biased exponent as a
    byte, then its values over the scale in fp8, as one flat uint8 tensor."""
    def calls(emit: Callable) -> fx.Node:
        largest = emit(prims.convert_element_type.default,
                       emit(aten.amax.default, emit(aten.abs.default, x)), fp8.SCALE_DTYPE)
        exponent = emit(aten.clamp_max.default, emit(aten.clamp_min.default, emit(
            aten.ceil.default, emit(aten.log2.default, emit(aten.div.Tensor, largest,
                                                           fp8.FP8_MAX))),
            -fp8.EXPONENT_BIAS), fp8.EXPONENT_BIAS)
        values = emit(prims.convert_element_type.default, emit(
            aten.div.Tensor, emit(prims.convert_element_type.default, x, fp8.SCALE_DTYPE),
            emit(aten.exp2.default, exponent)), fp8.FP8)
        header = emit(prims.convert_element_type.default,
                      emit(aten.add.Tensor, exponent, fp8.EXPONENT_BIAS), torch.uint8)
        return emit(aten.cat.default, [
            emit(aten.view.default, header, [1]),
            emit(aten.view.default, emit(aten.view.dtype, values, torch.uint8), [-1])])
    return calls


def _unpack_fp8(packed: fx.Node, value: torch.Tensor) -> Callable[[Callable], fx.Node]:
    """The tensor ``value`` describes, rebuilt in its dtype from ``packed`` (:func:`_pack_fp8`)."""
    def calls(emit: Callable) -> fx.Node:
        exponent = emit(aten.sub.Tensor, emit(
            prims.convert_element_type.default,
            emit(aten.slice.Tensor, packed, 0, 0, fp8.SCALE_BYTES), fp8.SCALE_DTYPE),
            fp8.EXPONENT_BIAS)
        values = emit(aten.view.default, emit(aten.view.dtype, emit(
            aten.slice.Tensor, packed, 0, fp8.SCALE_BYTES, fp8.SCALE_BYTES + value.numel()),
            fp8.FP8), list(value.shape))
        return emit(prims.convert_element_type.default, emit(aten.mul.Tensor, emit(
            prims.convert_element_type.default, values, fp8.SCALE_DTYPE),
            emit(aten.exp2.default, exponent)), value.dtype)
    return calls


def _offload_in_forward(graph: fx.Graph, root: fx.Node, issue: fx.Node, anchor: fx.Node,
                        ctx: PassContext) -> fx.Node:
    source = root
    if fp8.compresses(root.meta["val"], ctx.config.offload_format):
        source = _chain(graph, issue, _pack_fp8(root))
    with graph.inserting_after(issue if source is root else source):
        host = _emit(graph, ops.offload, (source, ctx.config.host_memory_limit))
    with graph.inserting_after(host):
        ready = _emit(graph, ops.record_event, (host,))
    with graph.inserting_after(ready if anchor is issue else anchor):
        return _emit(graph, ops.wait_event, (ready, source))


def _prefetch_in_backward(graph: fx.Graph, members: dict[fx.Node, fx.Node],
                          inputs: dict[fx.Node, fx.Node], prefetch_after: fx.Node | None,
                          device: torch.device, packed: torch.Tensor | None,
                          order: dict[fx.Node, int]) -> None:
    """``members`` maps each backward input of the storage to the saved forward value;
    ``inputs`` every saved forward value to its backward input. Symbolic sizes in the replayed
    views are the backward's inputs that receive them (``plan_offload`` lets a view move only
    when the sizes it uses are saved). ``packed``: the storage's tensor, where its copies hold
    it in fp8 (rebuilt right after the wait); None when they hold it as it is. ``order``: the
    backward's node positions before any rewrite, which the storage's views and readers keep
    among themselves while other storages' copies are inserted and their views move (a view
    has one base, so it moves with one storage only, and readers never move)."""
    placeholders = list(members)
    source = placeholders[0]
    users = {h: list(h.users) for h in placeholders}
    closures = [view_closure(h, order) for h in placeholders]
    first_use = min((r for _, readers in closures for r in readers), key=order.__getitem__)
    anchor = graph.find_nodes(op="placeholder")[-1] if prefetch_after is None \
        else prefetch_after
    with graph.inserting_after(anchor):
        dev = _emit(graph, ops.prefetch, (source, device))
    with graph.inserting_after(dev):
        ready = _emit(graph, ops.record_event, (dev,))
    with graph.inserting_before(first_use):
        done = _emit(graph, ops.wait_event, (ready, source))
        if packed is not None:
            done = _unpack_fp8(done, packed)(lambda target, *args: _emit(graph, target, args))
        for h, saved in members.items():
            rebuilt = done
            for view in view_chain(saved):
                args, kwargs = fx.node.map_arg((view.args[1:], view.kwargs), inputs.__getitem__)
                rebuilt = _emit(graph, view.target, (rebuilt, *args), dict(kwargs))
            for user in users[h]:
                user.replace_input_with(h, rebuilt)
    for view in sorted((v for views, _ in closures for v in views), key=order.__getitem__):
        first_use.prepend(view)


def _fetch_ahead(graph: fx.Graph, fetch: WeightFetch, order: dict[fx.Node, int]) -> None:
    """Replace a streamed weight's fetch by a prefetch issued after ``fetch.issue_after`` and
    its wait right before ``fetch.first_read``; the fetch's views move after the wait, in their
    ``order``: the graph's node positions before any rewrite, which the views of one fetch keep
    among themselves while other copies are inserted and other values' views move."""
    node = fetch.node
    weight, device = node.args
    views = view_closure(node, order)[0]
    anchor = graph.find_nodes(op="placeholder")[-1] if fetch.issue_after is None \
        else fetch.issue_after
    with graph.inserting_after(anchor):
        dev = _emit(graph, ops.prefetch, (weight, device))
    with graph.inserting_after(dev):
        ready = _emit(graph, ops.record_event, (dev,))
    with graph.inserting_before(fetch.first_read):
        done = _emit(graph, ops.wait_event, (ready, weight))
    node.replace_all_uses_with(done)
    graph.erase_node(node)
    for view in views:
        fetch.first_read.prepend(view)


def _send_home(graph: fx.Graph, send: GradSend, ctx: PassContext) -> fx.Node:
    """Replace a streamed weight's ``grad_to_host`` by a copy on the D2H stream issued after
    ``send.issue_after``, a compute-stream wait after ``send.wait_after`` (the gradient's last
    use) and the host thread's addition into the weight's ``.grad``; returns the addition's
    token."""
    node = send.node
    grad, weight = node.args
    with graph.inserting_after(send.issue_after):
        limit = ctx.config.host_memory_limit
        folds = ctx.cost.folds_faster(tensor_bytes(grad.meta.get("val")))
        host = _emit(graph, ops.send_grad, (grad, limit, weight) if folds else (grad, limit))
    with graph.inserting_after(host):
        ready = _emit(graph, ops.record_event, (host,))
    after = ready if send.wait_after is send.issue_after else send.wait_after
    with graph.inserting_after(after):
        done = _emit(graph, ops.wait_event, (ready, grad))
    with graph.inserting_after(done):
        token = _emit(graph, ops.accumulate_grad, (done, weight))
    graph.erase_node(node)
    return token


def _give_weights(backward: fx.Graph, summed: set[str]) -> int:
    """Give the ``storm.send_grad`` of each gradient of a weight named in ``summed`` its
    ``summed``, where it does not have it; how many it gave."""
    given = 0
    for accumulate in backward.find_nodes(op="call_function", target=ops.accumulate_grad):
        send, weight = accumulate.args
        while send.target is not ops.send_grad:
            send = send.args[0]
        if weight.name in summed and not sums_on_device(send):
            send.args = (*send.args[:SUMMED_ARG - 1], weight, True)
            given += 1
    return given


def insert_transfers(graphs: StormGraphs, ctx: PassContext) -> StormGraphs:
    """Copies that share an anchor node are inserted last-first, so that each lane's queue (graph
    order) is the scheduler's: D2H by production, H2D by first read."""
    saved = set(saved_values(graphs))
    offloads = [(s, graphs.storages.decisions[s.root].placement)
                for s in graphs.storages.with_action(Action.OFFLOAD)
                if saved.issuperset(s.members)]
    inputs = backward_inputs(graphs)
    out = output_node(graphs.forward)
    forward_order = node_order(graphs.forward)
    backward_order = node_order(graphs.backward)
    for storage, placement in sorted(offloads, key=lambda o: forward_order[o[0].root],
                                     reverse=True):
        done = _offload_in_forward(graphs.forward.graph, storage.root, placement.offload_after,
                                   placement.wait_after, ctx)
        out.args = (tuple(done if n in storage.members else n for n in out.args[0]),)
        for h in (inputs[m] for m in storage.members):
            h.meta["val"] = done.meta["val"]
            h.meta.pop("tensor_meta", None)
    fetches = {gm: [f for f in graphs.storages.fetches if f.node in present]
               for gm in (graphs.forward, graphs.backward)
               for present in [set(gm.graph.find_nodes(op="call_function",
                                                       target=ops.fetch_weight))]}
    for fetch in sorted(fetches[graphs.forward], key=lambda f: forward_order[f.first_read],
                        reverse=True):
        _fetch_ahead(graphs.forward.graph, fetch, forward_order)
    by_read = [(backward_order[f.first_read], f) for f in fetches[graphs.backward]] + \
        [(backward_order[s.first_read], (s, p)) for s, p in offloads]
    for _, item in sorted(by_read, key=lambda r: r[0], reverse=True):
        if isinstance(item, WeightFetch):
            _fetch_ahead(graphs.backward.graph, item, backward_order)
            continue
        storage, placement = item
        members = {inputs[m]: m for m in storage.members}
        value = storage.root.meta["val"]
        _prefetch_in_backward(graphs.backward.graph, members, inputs, placement.prefetch_after,
                              value.device,
                              value if fp8.compresses(value, ctx.config.offload_format) else None,
                              backward_order)
        for member in storage.members:
            for view in reversed(view_chain(member)):
                if not view.users:
                    graphs.forward.graph.erase_node(view)
    resident = {w.name for w in graphs.storages.resident}
    kept = [node for gm in (graphs.forward, graphs.backward)
            for node in gm.graph.find_nodes(op="call_function", target=ops.fetch_weight)
            if node.args[0].name in resident]
    for node in kept:
        with node.graph.inserting_before(node):
            resident_copy = _emit(node.graph, ops.resident_weight, node.args)
        node.replace_all_uses_with(resident_copy)
        node.graph.erase_node(node)
    unsent = set(graphs.backward.graph.find_nodes(op="call_function", target=ops.grad_to_host))
    sends = [s for s in graphs.storages.sends if s.node in unsent]
    tokens = [_send_home(graphs.backward.graph, send, ctx)
              for send in sorted(sends, key=lambda s: backward_order[s.node.args[0]],
                                 reverse=True)]
    if tokens:
        with graphs.backward.graph.inserting_before(output_node(graphs.backward)):
            graphs.backward.graph.call_function(ops.wait_host, (tokens,))
    summed = _give_weights(graphs.backward.graph,
                           {w.name for w in graphs.storages.resident if w.summed})
    if offloads or sends or kept or summed or any(fetches.values()):
        graphs.forward.recompile()
        graphs.backward.recompile()
    return graphs
