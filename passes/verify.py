"""Invariant checks run after every pass; a violation names the pass that broke it.

Checks, on top of ``fx.Graph.lint``:
  * every ``offload``/``prefetch`` feeds exactly one ``record_event``, which feeds exactly one
    ``wait_event``; nothing else reads a transferred tensor before that wait;
  * ``offload`` only in the forward, on a value produced there that is neither a graph input
    nor a user-visible output; its wait keeps the source alive and is the source's last use;
    the wait's result only leaves the forward as a saved value;
  * ``prefetch`` only in the backward, of a backward input read by nothing but the prefetch
    and its wait (keepalive).
"""

from __future__ import annotations

from torch import fx

from storm_compile import ops
from storm_compile.graphs import StormGraphs, alias_root, model_outputs, output_node


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


def _check_forward(graphs: StormGraphs) -> None:
    graph = graphs.forward.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    visible = set(model_outputs(graphs))
    visible_roots = {alias_root(v) for v in visible}
    for node in graph.find_nodes(op="call_function", target=ops.prefetch):
        _fail("forward", node, "prefetch belongs in the backward")
    for node in graph.find_nodes(op="call_function", target=ops.offload):
        source = node.args[0]
        if source.op == "placeholder" or source in visible_roots:
            _fail("forward", node, f"offloads {source.name!r}, a graph input or visible output")
        wait = _check_chain("forward", node)
        late = [u for n in graph.nodes if alias_root(n) is source for u in n.users
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
    for node in graph.find_nodes(op="call_function", target=ops.prefetch):
        source = node.args[0]
        if source.op != "placeholder":
            _fail("backward", node, f"prefetches {source.name!r}, which is not a backward input")
        wait = _check_chain("backward", node)
        extra = set(source.users) - {node, wait}
        if extra:
            _fail("backward", source, f"read on the host by {[u.name for u in extra]} "
                                      f"instead of through its prefetch")


def verify_graphs(graphs: StormGraphs) -> None:
    graphs.forward.graph.lint()
    graphs.backward.graph.lint()
    _check_forward(graphs)
    _check_backward(graphs)
