"""Structure and properties of the rewritten graphs, over every zoo model."""

import pytest
import torch
from torch import fx

from helpers import capture, compute_between, cost_model, nodes
from storm_compile.compiler.pipeline import run_passes
from storm_compile.config import StormConfig
from storm_compile.cost.simulate import simulate
from storm_compile.fx import graphs as graphs_module
from storm_compile.fx.graphs import COST_KEY, PassContext, StormGraphs, model_outputs, saved_values
from storm_compile.fx.plan import Action, Rule, Unplaced
from storm_compile.fx.vocabulary import storage_owner
from storm_compile.passes import StormVerificationError, verify_graphs
from storm_compile.runtime import ops
from zoo import ZOO

MODELS = sorted(ZOO)
SLOW_COMPUTE_S = 1.0
"""A compute time per node long enough that every copy hides behind one node."""


def _order(gm: fx.GraphModule) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(gm.graph.nodes)}


def _first_reader(wait: fx.Node, order) -> fx.Node:
    """The first compute node reading ``wait``'s result, directly or through replayed views."""
    readers, frontier = [], [wait]
    while frontier:
        for user in frontier.pop().users:
            is_compute = COST_KEY in user.meta and user.meta[COST_KEY].is_compute
            (readers if is_compute or user.op == "output" else frontier).append(user)
    return min(readers, key=order.__getitem__)


def _chain(transfer: fx.Node) -> tuple[fx.Node, fx.Node]:
    (record,) = transfer.users
    (wait,) = record.users
    assert record.target is ops.record_event and wait.target is ops.wait_event
    return record, wait


@pytest.mark.parametrize("name", MODELS)
def test_forward_pattern(name):
    graphs = capture(name)
    fw = graphs.forward
    order = _order(fw)
    for offload in nodes(fw, ops.offload):
        record, wait = _chain(offload)
        source = offload.args[0]
        assert order[source] < order[offload] < order[record] < order[wait]
        anchor = graphs.storages.decisions[source].placement.wait_after
        assert order[anchor] < order[wait] and compute_between(fw, anchor, wait) == 0
        readers = [u for n in fw.graph.nodes if storage_owner(n) is source for u in n.users]
        assert all(order[u] <= order[wait] for u in readers), "read after its offload's wait"


@pytest.mark.parametrize("name", MODELS)
def test_backward_pattern(name):
    graphs = capture(name)
    bw = graphs.backward
    order = _order(bw)
    for prefetch in nodes(bw, ops.prefetch):
        record, wait = _chain(prefetch)
        source = prefetch.args[0]
        assert source.op == "placeholder" and set(source.users) == {prefetch, wait}
        first_use = _first_reader(wait, order)
        assert order[prefetch] < order[record] < order[wait] < order[first_use]
        assert compute_between(bw, wait, first_use) == 0, "the wait sits right before first use"


@pytest.mark.parametrize("name", MODELS)
def test_no_copy_starts_before_its_producer(name):
    graphs = capture(name)
    prediction = simulate(graphs, cost_model())
    ends = {(t.graph, t.node): t.end_s for t in prediction.timings}
    for copy in prediction.copies:
        gm = graphs.forward if copy.graph == "fw" else graphs.backward
        transfer = next(n for n in gm.graph.nodes if n.name == copy.node)
        assert copy.start_s >= ends[(copy.graph, transfer.args[0].name)]
        _, wait = _chain(transfer)
        assert ends[(copy.graph, wait.name)] >= copy.end_s, "a wait released before its copy"


@pytest.mark.parametrize("name", MODELS)
def test_simulated_memory_is_bounded_by_live_tensors(name):
    graphs = capture(name)
    for prediction in (simulate(graphs, cost_model()), graphs.plan.baseline):
        everything = sum(n.meta[COST_KEY].output_bytes for gm in (graphs.forward, graphs.backward)
                         for n in gm.graph.nodes if COST_KEY in n.meta and n.op != "placeholder")
        assert 0 <= prediction.peak_bytes <= everything + sum(
            n.meta[COST_KEY].output_bytes for n in graphs.backward.graph.find_nodes(
                op="placeholder"))
        assert all(t.memory_after >= 0 for t in prediction.timings)


@pytest.mark.parametrize("name", MODELS)
def test_offloading_lowers_predicted_activation_memory(name):
    graphs = capture(name)
    cost = cost_model()
    storm_run, baseline = simulate(graphs, cost), graphs.plan.baseline
    assert storm_run.activation_bytes == baseline.activation_bytes - storm_run.offloaded_bytes
    assert storm_run.peak_bytes <= baseline.peak_bytes


@pytest.mark.parametrize("name", MODELS)
def test_never_offloads_inputs_or_outputs(name):
    graphs = capture(name)
    visible = {storage_owner(n) for n in model_outputs(graphs)}
    for offload in nodes(graphs.forward, ops.offload):
        source = offload.args[0]
        assert source.op != "placeholder"
        assert source not in visible


@pytest.mark.parametrize("name", MODELS)
def test_decisions_match_the_rewrite(name):
    graphs = capture(name)
    offloaded = {o.args[0].name for o in nodes(graphs.forward, ops.offload)}
    for storage, decision in graphs.storages:
        assert (decision.action is Action.OFFLOAD) == (storage.name in offloaded), storage.name
        assert (decision.placement is not None) == (decision.action is Action.OFFLOAD)


@pytest.mark.parametrize("name", MODELS)
def test_idempotent(name):
    graphs = capture(name)
    fw_code, bw_code = graphs.forward.code, graphs.backward.code
    config = StormConfig.from_options(transfer_cpu_tensors=True, min_offload_bytes=0,
                                      profile="cpu-test", offload="all")
    again = run_passes(graphs, PassContext(config, cost_model()))
    assert again.forward.code == fw_code and again.backward.code == bw_code


def test_a_joint_graph_is_partitioned_once(monkeypatch):
    joint = capture("gpt").joint
    partitions = []
    partition = graphs_module.min_cut_rematerialization_partition
    monkeypatch.setattr(graphs_module, "min_cut_rematerialization_partition",
                        lambda *args, **kwargs: partitions.append(1) or partition(*args, **kwargs))
    first, again = joint.split(), joint.split()
    assert not partitions, "the pipeline's split is reused"
    assert first[1] is not again[1] and first[1].code == again[1].code
    first[1].graph.erase_node(next(iter(first[1].graph.find_nodes(op="output"))))
    names = [n.name for n in again[1].graph.nodes]
    assert names == [n.name for n in joint.split()[1].graph.nodes], \
        "a copy's rewrite leaves the others alone"
    assert len(first[1].graph.nodes) == len(names) - 1


@pytest.mark.parametrize("name", MODELS)
def test_noop_when_nothing_qualifies(name):
    graphs = capture(name, min_offload_bytes=1 << 40)
    for gm in (graphs.forward, graphs.backward):
        assert not any(n.target in ops.TRANSFER_OPS for n in gm.graph.nodes)
    assert all(d.action is Action.KEEP for _, d in graphs.storages)
    assert {s.root for s in graphs.storages.storages} == \
        {storage_owner(n) for n in saved_values(graphs)}


def test_hidden_mode_keeps_copies_that_would_not_hide():
    graphs = capture("gpt", offload="hidden", cost_override=lambda node: 0.0)
    assert not nodes(graphs.forward, ops.offload)
    late = [d.held for _, d in graphs.storages if isinstance(d.held, Unplaced)]
    assert late and all(d.late_s > 0 for d in late)
    assert all("would end" in str(d) for d in late)


def test_hidden_mode_offloads_when_compute_covers_the_copies():
    graphs = capture("gpt", offload="hidden", cost_override=lambda node: SLOW_COMPUTE_S)
    assert nodes(graphs.forward, ops.offload)
    prediction = simulate(graphs, cost_model())
    assert prediction.copies


def test_cpu_model_is_left_alone_without_transfer_cpu_tensors(caplog):
    with caplog.at_level("DEBUG", logger="storm_compile"):
        graphs = capture("mlp", transfer_cpu_tensors=False)
    assert not nodes(graphs.forward, ops.offload)
    rules = {s.eligibility.rule for s in graphs.storages.storages}
    assert Rule.NOT_ON_CUDA in rules
    assert any("not a CUDA device" in d.reason for _, d in graphs.storages)
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
    assert nodes(graphs.backward, torch.ops.aten.transpose.int), "views rebuilt in the backward"


def _break_by_reading_after_wait(graphs: StormGraphs) -> None:
    fw = graphs.forward.graph
    offload = nodes(graphs.forward, ops.offload)[0]
    _, wait = _chain(offload)
    with fw.inserting_after(wait):
        fw.call_function(torch.ops.aten.neg.default, (offload.args[0],))


def _break_by_reading_host_copy(graphs: StormGraphs) -> None:
    bw = graphs.backward.graph
    prefetch = nodes(graphs.backward, ops.prefetch)[0]
    with bw.inserting_after(prefetch):
        bw.call_function(torch.ops.aten.neg.default, (prefetch.args[0],))


def _break_by_skipping_record(graphs: StormGraphs) -> None:
    prefetch = nodes(graphs.backward, ops.prefetch)[0]
    record, wait = _chain(prefetch)
    wait.replace_input_with(record, prefetch)


@pytest.mark.parametrize("breaker", [_break_by_reading_after_wait, _break_by_reading_host_copy,
                                     _break_by_skipping_record])
def test_verify_rejects_broken_graphs(breaker):
    graphs = capture("mlp")
    verify_graphs(graphs)
    breaker(graphs)
    with pytest.raises(StormVerificationError):
        verify_graphs(graphs)
