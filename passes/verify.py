"""Invariant checks run after every pass; a violation names the pass that broke it.

On the joint graph (:func:`verify_joint`, after each joint-graph pass), on top of
``fx.Graph.lint``: every ``fetch_weight`` and every ``grad_to_host`` reads a graph input as its
host weight.

On the partitioned pair (:func:`verify_graphs`), on top of ``fx.Graph.lint``:
  * every ``offload``/``prefetch`` feeds exactly one ``record_event``, which feeds exactly one
    ``wait_event``; nothing else reads a transferred tensor before that wait;
  * ``offload`` only in the forward, on a value produced there that is neither a graph input
    nor a user-visible output; its wait keeps the source alive and is the source's last use;
    the wait's result only leaves the forward as a saved value;
  * ``prefetch`` of a graph input read by nothing but its prefetches and their waits
    (keepalive), and, in the forward, the output (a streamed weight saved for the backward's
    own fetch), in the backward a ``send_grad`` or an ``accumulate_grad`` (which add into the
    weight's ``.grad``, not its data): in the backward a saved activation's host copy or a
    streamed weight, in the forward a streamed weight;
  * ``resident_weight`` reads a graph input (a streamed weight);
  * ``send_grad`` only in the backward, its wait keeping the gradient alive and read only by
    one ``accumulate_grad``, whose token is read only by the graph's one ``wait_host``, the
    last node before the output.
"""

from __future__ import annotations

import collections

from torch import fx

from storm_compile.fx.graphs import StormGraphs, model_outputs, output_node
from storm_compile.fx.vocabulary import storage_owner
from storm_compile.runtime import ops


class StormVerificationError(RuntimeError):
    pass


def _fail(graph_name: str, node: fx.Node, message: str) -> None:
    raise StormVerificationError(f"{graph_name} graph, node {node.name!r}: {message}")


def _check_chain(graph_name: str, transfer: fx.Node) -> fx.Node:
    """Check transfer -> record_event -> wait_event; return the wait."""
    users = list(transfer.users)
    if len(users) != 1 or users[0].target is not ops.record_event:
        _fail(graph_name, transfer, f"must feed exactly one record_event, feeds {users}")
    record = users[0]
    record_users = list(record.users)
    if len(record_users) != 1 or record_users[0].target is not ops.wait_event \
            or record_users[0].args[0] is not record:
        _fail(graph_name, record, f"must feed exactly one wait_event, feeds {record_users}")
    wait = record_users[0]
    keepalive = wait.args[1] if len(wait.args) > 1 else wait.kwargs.get("keepalive")
    if keepalive is not transfer.args[0]:
        _fail(graph_name, wait, f"must keep {transfer.args[0].name!r} alive, keeps {keepalive}")
    return wait


def _check_prefetches(graph_name: str, graph: fx.Graph, allowed: set[fx.Node]) -> None:
    """Every prefetch copies a graph input that nothing else reads but its prefetches, their
    waits, and the nodes in ``allowed``."""
    prefetches = graph.find_nodes(op="call_function", target=ops.prefetch)
    chains = {node: _check_chain(graph_name, node) for node in prefetches}
    for node in prefetches:
        source = node.args[0]
        if source.op != "placeholder":
            _fail(graph_name, node, f"prefetches {source.name!r}, which is not a graph input")
    for source in {node.args[0] for node in prefetches}:
        extra = set(source.users) - set(prefetches) - set(chains.values()) - allowed
        if extra:
            _fail(graph_name, source, f"read on the host by {[u.name for u in extra]} "
                                      f"instead of through its prefetch")


def _by_storage(graph: fx.Graph) -> dict[fx.Node, list[fx.Node]]:
    """The graph's nodes by the node owning the storage each reads, in graph order."""
    sharing: dict[fx.Node, list[fx.Node]] = collections.defaultdict(list)
    for node in graph.nodes:
        sharing[storage_owner(node)].append(node)
    return sharing


def _check_forward(graphs: StormGraphs) -> None:
    graph = graphs.forward.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    visible = set(model_outputs(graphs))
    visible_roots = {storage_owner(v) for v in visible}
    _check_prefetches("forward", graph, {output_node(graphs.forward)})
    for target in (ops.send_grad, ops.accumulate_grad, ops.wait_host):
        for node in graph.find_nodes(op="call_function", target=target):
            _fail("forward", node, f"{node.target} belongs in the backward")
    offloads = graph.find_nodes(op="call_function", target=ops.offload)
    sharing = _by_storage(graph) if offloads else {}
    for node in offloads:
        source = node.args[0]
        if source.op == "placeholder" or source in visible_roots:
            _fail("forward", node, f"offloads {source.name!r}, a graph input or visible output")
        wait = _check_chain("forward", node)
        late = [u for n in sharing[source] for u in n.users
                if u is not wait and order[u] > order[wait]]
        if late:
            _fail("forward", source, f"read by {[u.name for u in late]} after its offload "
                                     f"completed and its device memory was released")
        if set(wait.users) != {output_node(graphs.forward)} or wait in visible:
            _fail("forward", wait, "an offloaded value may only leave the forward as saved")


def _check_backward(graphs: StormGraphs) -> None:
    graph = graphs.backward.graph
    for node in graph.find_nodes(op="call_function", target=ops.offload):
        _fail("backward", node, "offload belongs in the forward")
    sends = graph.find_nodes(op="call_function", target=ops.send_grad)
    _check_prefetches("backward", graph, {*sends, *graph.find_nodes(
        op="call_function", target=ops.accumulate_grad)})
    barriers = graph.find_nodes(op="call_function", target=ops.wait_host)
    if len(barriers) > 1 or (sends and not barriers):
        _fail("backward", barriers[-1] if barriers else output_node(graphs.backward),
              f"needs exactly one wait_host for its {len(sends)} send_grad, has {len(barriers)}")
    if barriers and barriers[0].next is not output_node(graphs.backward):
        _fail("backward", barriers[0], "wait_host must be the last node before the output")
    for node in sends:
        wait = _check_chain("backward", node)
        adds = list(wait.users)
        if len(adds) != 1 or adds[0].target is not ops.accumulate_grad:
            _fail("backward", wait, f"must feed exactly one accumulate_grad, feeds {adds}")
        if set(adds[0].users) != set(barriers):
            _fail("backward", adds[0], f"must be read by the wait_host only, is read by "
                                       f"{list(adds[0].users)}")


def _check_resident(graph_name: str, graph: fx.Graph) -> None:
    for node in graph.find_nodes(op="call_function", target=ops.resident_weight):
        if node.args[0].op != "placeholder":
            _fail(graph_name, node, f"keeps {node.args[0].name!r} on the device, which is not "
                                    f"a graph input")


def verify_joint(joint: fx.GraphModule) -> None:
    joint.graph.lint()
    for target, position in ((ops.fetch_weight, 0), (ops.grad_to_host, 1)):
        for node in joint.graph.find_nodes(op="call_function", target=target):
            if node.args[position].op != "placeholder":
                _fail("joint", node, f"reads {node.args[position].name!r} as its host weight, "
                                     f"which is not a graph input")


def verify_graphs(graphs: StormGraphs) -> None:
    graphs.forward.graph.lint()
    graphs.backward.graph.lint()
    _check_resident("forward", graphs.forward.graph)
    _check_resident("backward", graphs.backward.graph)
    _check_forward(graphs)
    _check_backward(graphs)
