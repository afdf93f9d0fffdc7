"""Structure and properties of the rewritten graphs (plan_offload + insert_transfers + verify)."""

import pytest
import torch
from torch import fx

from helpers import capture, compute_between, nodes
from storm_compile import ops
from storm_compile.config import DEFAULT_OFFLOAD_WAIT_DISTANCE, DEFAULT_PREFETCH_DISTANCE
from storm_compile.graphs import (
    COST_KEY,
    DECISION_KEY,
    PassContext,
    StormGraphs,
    alias_root,
    model_outputs,
    saved_values,
)
from storm_compile.config import StormConfig
from storm_compile.pipeline import run_passes
from storm_compile.passes import StormVerificationError, verify_graphs
from zoo import ZOO

MODELS = sorted(ZOO)
DISTANCES = {"prefetch_distance": DEFAULT_PREFETCH_DISTANCE,
             "offload_wait_distance": DEFAULT_OFFLOAD_WAIT_DISTANCE}


def _order(gm: fx.GraphModule) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(gm.graph.nodes)}


def _compute_after(gm, node):
    order = _order(gm)
    return sum(1 for n in gm.graph.nodes if order[n] > order[node]
               and COST_KEY in n.meta and n.meta[COST_KEY].is_compute)


@pytest.mark.parametrize("name", MODELS)
def test_forward_pattern(name):
    graphs = capture(name, **DISTANCES)
    fw = graphs.forward
    order = _order(fw)
    for offload in nodes(fw, ops.offload):
        (record,) = offload.users
        (wait,) = record.users
        assert record.target is ops.record_event and wait.target is ops.wait_event
        assert order[offload] < order[record] < order[wait]
        source = offload.args[0]
        assert order[source] < order[offload]
        # the wait sits offload_wait_distance compute nodes on, or after the last forward use
        assert compute_between(fw, record, wait) >= min(DEFAULT_OFFLOAD_WAIT_DISTANCE,
                                                        _compute_after(fw, record))
        readers = [u for n in fw.graph.nodes if alias_root(n) is source for u in n.users]
        assert all(order[u] <= order[wait] for u in readers), "read after its offload's wait"


def _first_reader(wait: fx.Node, order) -> fx.Node:
    """The first compute node reading ``wait``'s result, directly or through replayed views."""
    readers, frontier = [], [wait]
    while frontier:
        for user in frontier.pop().users:
            is_compute = COST_KEY in user.meta and user.meta[COST_KEY].is_compute
            (readers if is_compute or user.op == "output" else frontier).append(user)
    return min(readers, key=order.__getitem__)


@pytest.mark.parametrize("name", MODELS)
def test_backward_pattern(name):
    graphs = capture(name, **DISTANCES)
    bw = graphs.backward
    order = _order(bw)
    for prefetch in nodes(bw, ops.prefetch):
        (record,) = prefetch.users
        (wait,) = record.users
        source = prefetch.args[0]
        assert source.op == "placeholder"
        assert set(source.users) == {prefetch, wait}
        first_use = _first_reader(wait, order)
        assert order[prefetch] < order[record] < order[wait] < order[first_use]
        assert compute_between(bw, wait, first_use) == 0, "the wait sits right before first use"
        before = compute_between(bw, prefetch, first_use)
        available = compute_between(bw, next(iter(bw.graph.find_nodes(op="placeholder"))),
                                    first_use)
        assert before >= min(DEFAULT_PREFETCH_DISTANCE, available)


@pytest.mark.parametrize("name", MODELS)
def test_never_offloads_inputs_or_outputs(name):
    graphs = capture(name)
    visible = {alias_root(n) for n in model_outputs(graphs)}
    for offload in nodes(graphs.forward, ops.offload):
        source = offload.args[0]
        assert source.op != "placeholder"
        assert source not in visible


@pytest.mark.parametrize("name", MODELS)
def test_every_saved_value_has_a_decision_and_offloads_follow_it(name):
    graphs = capture(name)
    offloaded = {o.args[0].name for o in nodes(graphs.forward, ops.offload)}
    for node in graphs.forward.graph.nodes:
        decision = node.meta.get(DECISION_KEY)
        if decision is not None:
            assert (decision.action == "offload") == (decision.storage in offloaded), node.name


@pytest.mark.parametrize("name", MODELS)
def test_idempotent(name):
    graphs = capture(name)
    fw_code, bw_code = graphs.forward.code, graphs.backward.code
    again = run_passes(graphs, PassContext(StormConfig.from_options(
        transfer_cpu_tensors=True, min_offload_bytes=0)))
    assert again.forward.code == fw_code and again.backward.code == bw_code


@pytest.mark.parametrize("name", MODELS)
def test_noop_when_nothing_qualifies(name):
    graphs = capture(name, min_offload_bytes=1 << 40)
    for gm in (graphs.forward, graphs.backward):
        assert not any(n.target in ops.TRANSFER_OPS for n in gm.graph.nodes)
    assert all(n.meta[DECISION_KEY].action == "keep" for n in saved_values(graphs))


def test_cpu_model_is_left_alone_without_transfer_cpu_tensors(caplog):
    with caplog.at_level("DEBUG", logger="storm_compile"):
        graphs = capture("mlp", transfer_cpu_tensors=False)
    assert not nodes(graphs.forward, ops.offload)
    reasons = {n.meta[DECISION_KEY].reason for n in saved_values(graphs)}
    assert any("not a CUDA device" in r for r in reasons)
    assert sum("nothing to offload" in r.message for r in caplog.records) == 1


def test_inference_graph_logs_and_runs(caplog):
    from storm_compile import storm

    model = torch.nn.Linear(8, 8)
    with caplog.at_level("DEBUG", logger="storm_compile"), torch.no_grad():
        out = torch.compile(model, backend=storm(inner="eager"))(torch.randn(2, 8))
    assert out.shape == (2, 8)
    assert sum("inference graph" in r.message for r in caplog.records) == 1


def test_views_of_one_storage_cross_once():
    """q, k and v are views of one fused QKV output: one transfer carries all three."""
    graphs = capture("gpt")
    sources = [o.args[0] for o in nodes(graphs.forward, ops.offload)]
    assert len(sources) == len(set(sources))
    saved_views = [n for n in saved_values(graphs) if n.target is torch.ops.aten.transpose.int]
    assert not saved_views, "saved views should have been replaced by their storage's transfer"
    replayed = nodes(graphs.backward, torch.ops.aten.transpose.int)
    assert replayed, "the backward rebuilds the views from the prefetched storage"


def _break_by_reading_after_wait(graphs: StormGraphs) -> None:
    fw = graphs.forward.graph
    offload = nodes(graphs.forward, ops.offload)[0]
    (wait,) = next(iter(offload.users)).users
    with fw.inserting_after(wait):
        fw.call_function(torch.ops.aten.neg.default, (offload.args[0],))


def _break_by_reading_host_copy(graphs: StormGraphs) -> None:
    bw = graphs.backward.graph
    prefetch = nodes(graphs.backward, ops.prefetch)[0]
    with bw.inserting_after(prefetch):
        bw.call_function(torch.ops.aten.neg.default, (prefetch.args[0],))


def _break_by_skipping_record(graphs: StormGraphs) -> None:
    prefetch = nodes(graphs.backward, ops.prefetch)[0]
    (record,) = prefetch.users
    (wait,) = record.users
    wait.replace_input_with(record, prefetch)


@pytest.mark.parametrize("breaker", [_break_by_reading_after_wait, _break_by_reading_host_copy,
                                     _break_by_skipping_record])
def test_verify_rejects_broken_graphs(breaker):
    graphs = capture("mlp")
    verify_graphs(graphs)
    breaker(graphs)
    with pytest.raises(StormVerificationError):
        verify_graphs(graphs)
