"""``pin_transfers``: Inductor's peak-memory order for compute, storm's placement for copies.

Unit tests drive it with stand-ins for Inductor's scheduler nodes over a real FX graph; the
integration test compiles the built-in gpt with Inductor on the CPU and checks where the pass
left every transfer kernel, and that gradients equal torch.compile's.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
from torch import fx

import storm_compile.compiler.pin_transfers as pin
from storm_compile import storm
from storm_compile.cli.models import LLAMA_PRESETS, GPTShape, add_lora, build_gpt, build_llama
from storm_compile.fx.graphs import COST_KEY, NodeCost
from storm_compile.runtime import ops
from storm_compile.weights.streaming import stream_parameters

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class _Dep:
    name: str


class _Kernel:
    def __init__(self, node: fx.Node) -> None:
        self.origins = {node}
        self.op_overload = node.target

    def get_origins(self) -> set[fx.Node]:
        return self.origins


class _SNode:
    """What ``pin_transfers`` reads of an Inductor scheduler node."""

    def __init__(self, node: fx.Node, deps: list[fx.Node]) -> None:
        self.name = node.name
        self.node = _Kernel(node)
        self.unmet_dependencies = [_Dep(d.name) for d in deps]

    def get_nodes(self) -> list[_SNode]:
        return [self]

    def get_buffer_names(self) -> list[str]:
        return [self.name]

    def get_operation_names(self) -> list[str]:
        return [f"op_{self.name}"]

    def __repr__(self) -> str:
        return self.name


def _forward() -> dict[str, _SNode]:
    """``a = relu(x); off = offload(a); b = mul(a, a); c = add(b, b); d = neg(x)`` in that FX
    order, one scheduler node per call."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_function(aten.relu.default, (x,), name="a")
    off = graph.call_function(ops.offload, (a, 0), name="off")
    b = graph.call_function(aten.mul.Tensor, (a, a), name="b")
    c = graph.call_function(aten.add.Tensor, (b, b), name="c")
    d = graph.call_function(aten.neg.default, (x,), name="d")
    graph.output((off, c, d))
    return {"a": _SNode(a, []), "off": _SNode(off, [a]), "b": _SNode(b, [a]),
            "c": _SNode(c, [b]), "d": _SNode(d, [])}


def _names(snodes) -> list[str]:
    return [s.name for s in snodes]


def test_golden_offload_moved_late_goes_back_after_its_anchor():
    s = _forward()
    reordered = [s["a"], s["b"], s["d"], s["c"], s["off"]]
    assert _names(pin.pin_transfers(reordered)) == ["a", "off", "b", "d", "c"]


def test_golden_transfer_waits_for_an_input_moved_after_its_anchor():
    s = _forward()
    s["off"].unmet_dependencies.append(_Dep("c"))
    reordered = [s["a"], s["b"], s["d"], s["c"], s["off"]]
    assert _names(pin.pin_transfers(reordered)) == ["a", "b", "d", "c", "off"]


MATMUL_S = 1e-3
CLONE_S = 1e-5


def _backward() -> dict[str, _SNode]:
    """``g = mm(x, x)`` (a weight's gradient), sent home, the compute stream waiting on it after
    ``y = neg(x)``, then ``c = clone(x)`` and ``z = relu(y)``, in that FX order, one scheduler
    node per call; the matmul-sized nodes are predicted at ``MATMUL_S``, the clone at
    ``CLONE_S``."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    g = graph.call_function(aten.mm.default, (x, x), name="g")
    send = graph.call_function(ops.send_grad, (g, 0), name="send")
    rec = graph.call_function(ops.record_event, (send,), name="rec")
    y = graph.call_function(aten.neg.default, (x,), name="y")
    wait = graph.call_function(ops.wait_event, (rec, g), name="wait")
    acc = graph.call_function(ops.accumulate_grad, (wait, x), name="acc")
    c = graph.call_function(aten.clone.default, (x,), name="c")
    z = graph.call_function(aten.relu.default, (y,), name="z")
    graph.output((acc, c, z))
    for node, seconds in ((g, MATMUL_S), (y, MATMUL_S), (c, CLONE_S), (z, MATMUL_S)):
        node.meta[COST_KEY] = NodeCost(output_bytes=0, is_compute=True, compute_s=seconds)
    return {"g": _SNode(g, []), "send": _SNode(send, [g]), "rec": _SNode(rec, [send]),
            "y": _SNode(y, []), "wait": _SNode(wait, [rec, g]), "acc": _SNode(acc, [wait]),
            "c": _SNode(c, []), "z": _SNode(z, [y])}


def test_golden_a_wait_keeps_its_copys_overlap_when_its_compute_moves_before_the_copy():
    """Inductor runs ``y`` before the gradient: the wait storm put after ``y`` would follow the
    copy at once (the compute stream idle for the whole copy). It goes after the kernels past
    the copy that are predicted to take as long as ``y``: past the short clone, after ``z``."""
    s = _backward()
    reordered = [s["y"], s["g"], s["send"], s["rec"], s["wait"], s["acc"], s["c"], s["z"]]
    assert _names(pin.pin_transfers(reordered)) == ["y", "g", "send", "rec", "c", "z", "wait",
                                                     "acc"]


def test_golden_a_wait_stays_after_its_anchor_when_the_compute_order_is_kept():
    s = _backward()
    kept = [s["g"], s["send"], s["rec"], s["y"], s["wait"], s["acc"], s["c"], s["z"]]
    assert _names(pin.pin_transfers(kept)) == _names(kept)


def _layers() -> dict[str, _SNode]:
    """Two layers that read streamed weights: ``a = relu(x)``, ``p = prefetch(w)``, ``s =
    sin(x)`` (kept for the backward), ``wt = wait_event(p)``, ``c = mm(a, wt)``, then ``p2 =
    prefetch(w2)``, ``wt2 = wait_event(p2)``, ``d = mm(c, wt2)``, in that FX order, one
    scheduler node per call."""
    graph = fx.Graph()
    x, w, w2 = graph.placeholder("x"), graph.placeholder("w"), graph.placeholder("w2")
    a = graph.call_function(aten.relu.default, (x,), name="a")
    p = graph.call_function(ops.prefetch, (w, "cuda"), name="p")
    s = graph.call_function(aten.sin.default, (x,), name="s")
    wt = graph.call_function(ops.wait_event, (p,), name="wt")
    c = graph.call_function(aten.mm.default, (a, wt), name="c")
    p2 = graph.call_function(ops.prefetch, (w2, "cuda"), name="p2")
    wt2 = graph.call_function(ops.wait_event, (p2,), name="wt2")
    d = graph.call_function(aten.mm.default, (c, wt2), name="d")
    graph.output((d, s))
    return {"a": _SNode(a, []), "p": _SNode(p, []), "s": _SNode(s, []), "wt": _SNode(wt, [p]),
            "c": _SNode(c, [a, wt]), "p2": _SNode(p2, []), "wt2": _SNode(wt2, [p2]),
            "d": _SNode(d, [c, wt2])}


def test_golden_a_wait_whose_anchor_moved_late_holds_back_no_later_prefetch():
    """Inductor runs ``s`` (only saved for the backward) last, after the matmul that reads the
    wait anchored after ``s``. The wait goes right before that matmul instead of after ``s``:
    waiting for ``s`` would hold back the rest of the graph and let the next layer's prefetch
    run first."""
    s = _layers()
    reordered = [s[n] for n in ("a", "p", "wt", "c", "p2", "wt2", "d", "s")]
    assert _names(pin.pin_transfers(reordered)) == ["a", "p", "wt", "c", "p2", "wt2", "d", "s"]


class _HandOut(_SNode):
    """Inductor's ``MultiOutput`` after a fallback kernel: it only hands out what the kernel
    of ``node`` returned (no op of its own; ``node`` is its origin)."""

    def __init__(self, name: str, node: fx.Node, kernel: _SNode) -> None:
        super().__init__(node, [node])
        self.name = name
        self.node.op_overload = None
        self.unmet_dependencies = [_Dep(kernel.name)]


def test_golden_prefetches_breadth_first_at_the_top_go_back_to_their_anchors():
    """Inductor's breadth-first order runs every prefetch (it reads only a graph input) and
    the ``MultiOutput`` handing out its copy first. Each goes back after its anchor: a hand-out
    is part of its copy, not a reader of it (read as one, every prefetch would stay at the top,
    the 70B forward's weights all prefetched before its first layer)."""
    s = _layers()
    graph = next(iter(s["p"].node.get_origins())).graph
    fx_nodes = {n.name: n for n in graph.nodes}
    s["p_out"] = _HandOut("p_out", fx_nodes["p"], s["p"])
    s["p2_out"] = _HandOut("p2_out", fx_nodes["p2"], s["p2"])
    s["wt"].unmet_dependencies = [_Dep("p_out")]
    s["wt2"].unmet_dependencies = [_Dep("p2_out")]
    breadth_first = [s[n] for n in ("p", "p_out", "p2", "p2_out", "a", "wt", "c", "wt2", "d",
                                    "s")]
    assert _names(pin.pin_transfers(breadth_first)) == [
        "a", "p", "p_out", "wt", "c", "p2", "p2_out", "wt2", "d", "s"]


def _resident_weight_graph() -> tuple[fx.Graph, dict[str, fx.Node], dict[str, _SNode]]:
    """``a = relu(x)``, the code book's copy ``book``, a resident weight's copy ``r`` and ``q``
    computing on both (as a quantized weight's dequantization), the next weight's prefetch
    ``p2``, ``c = mm(a, q)``, its wait ``wt2`` and ``d = mm(c, wt2)``, in that FX order; one
    scheduler node per call but ``book``'s."""
    graph = fx.Graph()
    x, w, w2 = graph.placeholder("x"), graph.placeholder("w"), graph.placeholder("w2")
    a = graph.call_function(aten.relu.default, (x,), name="a")
    book = graph.call_function(aten.lift_fresh_copy.default, (graph.get_attr("code"),),
                               name="book")
    r = graph.call_function(ops.resident_weight, (w, "cuda"), name="r")
    q = graph.call_function(aten.mul.Tensor, (r, book), name="q")
    p2 = graph.call_function(ops.prefetch, (w2, "cuda"), name="p2")
    c = graph.call_function(aten.mm.default, (a, q), name="c")
    wt2 = graph.call_function(ops.wait_event, (p2,), name="wt2")
    d = graph.call_function(aten.mm.default, (c, wt2), name="d")
    graph.output((d,))
    named = {n.name: n for n in graph.nodes}
    s = {"a": _SNode(a, []), "r": _SNode(r, []), "q": _SNode(q, [r]), "p2": _SNode(p2, []),
         "c": _SNode(c, [a, q]), "wt2": _SNode(wt2, [p2]), "d": _SNode(d, [c, wt2])}
    return graph, named, s


def test_golden_a_resident_weights_copy_and_dequantization_go_back_to_their_anchor():
    """Inductor runs a resident weight's copy and what computes only on it and on constants
    (``q``, with ``book`` in a kernel of its own) first, as they read no activation: they and
    the next prefetch, whose FX anchor they would otherwise be, go back after ``a``, where storm
    put them (the 70B forward otherwise prefetched every layer's weights before its first
    matmul)."""
    graph, n, s = _resident_weight_graph()
    s["book"] = _SNode(n["book"], [])
    s["q"].unmet_dependencies.append(_Dep("book"))
    assert pin.weight_work(graph) == ({n["r"], n["q"]}, {n["book"]})
    inductor = [s[k] for k in ("book", "r", "p2", "q", "wt2", "a", "c", "d")]
    assert _names(pin.pin_transfers(inductor)) == ["book", "a", "r", "q", "p2", "c", "wt2",
                                                    "d"]


def test_golden_a_dequantization_that_inlines_its_code_book_goes_back_to_its_anchor():
    """On the GPU Inductor inlines the code book's copy (``book``) into the dequantization's
    kernel (``q``, with both as origins) and runs it first: that kernel moves with the
    weight's copy all the same (as a compute kernel it held the 70B forward's prefetches of
    every layer at its top)."""
    _, n, s = _resident_weight_graph()
    s["q"].node.origins = {n["book"], n["q"]}
    inductor = [s[k] for k in ("r", "q", "p2", "wt2", "a", "c", "d")]
    assert _names(pin.pin_transfers(inductor)) == ["a", "r", "q", "p2", "c", "wt2", "d"]


def test_golden_a_prefetch_after_a_dequantization_goes_before_the_matmul_that_reads_it():
    """Inductor lists what it inlined into a fallback or extern kernel's inputs among that
    kernel's origins: the matmul ``c`` names the dequantization ``q`` it reads, which a kernel
    of its own computes. ``q`` moves with the weight's copy and anchors nothing, so the next
    prefetch, which storm put after ``q``, goes before ``c``, not after it, where its copy would
    start only when that matmul ends (the 70B's feed-forward weights waited so)."""
    _, n, s = _resident_weight_graph()
    s["c"].node.origins = {n["q"], n["c"]}
    inductor = [s[k] for k in ("r", "q", "p2", "wt2", "a", "c", "d")]
    assert _names(pin.pin_transfers(inductor)) == ["a", "r", "q", "p2", "c", "wt2", "d"]


def test_golden_the_product_that_reads_a_dequantized_weight_follows_it():
    """Inductor runs a LoRA adapter's product (``d``, here on ``a`` and its prefetched weight)
    before the base product ``c`` that reads the dequantized weight ``q``. ``q`` goes back after
    its anchor ``a``, so ``c`` follows it, in storm's FX order: else ``q`` is live beside both
    products (at the 70B shape's LM head, a 1.96 GiB weight beside two 1.96 GiB logits, which
    took its 8 layers 1.2 GiB over a 7 GiB budget)."""
    _, n, s = _resident_weight_graph()
    n["d"].args = (n["a"], n["wt2"])
    s["d"].unmet_dependencies = [_Dep("a"), _Dep("wt2")]
    inductor = [s[k] for k in ("a", "p2", "wt2", "d", "r", "q", "c")]
    assert _names(pin.pin_transfers(inductor)) == ["a", "r", "q", "p2", "c", "wt2", "d"]


def test_golden_a_prefetch_whose_anchor_inductor_fused_late_goes_before_its_successor():
    """Inductor fuses ``g`` (a gate's activation) into the kernel of ``e``, after the matmul
    ``c`` that storm put after the prefetch ``p``, whose time the copy was to overlap: ``p``
    goes right before ``c`` (after ``g``'s kernel it would start when ``c`` ended)."""
    graph = fx.Graph()
    x, y, w = graph.placeholder("x"), graph.placeholder("y"), graph.placeholder("w")
    a = graph.call_function(aten.relu.default, (x,), name="a")
    g = graph.call_function(aten.neg.default, (a,), name="g")
    p = graph.call_function(ops.prefetch, (w, "cuda"), name="p")
    c = graph.call_function(aten.mm.default, (a, y), name="c")
    e = graph.call_function(aten.add.Tensor, (g, c), name="e")
    wt = graph.call_function(ops.wait_event, (p,), name="wt")
    d = graph.call_function(aten.mm.default, (e, wt), name="d")
    graph.output((d,))
    ge = _SNode(e, [a, c])
    ge.name = "ge"
    ge.node.origins = {g, e}
    s = {"a": _SNode(a, []), "p": _SNode(p, []), "c": _SNode(c, [a]), "ge": ge,
         "wt": _SNode(wt, [p]), "d": _SNode(d, [e, wt])}
    s["d"].unmet_dependencies = [_Dep("ge"), _Dep("wt")]
    inductor = [s[k] for k in ("p", "a", "c", "ge", "wt", "d")]
    assert _names(pin.pin_transfers(inductor)) == ["a", "p", "c", "ge", "wt", "d"]


def test_each_placement_is_a_debug_line(caplog):
    s = _layers()
    breadth_first = [s[n] for n in ("p", "p2", "a", "wt", "c", "wt2", "d", "s")]
    with caplog.at_level(logging.DEBUG, logger="storm_compile"):
        result = pin.pin_transfers(breadth_first)
    assert _names(result) == ["a", "p", "wt", "c", "p2", "wt2", "d", "s"]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("pin_transfers")]
    assert len(lines) == 4
    assert "pin_transfers: p2 after c (kernel 4, 4 with its overlap), before kernel 6, first " \
           "reader kernel 6: kernel 4 of 8, was 1" in lines


def test_golden_a_kernel_computing_from_constants_alone_anchors_nothing():
    """Inductor runs ``t`` (a rotary table from ``arange``: no input at all) first. The prefetch
    storm put after it goes after ``a``, the last node before it that Inductor could not
    move up (each layer's prefetch otherwise followed its layer's table to the top)."""
    graph = fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    a = graph.call_function(aten.relu.default, (x,), name="a")
    i = graph.call_function(aten.arange.default, (8,), name="i")
    t = graph.call_function(aten.cos.default, (i,), name="t")
    p = graph.call_function(ops.prefetch, (w, "cuda"), name="p")
    wt = graph.call_function(ops.wait_event, (p,), name="wt")
    b = graph.call_function(aten.mm.default, (a, wt), name="b")
    u = graph.call_function(aten.mul.Tensor, (b, t), name="u")
    graph.output((u,))
    t_kernel = _SNode(t, [])
    t_kernel.node.origins = {i, t}
    s = {"t": t_kernel, "a": _SNode(a, []), "p": _SNode(p, []), "wt": _SNode(wt, [p]),
         "b": _SNode(b, [a, wt]), "u": _SNode(u, [b, t])}
    assert pin.weight_work(graph) == (set(), {i, t})
    inductor = [s[n] for n in ("t", "p", "wt", "a", "b", "u")]
    assert _names(pin.pin_transfers(inductor)) == ["t", "a", "p", "wt", "b", "u"]


def test_golden_a_node_two_kernels_compute_anchors_nothing():
    """Inductor copies an input of ``a`` in a kernel of its own (``a_in``, whose origin is
    ``a`` too) and runs it first. ``a`` marks no one point of the order: the prefetch and its
    wait storm put after ``a`` go after ``s``, the last node before them that one kernel
    computes, wherever Inductor put them."""
    graph = fx.Graph()
    x, y, w = graph.placeholder("x"), graph.placeholder("y"), graph.placeholder("w")
    s_ = graph.call_function(aten.sin.default, (y,), name="s")
    a = graph.call_function(aten.relu.default, (x,), name="a")
    p = graph.call_function(ops.prefetch, (w, "cuda"), name="p")
    wt = graph.call_function(ops.wait_event, (p,), name="wt")
    b = graph.call_function(aten.mm.default, (a, wt), name="b")
    graph.output((b, s_))
    a_in = _SNode(a, [])
    a_in.name = "a_in"
    s = {"a_in": a_in, "s": _SNode(s_, []), "a": _SNode(a, []), "p": _SNode(p, []),
         "wt": _SNode(wt, [p]), "b": _SNode(b, [a, wt])}
    s["a"].unmet_dependencies = [_Dep("a_in")]
    for inductor in (("a_in", "s", "a", "p", "wt", "b"), ("a_in", "p", "wt", "s", "a", "b")):
        assert _names(pin.pin_transfers([s[n] for n in inductor])) == [
            "a_in", "s", "p", "wt", "a", "b"]


def test_compute_order_is_kept_and_the_result_is_topological():
    s = _forward()
    reordered = [s["d"], s["a"], s["b"], s["off"], s["c"]]
    result = pin.pin_transfers(reordered)
    assert sorted(_names(result)) == sorted(_names(reordered))
    compute = [n for n in _names(result) if n != "off"]
    assert compute == ["d", "a", "b", "c"]
    seen: set[str] = set()
    for snode in result:
        assert all(d.name in seen for d in snode.unmet_dependencies), snode
        seen.add(snode.name)
    assert _names(result) == ["d", "a", "off", "b", "c"]


def test_no_transfers_leaves_the_order_alone():
    s = _forward()
    reordered = [s["d"], s["a"], s["b"], s["c"]]
    assert pin.pin_transfers(reordered) is reordered


def test_idempotent():
    s = _forward()
    once = pin.pin_transfers([s["a"], s["b"], s["d"], s["c"], s["off"]])
    assert pin.pin_transfers(once) == once


def test_a_dependency_cycle_is_an_error():
    s = _forward()
    s["a"].unmet_dependencies.append(_Dep("c"))
    with pytest.raises(RuntimeError, match="cycle"):
        pin.pin_transfers([s["a"], s["b"], s["c"], s["off"]])


def test_user_comm_overlap_passes_run_first():
    def mine(snodes):
        return snodes

    with inductor_config.patch(reorder_for_compute_comm_overlap=False,
                               reorder_for_compute_comm_overlap_passes=[mine]):
        assert pin.inductor_patches()["reorder_for_compute_comm_overlap_passes"] == \
            [pin.pin_transfers]
    with inductor_config.patch(reorder_for_compute_comm_overlap=True,
                               reorder_for_compute_comm_overlap_passes=[mine]):
        assert pin.inductor_patches()["reorder_for_compute_comm_overlap_passes"] == \
            [mine, pin.pin_transfers]


SHAPE = GPTShape(d_model=64, heads=4, seq=32, batch=2, layers=2, dtype="float32")
CPU_OPTIONS = {"transfer_cpu_tensors": True, "min_offload_bytes": 0}
"""Inductor's C++ backend compiles storm's graphs; every activation is planned."""
LORA_RANK = 4
STREAMED_ABOVE_BYTES = 8192
"""The tiny Llama's matrices stream, its norm weights stay resident."""
PREFETCH_WINDOW_BYTES = 4096
"""Below one streamed matrix: storm prefetches each weight shortly before its layer reads it
(a few unread at any point of its FX graphs), as a large model's window does."""


def _grads(model, x: torch.Tensor, backend) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    torch.compile(model, backend=backend)(x).pow(2).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


_SEEN: list[list] = []
_PIN = pin.pin_transfers


def _spy(snodes):
    """``pin_transfers``, keeping each order it returns (module level: Inductor pickles its
    config, passes included, into the FX graph cache key)."""
    result = _PIN(snodes)
    _SEEN.append(result)
    return result


def test_inductor_runs_it_on_storm_graphs_and_gradients_match(monkeypatch):
    monkeypatch.setattr(pin, "pin_transfers", _spy)
    _SEEN.clear()
    seen = _SEEN
    torch.manual_seed(0)
    model, (x,) = build_gpt(SHAPE, "cpu")
    with inductor_config.patch(fx_graph_cache=False), \
            functorch_config.patch(enable_autograd_cache=False):  # the scheduler must run
        grads = _grads(model, x, storm(memory_budget=0.5, **CPU_OPTIONS))
    assert seen, "Inductor did not run the pass"
    for result in seen:
        transfers, kernel_of, _ = pin.placed(result)
        earliest, latest = pin._earliest(kernel_of), pin._latest(kernel_of, len(result))
        readers = pin.first_readers(result, transfers, pin.dependencies(result)[0])
        for index, snode in enumerate(result):
            node = transfers.get(id(snode))
            if node is None:
                continue
            anchor, reader = earliest(node), readers[id(snode)]
            producers = [result.index(p) for p in result[:index]
                         if {*p.get_buffer_names(), *p.get_operation_names()}
                         & {d.name for d in snode.unmet_dependencies}]
            assert all(i < index < reader for i in producers)
            limit = min(reader, latest(node))
            if limit <= anchor:     # Inductor runs its reader or successor before its anchor
                between = [s for s in result[index + 1:limit] if id(s) not in transfers]
                assert between == [], f"{node.name} is not right before its reader or successor"
                continue
            assert index > anchor
            between = [s for s in result[max([anchor, *producers]) + 1:index]
                       if id(s) not in transfers]
            assert between == [], f"{node.name} is not right after its anchor or overlap"
    reference = _grads(model, x, "inductor")
    for name, grad in reference.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


_GIVEN: list[tuple[list, list]] = []


def _spy_both(snodes):
    """``pin_transfers``, keeping the order Inductor gave it and the order it returns."""
    result = _PIN(snodes)
    _GIVEN.append((list(snodes), result))
    return result


def _moves_only(snode) -> bool:
    """Whether every FX node a scheduler node computes is a storm transfer op (a copy, a wait,
    or Inductor's hand-out of what one returned)."""
    origins = [o for inner in snode.get_nodes() if inner.node is not None
               for o in inner.node.get_origins()]
    return all(o.target in ops.TRANSFER_OPS for o in origins)


def _unread_prefetches(order: list) -> int:
    """The most prefetches a scheduler-node ``order`` has issued and not yet read (by a
    kernel other than a transfer or a hand-out of one) at any point."""
    index = {id(s): i for i, s in enumerate(order)}
    successors, _ = pin.dependencies(order)

    def first_reader(snode) -> int:
        first, stack, seen = len(order), list(successors[id(snode)]), set()
        while stack:
            user = stack.pop()
            if id(user) not in seen:
                seen.add(id(user))
                if not _moves_only(user):
                    first = min(first, index[id(user)])
                else:
                    stack.extend(successors[id(user)])
        return first

    return _most_open([(index[id(s)], first_reader(s)) for s in order
                       if getattr(getattr(s, "node", None), "op_overload", None) is ops.prefetch])


def _most_open(spans: list[tuple[int, int]]) -> int:
    events = sorted([(begin, 1) for begin, _ in spans] + [(end, -1) for _, end in spans])
    open_, most = 0, 0
    for _, step in events:
        open_ += step
        most = max(most, open_)
    return most


def _unread_in_fx(graph: fx.Graph) -> int:
    """The same count in storm's FX order."""
    position = {n: i for i, n in enumerate(graph.nodes)}

    def first_reader(node: fx.Node) -> int:
        readers, stack = [], list(node.users)
        while stack:
            user = stack.pop()
            if user.target in ops.TRANSFER_OPS:
                stack.extend(user.users)
            else:
                readers.append(position[user])
        return min(readers)

    return _most_open([(position[n], first_reader(n)) for n in graph.nodes
                       if n.target is ops.prefetch])


def test_prefetches_inductor_ran_breadth_first_stay_as_few_as_storm_placed(monkeypatch):
    """Inductor's breadth-first order (one of the orders its peak-memory pass picks from) runs
    every prefetch of a streamed model first, as they read only graph inputs. After the pass,
    no more prefetched weights wait unread at any point than in storm's FX graphs."""
    import torch._inductor.memory as memory

    keep_order = memory.reorder_for_peak_memory

    def breadth_first(nodes, *args, **kwargs):
        keep_order(nodes, *args, methods=[])    # the planning facts the sort reads
        return memory.topological_sort_bfs(nodes)

    monkeypatch.setattr(memory, "reorder_for_peak_memory", breadth_first)
    monkeypatch.setattr(pin, "pin_transfers", _spy_both)
    _GIVEN.clear()
    torch.manual_seed(0)
    model, batch = build_llama(dataclasses.replace(LLAMA_PRESETS["tiny"], layers=3), "cpu")
    add_lora(model, LORA_RANK)
    stream_parameters(model, "cpu", resident_bytes=STREAMED_ABOVE_BYTES, host_format="nf4")
    backend = storm(prefetch_window_bytes=PREFETCH_WINDOW_BYTES, **CPU_OPTIONS)
    with inductor_config.patch(fx_graph_cache=False), \
            functorch_config.patch(enable_autograd_cache=False):
        torch.compile(model, backend=backend)(*batch).backward()
    assert len(_GIVEN) == 2, "both graphs compiled through the pass"
    for given, pinned in _GIVEN:
        fx_graph = next(pin._transfer_node(s) for s in pinned
                        if pin._transfer_node(s) is not None).graph
        planned = _unread_in_fx(fx_graph)
        assert _unread_prefetches(given) > planned, "Inductor ran the prefetches first"
        assert _unread_prefetches(pinned) <= planned
