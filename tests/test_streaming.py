"""Parameters streamed from host memory: same gradients, optimizer steps and state_dict as the
model they came from, in eager mode, under aot_eager and under storm."""

import contextlib
import copy
import dataclasses
import logging
import re
import threading
import time
import warnings

import pytest
import torch
from torch import fx
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

from helpers import CPU_TEST_OPTIONS, asking, cost_model, nodes, streamed, unstreamed_name
from storm_compile import StormOverlapError, storm
from storm_compile.cli.models import LLAMA_PRESETS, add_lora, build_llama
from storm_compile.cli.report import summary
from storm_compile.compiler import pipeline
from storm_compile.compiler.backend import StormBackend
from storm_compile.compiler.pipeline import run_passes
from storm_compile.config import MemoryBudget, StormConfig
from storm_compile.cost.calibrate import host_rates
from storm_compile.cost.cost_model import CostModel
from storm_compile.cost.profiles import PROFILES, DeviceProfile
from storm_compile.cost.simulate import (
    device_bytes,
    predict_step,
    refreshed_weights,
    simulate,
    stepped_weights,
)
from storm_compile.fx.graphs import Limits, PassContext, StormGraphs, saved_values
from storm_compile.fx.plan import Action
from storm_compile.fx.vocabulary import (
    RECOMPUTE_TAG,
    Lane,
    folds_on_device,
    storage_owner,
    sums_on_device,
    tensor_bytes,
)
from storm_compile.passes import (
    StormBudgetError,
    StormVerificationError,
    insert_transfers,
    plan_gradient_sums,
    plan_weights,
    refetch_weights,
    sum_tied_gradients,
    verify_graphs,
)
from storm_compile.planner.step_budget import RunRoom, StepBudget
from storm_compile.runtime import ops
from storm_compile.runtime import streams
from storm_compile.runtime.cycles import ParameterStep
from storm_compile.runtime.streams import (
    HostAdder,
    PinnedPool,
    TransferRuntime,
    bucket_bytes,
    get_runtime,
)
from storm_compile.weights import streaming
from storm_compile.weights.streaming import StormHostMemoryError, stream_parameters

SHAPE = LLAMA_PRESETS["tiny"]
RESIDENT_BYTES = 4096
"""Above the tiny model's norm weights (256 B) and below its smallest matrix (8 KiB)."""
BACKENDS = {"eager": None, "aot_eager": "aot_eager", "storm": storm(**CPU_TEST_OPTIONS)}
STEPS = 3
MICRO_BATCHES = 2
WORKER_SETTLE_S = 0.2
"""Time the adder's thread gets to (wrongly) run a step before the test looks."""


def _pair(shape=SHAPE):
    """A tiny Llama, a streamed copy of it, and a batch."""
    torch.manual_seed(0)
    reference, batch = build_llama(shape)
    model = copy.deepcopy(reference)
    stream_parameters(model, "cpu", resident_bytes=RESIDENT_BYTES)
    return reference, model, batch


def _streamed_graphs(**options):
    """The graphs storm made of the streamed tiny Llama under the CPU test options updated
    with ``options``, and the resolved options."""
    _, model, batch = _pair()
    captured = []
    config = StormConfig.from_options(**{**CPU_TEST_OPTIONS, **options})
    torch.compile(model, backend=StormBackend(config, observer=captured.append))(*batch) \
        .backward()
    return captured[0], config


def _run(model, backend):
    return model if backend is None else torch.compile(model, backend=backend)


def _grads(model) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize("backend", BACKENDS)
def test_streamed_gradients_match(backend):
    reference, model, batch = _pair()
    _run(reference, BACKENDS[backend] and "aot_eager")(*batch).backward()
    loss = _run(model, BACKENDS[backend])(*batch)
    loss.backward()
    assert len(_grads(model)) == len(_grads(reference))
    for grad, expected in zip(_grads(model), _grads(reference)):
        torch.testing.assert_close(grad, expected)


def test_streamed_gradients_match_under_bf16_autocast():
    """The weights' copies to the device are cast by autocast where the model reads them, as
    the resident model's are: same losses and gradients under bf16 autocast."""
    reference, model, batch = _pair()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected_loss = _run(reference, "aot_eager")(*batch)
        loss = _run(model, BACKENDS["storm"])(*batch)
    expected_loss.backward()
    loss.backward()
    assert loss.item() == expected_loss.item()
    for grad, expected in zip(_grads(model), _grads(reference)):
        assert grad.dtype == expected.dtype == torch.float32
        torch.testing.assert_close(grad, expected)


def test_inductor_alone_runs_a_streamed_model_correctly():
    """Without storm the fetches are plain copies in program order: slow, never wrong."""
    reference, model, batch = _pair()
    _run(reference, "inductor")(*batch).backward()
    _run(model, "inductor")(*batch).backward()
    for grad, expected in zip(_grads(model), _grads(reference)):
        torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-5)


def test_weights_are_prefetched_in_both_graphs_and_never_saved():
    _, model, _ = _pair()
    graphs, _ = _streamed_graphs()
    streamed = len(list(model.parameters())) - SHAPE.layers * 2 - 1
    fetches = graphs.storages.fetches
    in_forward = [f for f in fetches if f.node.graph is graphs.forward.graph]
    assert len(in_forward) == streamed and len(fetches) > streamed
    assert not nodes(graphs.backward, ops.grad_to_host)
    assert len(graphs.storages.sends) == len(nodes(graphs.backward, ops.send_grad)) == streamed
    offloaded = len(nodes(graphs.forward, ops.offload))
    for gm, activations in ((graphs.forward, 0), (graphs.backward, offloaded)):
        assert not nodes(gm, ops.fetch_weight)
        assert len(nodes(gm, ops.prefetch)) == \
            len([f for f in fetches if f.node.graph is gm.graph]) + activations
    assert not [n for n in saved_values(graphs) if storage_owner(n).target is ops.prefetch]


def test_gradients_leave_on_the_d2h_stream_and_the_host_adds_them():
    graphs, _ = _streamed_graphs()
    order = {n: i for i, n in enumerate(graphs.backward.graph.nodes)}
    output = graphs.backward.graph.find_nodes(op="output")[0]
    (barrier,) = nodes(graphs.backward, ops.wait_host)
    assert barrier.next is output
    tokens = []
    for send in nodes(graphs.backward, ops.send_grad):
        (record,) = send.users
        (wait,) = record.users
        (add,) = wait.users
        assert add.target is ops.accumulate_grad and list(add.users) == [barrier]
        assert add.args[1].op == "placeholder" and add.args[1].meta["val"].device.type == "cpu"
        assert order[send.args[0]] < order[send] < order[wait] < order[add]
        later = [n for n in graphs.backward.graph.nodes
                 if order[wait] < order[n] and n.target not in (ops.accumulate_grad,
                                                                ops.wait_host)]
        assert send.args[0] not in {a for n in later for a in n.all_input_nodes}
        tokens.append(add)
    assert sorted(barrier.args[0], key=order.__getitem__) == tokens


def test_streamed_rewrite_is_idempotent():
    graphs, config = _streamed_graphs()
    fw_code, bw_code = graphs.forward.code, graphs.backward.code
    again = run_passes(graphs, PassContext(config, cost_model()))
    assert again.forward.code == fw_code and again.backward.code == bw_code


def _break_by_reading_the_host_weight(graphs) -> None:
    prefetch = nodes(graphs.forward, ops.prefetch)[0]
    with graphs.forward.graph.inserting_after(prefetch):
        graphs.forward.graph.call_function(torch.ops.aten.neg.default, (prefetch.args[0],))


def _break_by_skipping_the_host_wait(graphs) -> None:
    graphs.backward.graph.erase_node(nodes(graphs.backward, ops.wait_host)[0])


def _break_by_computing_after_the_host_wait(graphs) -> None:
    barrier = nodes(graphs.backward, ops.wait_host)[0]
    gradient = nodes(graphs.backward, ops.send_grad)[0].args[0]
    with graphs.backward.graph.inserting_after(barrier):
        graphs.backward.graph.call_function(torch.ops.aten.neg.default, (gradient,))


def _break_by_sending_from_the_forward(graphs) -> None:
    fw = graphs.forward.graph
    source = nodes(graphs.forward, torch.ops.aten.mm.default)[0]
    with fw.inserting_after(source):
        fw.call_function(ops.send_grad, (source, 0))


@pytest.mark.parametrize("breaker", [_break_by_reading_the_host_weight,
                                     _break_by_skipping_the_host_wait,
                                     _break_by_computing_after_the_host_wait,
                                     _break_by_sending_from_the_forward])
def test_verify_rejects_broken_streamed_graphs(breaker):
    graphs, _ = _streamed_graphs()
    verify_graphs(graphs)
    breaker(graphs)
    with pytest.raises(StormVerificationError):
        verify_graphs(graphs)


def test_weight_prefetches_are_placed_ahead_of_their_reads():
    """With compute slow enough to hide every copy, each weight's copy is issued before the
    compute node preceding its first read, and ends before that read."""
    _, model, batch = _pair()
    captured = []
    config = StormConfig.from_options(**CPU_TEST_OPTIONS)
    backend = StormBackend(config, observer=captured.append, cost_override=lambda node: 1.0)
    torch.compile(model, backend=backend)(*batch).backward()
    (graphs,) = captured
    assert all(f.slack_s > 0 for f in graphs.storages.fetches)
    assert any(f.issue_after is not None for f in graphs.storages.fetches)


def _train(net, batch, backend, lr: float, fused: bool | None, scheduled: bool,
           deferred: bool = False, overlap: bool = True
           ) -> tuple[list[float], list[torch.Tensor]]:
    """STEPS AdamW steps of MICRO_BATCHES accumulated micro-batches of ``batch`` (an LR schedule
    with ``scheduled``; the micro-batches in ``gradient_accumulation()`` with ``deferred``; no
    streamed parameter stepped during a backward without ``overlap``): each step's last loss
    and the final weights, on the CPU."""
    optimizer = torch.optim.AdamW(net.parameters(), lr=lr, fused=fused)
    streaming.overlap_optimizer(optimizer, enabled=overlap)
    schedule = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=2) \
        if scheduled else None
    run = torch.compile(net, backend=backend)
    losses = []
    for _ in range(STEPS):
        with streaming.gradient_accumulation() if deferred else contextlib.nullcontext():
            for _ in range(MICRO_BATCHES):
                loss = run(*batch) / MICRO_BATCHES
                loss.backward()
        optimizer.step()
        if schedule is not None:
            schedule.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().cpu() for p in net.parameters()]


@pytest.mark.parametrize("deferred", [False, True], ids=["waiting", "deferred"])
def test_optimizer_steps_match_with_accumulation_and_a_schedule(deferred):
    reference, model, batch = _pair()
    (ref_losses, ref_params), (losses, params) = (
        _train(net, batch, storm(**CPU_TEST_OPTIONS), lr=1e-2, fused=True, scheduled=True,
               deferred=deferred and net is model)
        for net in (reference, model))
    assert losses == pytest.approx(ref_losses)
    for param, expected in zip(params, ref_params):
        torch.testing.assert_close(param, expected)


def test_state_dict_keeps_the_model_keys_and_loads_back():
    reference, model, batch = _pair()
    assert list(model.state_dict()) == list(reference.state_dict())
    torch.manual_seed(1)
    other, _ = build_llama(SHAPE)
    model.load_state_dict(other.state_dict())
    torch.testing.assert_close(model(*batch), other(*batch))
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, other.state_dict()[name], msg=name)


def test_tied_embedding_is_streamed_once():
    reference, model, batch = _pair(dataclasses.replace(SHAPE, tie_embeddings=True))
    assert len(list(model.parameters())) == len(list(reference.parameters()))
    _run(reference, "aot_eager")(*batch).backward()
    captured = []
    config = StormConfig.from_options(**CPU_TEST_OPTIONS)
    torch.compile(model, backend=StormBackend(config, observer=captured.append))(*batch) \
        .backward()
    for grad, expected in zip(_grads(model), _grads(reference)):
        torch.testing.assert_close(grad, expected)
    (graphs,) = captured
    sends = nodes(graphs.backward, ops.send_grad)
    assert len(sends) == len(graphs.storages.sends) == len({s.args[0] for s in sends})
    weights = [add.args[1] for add in nodes(graphs.backward, ops.accumulate_grad)]
    assert len(weights) == len(set(weights)), "each weight's gradient goes home once"


def test_tied_gradients_are_summed_before_going_home():
    graph = fx.Graph()
    a, b, w = (graph.placeholder(name) for name in "abw")
    for grad in (a, b):
        graph.call_function(ops.grad_to_host, (grad, w))
    graph.output(None)
    for node in (a, b, w):
        node.meta["val"] = torch.ones(2)
    joint = fx.GraphModule({}, graph)
    assert sum_tied_gradients(joint) is joint
    assert [n.target for n in joint.graph.nodes if n.op == "call_function"] == \
        [torch.ops.aten.add.Tensor, ops.grad_to_host]
    weight = torch.zeros(2, requires_grad=True)
    joint(torch.ones(2), torch.full((2,), 2.0), weight)
    torch.testing.assert_close(weight.grad, torch.full((2,), 3.0))
    code = joint.code
    sum_tied_gradients(joint)
    assert joint.code == code, "idempotent"


def test_refetch_weights_tags_each_fetch_and_nothing_else():
    """Every ``fetch_weight`` is tagged MUST_RECOMPUTE (so the partitioner fetches it again in
    the backward), no other node is tagged or moved, and a second run changes nothing."""
    graph = fx.Graph()
    w, x = graph.placeholder("w"), graph.placeholder("x")
    fetched = graph.call_function(ops.fetch_weight, (w, torch.device("cpu")))
    product = graph.call_function(torch.ops.aten.mm.default, (x, fetched))
    graph.output(product)
    joint = fx.GraphModule({}, graph)
    code = joint.code
    for _ in range(2):
        assert refetch_weights(joint) is joint
        assert {n.name: n.meta.get(RECOMPUTE_TAG) for n in joint.graph.nodes} == {
            "w": None, "x": None, "fetch_weight_default": CheckpointPolicy.MUST_RECOMPUTE,
            "mm_default": None,
            "output": None}
        assert joint.code == code


def test_refetch_weights_tags_what_rebuilds_a_packed_weight():
    """The cheap ops computed from fetched weights and constants alone (a packed weight's
    unpacking: shifts, a code-book lookup, scaling) are tagged with the fetch; a matmul and
    anything that reads an activation are not, nor is the constant code book."""
    aten = torch.ops.aten
    graph = fx.Graph()
    w, x = graph.placeholder("w"), graph.placeholder("x")
    book = graph.get_attr("book")
    fetched = graph.call_function(ops.fetch_weight, (w, torch.device("cpu")))
    high = graph.call_function(aten.__rshift__.Scalar, (fetched, 4))
    codes = graph.call_function(aten.index.Tensor, (book, [high]))
    weight = graph.call_function(aten.mul.Tensor, (codes, 0.5))
    product = graph.call_function(aten.mm.default, (x, weight))
    scaled = graph.call_function(aten.mul.Tensor, (product, weight))
    graph.output(scaled)
    joint = fx.GraphModule({"book": torch.zeros(16)}, graph)
    refetch_weights(joint)
    tagged = {n.name for n in joint.graph.nodes if n.meta.get(RECOMPUTE_TAG)}
    assert tagged == {fetched.name, high.name, codes.name, weight.name}


def test_a_joint_pass_that_breaks_the_joint_graph_is_named(monkeypatch):
    """A joint-graph pass whose graph fails ``verify_joint`` (a gradient sent home to a value
    that is not a graph input) raises StormVerificationError naming the pass."""
    from storm_compile.cli.commands import planning_context
    from storm_compile.compiler import pipeline

    def misroute(joint):
        home = next(iter(joint.graph.find_nodes(op="call_function", target=ops.grad_to_host)))
        home.args = (home.args[0], home.args[0])
        return joint

    misroute.__name__ = "misroute"
    monkeypatch.setattr(pipeline, "JOINT", (misroute,))
    graph = fx.Graph()
    g, w = graph.placeholder("g"), graph.placeholder("w")
    graph.call_function(ops.grad_to_host, (graph.call_function(torch.ops.aten.neg.default,
                                                              (g,)), w))
    graph.output(None)
    with pytest.raises(StormVerificationError, match="storm pass 'misroute' left invalid graphs"):
        pipeline.run_joint_passes(fx.GraphModule({}, graph), planning_context(profile="cpu-test"))


def test_small_parameters_stay_on_the_device():
    torch.manual_seed(0)
    model, _ = build_llama(SHAPE)
    streamed = stream_parameters(model, "cpu", resident_bytes=RESIDENT_BYTES)
    assert streamed.resident and all(n.endswith("norm.weight") for n in streamed.resident)
    assert streamed.host_bytes == sum(p.numel() * p.element_size() for p in model.parameters()
                                      if p.numel() * p.element_size() >= RESIDENT_BYTES)


def test_not_enough_host_memory_is_an_error_before_anything_moves(monkeypatch):
    monkeypatch.setattr(streaming, "available_host_bytes", lambda: 1024)
    torch.manual_seed(0)
    model, _ = build_llama(SHAPE)
    with pytest.raises(StormHostMemoryError, match=r"need \d+ bytes .* 1024 bytes"):
        stream_parameters(model, "cpu", resident_bytes=RESIDENT_BYTES)
    assert not any(torch.nn.utils.parametrize.is_parametrized(m) for m in model.modules())


@pytest.mark.parametrize("states, fits", [(2, False), (0, True)])
def test_host_check_counts_the_optimizers_state(monkeypatch, states, fits):
    torch.manual_seed(0)
    model, _ = build_llama(SHAPE)
    host_bytes = sum(p.numel() * p.element_size() for p in model.parameters()
                     if p.numel() * p.element_size() >= RESIDENT_BYTES)
    monkeypatch.setattr(streaming, "available_host_bytes", lambda: 3 * host_bytes)
    if fits:
        stream_parameters(model, "cpu", resident_bytes=RESIDENT_BYTES, optimizer_states=states)
        return
    with pytest.raises(StormHostMemoryError, match=f"need {4 * host_bytes} bytes"):
        stream_parameters(model, "cpu", resident_bytes=RESIDENT_BYTES, optimizer_states=states)


@pytest.mark.parametrize("states", [-1, 1.5, True])
def test_optimizer_states_must_be_a_count(states):
    model, _ = build_llama(SHAPE)
    with pytest.raises(ValueError, match="optimizer_states must be an int >= 0"):
        stream_parameters(model, "cpu", optimizer_states=states)


def test_streaming_twice_is_an_error():
    _, model, _ = _pair()
    with pytest.raises(ValueError, match="already"):
        stream_parameters(model, "cpu")


@pytest.mark.parametrize("preset, billions", [("1b", 1.24), ("3b", 3.21), ("8b", 8.03)])
def test_llama_presets_have_their_published_sizes(preset, billions):
    assert LLAMA_PRESETS[preset].parameters / 1e9 == pytest.approx(billions, abs=0.01)


def test_llama_parameter_count_matches_the_model():
    torch.manual_seed(0)
    model, _ = build_llama(SHAPE)
    assert SHAPE.parameters == sum(p.numel() for p in model.parameters())


@pytest.mark.gpu
@pytest.mark.usefixtures("small_fold_chunks")
def test_streamed_training_on_the_gpu_matches_the_resident_model(slow_host_profile):
    """Weights and AdamW on the host, copies on the GPU's streams, the last backward of each
    step learned folding its gradients into their host sums through the device in several
    chunks (planned with a profile whose host adds slower than its link, so that the tiny
    model's gradients fold): the same losses and weights as the model trained on the GPU under
    torch.compile."""
    torch.manual_seed(0)
    reference, batch = build_llama(SHAPE, device="cuda")
    model = copy.deepcopy(reference).cpu()
    stream_parameters(model, "cuda", resident_bytes=RESIDENT_BYTES)
    ref_losses, ref_params = _train(reference, batch, "inductor", lr=1e-3, fused=None,
                                    scheduled=False)
    folds = get_runtime().folds
    losses, params = _train(model, batch, storm(min_offload_bytes=0, profile=slow_host_profile),
                            lr=1e-3, fused=None, scheduled=False)
    assert get_runtime().folds > folds
    assert losses == pytest.approx(ref_losses, rel=1e-4)
    for param, expected in zip(params, ref_params):
        torch.testing.assert_close(param, expected, rtol=1e-4, atol=1e-4)


class _FakeStream:
    """A CUDA stream's stand-in on a machine without CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.device = device


def test_cuda_and_cuda_0_share_each_copy_stream(monkeypatch):
    """A streamed weight's fetch names the device as the user wrote it (``"cuda"``), an
    activation's prefetch as its tensor has it (``cuda:0``): both copy on one H2D stream, whose
    order is the order they were issued in, as placed."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    runtime = TransferRuntime()
    for stream in (runtime.h2d_stream, runtime.d2h_stream):
        assert stream(torch.device("cuda")) is stream(torch.device("cuda", 0))
        assert stream(torch.device("cuda", 1)) is not stream(torch.device("cuda", 0))
    assert runtime.h2d_stream(torch.device("cuda")) is not runtime.d2h_stream(
        torch.device("cuda"))
    assert streams.indexed(torch.device("cuda")) == torch.device("cuda", 0)
    assert streams.indexed(torch.device("cpu")) == torch.device("cpu")


@pytest.mark.gpu
def test_weights_and_activations_come_to_the_gpu_on_one_stream(monkeypatch):
    """A model streamed to ``"cuda"`` with activations offloaded: every copy to the device of a
    step (weights' fetches, activations' prefetches) runs on one stream."""
    torch.manual_seed(0)
    model, batch = build_llama(SHAPE, device="cpu")
    batch = tuple(t.cuda() for t in batch)
    stream_parameters(model, "cuda", resident_bytes=RESIDENT_BYTES)
    used = []
    launch = TransferRuntime.launch_copy

    def recording(self, dst, src, stream, device, host_reads=False):
        if src.device.type == "cpu":
            used.append(stream)
        launch(self, dst, src, stream, device, host_reads)

    monkeypatch.setattr(TransferRuntime, "launch_copy", recording)
    graphs = []
    backend = StormBackend(StormConfig.from_options(min_offload_bytes=0, offload="all"),
                           observer=graphs.append)
    torch.compile(model, backend=backend)(*batch).backward()
    torch.cuda.synchronize()
    assert graphs[0].storages.with_action(Action.OFFLOAD)
    assert len(used) > len(graphs[0].storages.with_action(Action.OFFLOAD))
    assert len({id(s) for s in used}) == 1


def _unbudgeted_device_peak() -> tuple[int, int]:
    """The streamed tiny Llama's predicted device peak without a budget, and the device weights
    a byte budget pays for first."""
    graphs, config = _streamed_graphs()
    weights = streaming.device_weights(graphs.forward, config.prefetch_window_bytes)
    return device_bytes(graphs, simulate(graphs, cost_model())), weights.nbytes


@pytest.mark.parametrize("fraction", [0.9, 0.8, 0.7])
def test_a_byte_budget_bounds_a_streamed_graphs_device_peak(fraction):
    peak, weights = _unbudgeted_device_peak()
    budget = int(peak * fraction)
    graphs, _ = _streamed_graphs(offload="hidden", memory_budget=asking(budget))
    prediction = simulate(graphs, cost_model())
    assert device_bytes(graphs, prediction) <= budget
    assert prediction.activation_bytes <= graphs.plan.target_bytes < budget - weights, \
        "the backward's peak above the saved activations is paid for too"


def test_a_byte_budget_leaves_room_for_the_working_set_at_the_peak(monkeypatch):
    """The first plan's activation target is the budget less the device's weights less what
    the unplanned step holds at its peak beyond its saved activations; a fraction bounds the
    activations alone."""
    plans = []
    plan_storages = pipeline.plan_storages
    peak, weights = _unbudgeted_device_peak()
    budget = int(peak * 0.9)
    monkeypatch.setattr(pipeline, "plan_storages", lambda graphs, ctx: _kept(
        plans, plan_storages(graphs, ctx)))
    _streamed_graphs(offload="hidden", memory_budget=asking(budget))
    first = plans[0]
    working = first.baseline.peak_bytes - first.baseline.activation_bytes
    assert working > 0
    assert first.target_bytes == max(first.minimum_bytes, budget - weights - working)
    plans.clear()
    _streamed_graphs(offload="hidden", memory_budget=0.5)
    assert plans[0].target_bytes == int(0.5 * plans[0].baseline.activation_bytes)


def _kept(plans: list, graphs):
    plans.append(graphs.plan)
    return graphs


def test_a_byte_budget_plans_both_ways_to_fit_and_keeps_the_faster(monkeypatch):
    """Over the budget, the excess is taken from the activations alone while they can take it,
    and from them and the weights' prefetch window alike: the faster fitting plan is kept."""
    fits = []
    fit_peak = pipeline._fit_peak

    def recorded(*args):
        fits.append(fit_peak(*args))
        return fits[-1]

    monkeypatch.setattr(pipeline, "_fit_peak", recorded)
    peak, _ = _unbudgeted_device_peak()
    graphs, config = _streamed_graphs(offload="hidden", memory_budget=asking(int(peak * 0.9)))
    assert len(fits) == 2 and all(isinstance(fit, pipeline._Fit) for fit in fits)
    assert fits[0].ctx.prefetch_window_bytes != fits[1].ctx.prefetch_window_bytes, \
        "the two ways lower the window differently"
    assert all(fit.ctx.memory_budget.nbytes < config.memory_budget.nbytes for fit in fits)
    assert all(fit.ctx.config == config for fit in fits), "the user's options stay as given"
    fastest = min(fit.prediction.step_s for fit in fits)
    assert simulate(graphs, cost_model()).step_s <= fastest


def test_a_plan_waiting_on_its_copies_rebuilds_link_bound_offloads_where_that_is_faster(
        monkeypatch):
    """Under a byte budget the tiny streamed Llama's plan, free to recompute, waits on its
    copies: the search plans it again with its largest link-bound offloads priced with both
    copies where recomputation is decided, which rebuilds some of them, keeps the fastest plan,
    and the gradients are the unstreamed model's."""
    firsts, tries = [], []
    relieved, relief = pipeline._relieved, pipeline._relief

    def first(graphs, ctx, planned, prediction, room):
        firsts.append((planned, prediction))
        return relieved(graphs, ctx, planned, prediction, room)

    def tried(graphs, ctx, bound, room):
        tries.append((bound, relief(graphs, ctx, bound, room)))
        return tries[-1][1]

    monkeypatch.setattr(pipeline, "_relieved", first)
    monkeypatch.setattr(pipeline, "_relief", tried)
    peak, _ = _unbudgeted_device_peak()
    options = {"offload": "hidden", "recompute": True, "memory_budget": asking(int(peak * 0.8))}
    graphs, config = _streamed_graphs(**options)
    (planned, prediction), = firsts
    assert prediction.exposed_transfer_s > pipeline.RELIEF_SHARE * prediction.step_s
    bound = {s.root.name: s.nbytes for s, d in planned.storages
             if d.action is Action.OFFLOAD and not d.figures.hides}
    assert tries and all(names and names <= bound.keys() for names, _ in tries)
    smallest_named = min(bound[n] for n in tries[0][0])
    assert all(size <= smallest_named for n, size in bound.items() if n not in tries[0][0]), \
        "the largest are named first"
    fits = [fit for _, fit in tries if fit is not None]
    fastest = min(fits, key=lambda fit: fit.prediction.step_s)
    assert fastest.prediction.step_s < prediction.step_s
    assert fastest.ctx.limits.link_bound and fastest.ctx.config == config
    cost = cost_model()
    rebuilt = [(storage, decision) for storage, decision in fastest.graphs.plan.recomputed
               if storage.root.name in fastest.ctx.limits.link_bound]
    assert rebuilt, "a named offload is rebuilt instead"
    for storage, decision in rebuilt:
        assert not decision.figures.hides
        assert decision.figures.offload_s == pytest.approx(sum(
            cost.transfer_seconds(storage.link_bytes, lane) for lane in (Lane.D2H, Lane.H2D)))
        assert decision.figures.recompute_s < decision.figures.offload_s
    for storage, decision in fastest.graphs.storages:
        if decision.action is Action.OFFLOAD and decision.figures.hides:
            assert decision.figures.offload_s == 0, "a realised offload is priced as placed"
    assert simulate(graphs, cost).step_s <= simulate(planned, cost).step_s

    torch._dynamo.reset()
    reference, model, batch = _pair()
    _run(reference, "aot_eager")(*batch).backward()
    _run(model, storm(**{**CPU_TEST_OPTIONS, **options}))(*batch).backward()
    for grad, expected in zip(_grads(model), _grads(reference)):
        torch.testing.assert_close(grad, expected)


def test_a_byte_budget_below_every_plans_peak_names_where_the_peak_is():
    peak, weights = _unbudgeted_device_peak()
    budget = int(peak * 0.55)
    assert budget > weights
    with pytest.raises(Exception) as caught:
        _streamed_graphs(offload="hidden", memory_budget=asking(budget))
    error = getattr(caught.value, "inner_exception", caught.value)
    assert isinstance(error, StormBudgetError)
    least = int(re.search(r"least predicted peak is (\d+) bytes", str(error)).group(1))
    assert least > budget
    assert re.search(r"at \w+ of the (backward|forward)", str(error))
    assert "prefetch_window_bytes" in str(error)


def test_a_byte_budget_below_the_weights_names_the_largest():
    graphs, config = _streamed_graphs()
    weights = streaming.device_weights(graphs.forward, config.prefetch_window_bytes)
    with pytest.raises(Exception) as caught:
        _streamed_graphs(offload="hidden", memory_budget=asking(weights.nbytes))
    error = getattr(caught.value, "inner_exception", caught.value)
    assert isinstance(error, StormBudgetError)
    assert "largest streamed weight while it is read" in str(error)
    assert weights.largest.name in str(error)


def test_a_streamed_graph_run_twice_before_its_backward_is_planned_again_for_what_is_left():
    """A siamese-style step (two forwards, one backward) under the byte budget one run's plan
    fills: the second run is planned again for the device peak the first run's activations
    leave, each room compiled once, and the gradients are the unstreamed model's."""
    peak, _ = _unbudgeted_device_peak()
    reference, model, (tokens, targets) = _pair()
    captured = []
    config = StormConfig.from_options(**{**CPU_TEST_OPTIONS, "offload": "hidden",
                                         "recompute": True, "memory_budget": asking(peak)})
    run = torch.compile(model, backend=StormBackend(config, observer=captured.append))
    compiled = []
    # The first step shows the second run, the second measures the inputs it adds; from the
    # third the rooms repeat.
    for _ in range(STEPS + 1):
        (run(tokens, targets) + run(tokens, targets)).backward()
        (reference(tokens, targets) + reference(tokens, targets)).backward()
        for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(param.grad, expected.grad, msg=name)
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        compiled.append(len(captured))
    first, second = captured[:2]
    assert first.share.planned_bytes + device_bytes(second, simulate(second, cost_model())) \
        <= peak
    assert compiled[-1] == compiled[-2], "a room seen before is not compiled again"



def test_a_later_run_no_plan_fits_raises_the_budget_error_at_its_call(monkeypatch):
    """A run planned again for less room than the graph's weights need: its call raises
    ``StormBudgetError`` itself (dynamo compiled the graph long before), naming the causes."""
    peak, _ = _unbudgeted_device_peak()
    _, model, (tokens, targets) = _pair()
    monkeypatch.setattr(StepBudget, "run_room", lambda step, graph, budget: (
        RunRoom(1, 1, known=True) if step.runs_held(graph) else None))
    config = StormConfig.from_options(**{**CPU_TEST_OPTIONS, "offload": "hidden",
                                         "recompute": True, "memory_budget": asking(peak)})
    run = torch.compile(model, backend=StormBackend(config))
    first = run(tokens, targets)
    with pytest.raises(StormBudgetError, match="runs again before the backward") as caught:
        run(tokens, targets)
    assert "siamese or GAN step" in str(caught.value)
    first.backward()

@pytest.mark.gpu
def test_a_streamed_graph_run_twice_before_its_backward_trains_on_the_gpu():
    """The step above on the GPU's streams, under the byte budget the first run's plan fills
    there: at every step the gradients of the resident model under torch.compile."""
    torch.manual_seed(0)
    reference, (tokens, targets) = build_llama(SHAPE, device="cuda")
    model = copy.deepcopy(reference).cpu()
    stream_parameters(model, "cuda", resident_bytes=RESIDENT_BYTES)
    peaks = []                           # as planned: Inductor later rewrites the graphs
    probe = StormBackend(StormConfig.from_options(min_offload_bytes=0), observer=lambda g: (
        peaks.append(device_bytes(g, simulate(g, probe.ctx.cost)))))
    torch.compile(model, backend=probe)(tokens, targets).backward()
    budget = peaks[0]
    torch._dynamo.reset()
    run = torch.compile(model, backend=storm(min_offload_bytes=0, memory_budget=asking(budget)))
    compiled = torch.compile(reference, backend="inductor")
    flipped = tokens.flip(0), targets.flip(0)
    for _ in range(STEPS):
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        (run(tokens, targets) + run(*flipped)).backward()
        (compiled(tokens, targets) + compiled(*flipped)).backward()
        for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(param.grad.cpu(), expected.grad.cpu(), rtol=1e-4,
                                       atol=1e-4, msg=name)


def test_host_adder_keeps_a_first_gradient_as_grad_then_adds_into_it():
    """A gradient sent home into a buffer of its own becomes ``.grad`` as it is (no copy, no
    host memory besides it); later ones add into it; after ``zero_grad`` the next one is
    kept again, and a gradient the user still holds is never written."""
    adder = HostAdder()
    weight = torch.zeros(3, requires_grad=True)
    first = torch.ones(3)
    adder.add(first, weight, None)
    assert weight.grad.data_ptr() == first.data_ptr()
    adder.add(torch.full((3,), 2.0), weight, None)
    adder.join()
    torch.testing.assert_close(weight.grad, torch.full((3,), 3.0))
    kept = weight.grad
    weight.grad = None
    second = torch.full((3,), 5.0)
    adder.add(second, weight, None)
    assert weight.grad.data_ptr() == second.data_ptr()
    torch.testing.assert_close(kept, torch.full((3,), 3.0))


def test_host_adder_error_is_raised_at_the_wait():
    adder = HostAdder()
    weight = torch.zeros(3, requires_grad=True)
    weight.grad = torch.zeros(3)

    class _FailingEvent:
        def query(self) -> bool:
            return False

        def synchronize(self) -> None:
            raise ValueError("copy failed")

    adder.add(torch.ones(3), weight, _FailingEvent())
    with pytest.raises(RuntimeError, match="adding a gradient") as caught:
        adder.join()
    assert isinstance(caught.value.__cause__, ValueError)
    adder.join()


class _Copy:
    """A copy's event for the adder: done when the test says so."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def query(self) -> bool:
        return self.done.is_set()

    def synchronize(self) -> None:
        self.done.wait()


def test_host_adder_steps_a_parameter_after_its_last_addition_and_the_join():
    adder = HostAdder()
    first, second = torch.zeros(2, requires_grad=True), torch.zeros(2, requires_grad=True)
    seen = []

    def step(param):
        seen.append((param is first, param.grad.clone()))
        param.grad = None

    copies = [_Copy() for _ in range(3)]
    adder.add(torch.ones(2), first, copies[0], step)
    adder.add(torch.ones(2), second, copies[1], step)
    adder.add(torch.full((2,), 2.0), first, copies[2], step)
    for pending in copies:
        pending.done.set()
    time.sleep(WORKER_SETTLE_S)
    assert seen == [], "no step before the backward is launched (join)"
    adder.join()
    assert len(seen) == 2
    by_param = {is_first: grad for is_first, grad in seen}
    torch.testing.assert_close(by_param[True], torch.full((2,), 3.0))
    torch.testing.assert_close(by_param[False], torch.ones(2))
    assert first.grad is None and second.grad is None


def test_host_adder_steps_a_parameter_whose_last_addition_is_known_before_the_join():
    """An addition that says it is its parameter's last of the backward (``complete``) lets
    the step run once it is done, while the backward is still being launched; another
    parameter's step still waits for the join, and an addition for a parameter already stepped
    is an error."""
    adder = HostAdder()
    known, unknown = torch.zeros(2, requires_grad=True), torch.zeros(2, requires_grad=True)
    seen = []

    def step(param):
        seen.append(param is known)

    copies = [_Copy() for _ in range(3)]
    adder.add(torch.ones(2), known, copies[0], step)
    adder.add(torch.ones(2), unknown, copies[1], step)
    adder.add(torch.ones(2), known, copies[2], step, complete=True)
    for pending in copies:
        pending.done.set()
    time.sleep(WORKER_SETTLE_S)
    assert seen == [True], "the known parameter's step ran before the join, the other's not"
    torch.testing.assert_close(known.grad, torch.full((2,), 2.0))
    with pytest.raises(StormOverlapError, match="another gradient .* after its optimizer"):
        adder.add(torch.ones(2), known, None, step)
    adder.join()
    assert seen == [True, False]
    adder.add(torch.ones(2), known, None, step, complete=True)    # a new backward: allowed
    adder.join()
    assert seen == [True, False, True]


def test_a_gradient_counted_as_in_the_two_backwards_before_is_its_parameters_last(monkeypatch):
    """The runtime counts each parameter's gradients and the copies launched from it in each
    backward; once two backwards agree, the gradient that reaches both counts is its last of
    the backward (its step may run then), a copy from a parameter the host thread stepped in
    this backward is an error, and a weight kept on the device never steps early."""
    monkeypatch.setattr(streams, "_current_backward", lambda: 1)
    runtime = TransferRuntime()
    weight, kept = torch.zeros(4), torch.zeros(4)
    runtime.mirror(kept, torch.device("cpu"))
    copy = torch.empty(4)
    for backward in range(3):
        for param in (weight, kept):
            runtime.copy_from_host(copy, param)
        assert runtime._complete(weight) == (backward == 2)
        assert not runtime._complete(kept)
        if backward < 2:
            runtime._learn_counts()
    runtime._step(ParameterStep(torch.optim.SGD([weight], lr=0.1), keep_grad=True), weight)
    with pytest.raises(StormOverlapError, match="read a streamed weight .* after its optimizer"):
        runtime.copy_from_host(copy, weight)
    runtime._learn_counts()
    runtime.copy_from_host(copy, weight)         # the next backward may read it again
    runtime.copy_from_host(copy, weight)
    assert not runtime._complete(weight), "read more often than learned: not known complete"


def test_a_device_copy_is_copied_again_after_a_step_that_may_change_its_weight(monkeypatch):
    """A step of torch's optimizers changes only parameters with a gradient (given a closure,
    any of its own; another optimizer, any of its own): a kept copy of a frozen weight held in
    the same optimizer outlives the steps of the trained one, and is copied again once a step
    may change it."""
    runtime = TransferRuntime()
    copied = []
    copy_from_host = runtime.copy_from_host
    monkeypatch.setattr(runtime, "copy_from_host",
                        lambda dst, host: (copied.append(host), copy_from_host(dst, host)))
    trained = torch.nn.Parameter(torch.zeros(4))
    frozen = torch.nn.Parameter(torch.ones(4), requires_grad=False)
    optimizer = torch.optim.SGD([trained, frozen], lr=1.0)
    cpu = torch.device("cpu")

    def read():
        copied.clear()
        kept = {name: runtime.mirror(w, cpu).clone() for name, w in
                (("trained", trained), ("frozen", frozen))}
        return kept, [w is trained for w in copied]

    assert read()[1] == [True, False]
    trained.grad = torch.ones(4)
    optimizer.step()
    kept, again = read()
    assert again == [True], "the frozen weight's copy outlived the step"
    torch.testing.assert_close(kept["trained"], torch.full((4,), -1.0))
    frozen.grad = torch.ones(4)                  # a gradient set by hand: the step changes it
    optimizer.step()
    kept, again = read()
    assert again == [True, False]
    torch.testing.assert_close(kept["frozen"], torch.zeros(4))
    frozen.grad = trained.grad = None
    optimizer.step(lambda: None)                 # a closure's backward may give any a gradient
    assert read()[1] == [True, False]
    assert read()[1] == [], "nothing changed since"

    class Shift(torch.optim.Optimizer):
        """Not torch's: moves every parameter, gradient or not."""

        def step(self, closure=None):
            for group in self.param_groups:
                for param in group["params"]:
                    param.data.add_(1.0)

    Shift([trained, frozen], {}).step()
    kept, again = read()
    assert again == [True, False], "another library's optimizer may change any of its own"
    torch.testing.assert_close(kept["frozen"], torch.ones(4))
    torch.testing.assert_close(kept["trained"], trained.detach())
    runtime._after_optimizer_step(optimizer, (optimizer,), {})   # its step began unwatched
    assert read()[1] == [True, False]


def test_deferred_backwards_leave_the_additions_to_the_block_end_or_the_optimizer_step():
    """In ``gradient_accumulation()`` the end of a backward (``wait_host``) does not wait for
    an addition whose copy is still in flight; the block's end does, and so does an optimizer
    step taken inside the block."""
    runtime = get_runtime()
    for ends_it in ("block", "optimizer"):
        weight = torch.zeros(2, requires_grad=True)
        optimizer = torch.optim.SGD([weight], lr=1.0)
        copy = _Copy()
        with streaming.gradient_accumulation():
            runtime._adder.add(torch.ones(2), weight, copy)
            threading.Timer(WORKER_SETTLE_S, copy.done.set).start()
            runtime.wait_host()
            assert weight.grad is None, "the backward's end waited inside the block"
            if ends_it == "optimizer":
                optimizer.step()
                torch.testing.assert_close(weight.detach(), torch.full((2,), -1.0))
        torch.testing.assert_close(weight.grad, torch.ones(2))


def test_a_deferred_backward_waits_for_the_additions_of_the_one_before_it():
    """In ``gradient_accumulation()`` the end of a backward waits for the previous backward's
    additions, not its own: the host is at most one micro-batch behind the GPU."""
    runtime = get_runtime()
    weight = torch.zeros(2, requires_grad=True)
    first, second = _Copy(), _Copy()
    with streaming.gradient_accumulation():
        runtime._adder.add(torch.ones(2), weight, first)
        runtime.wait_host()
        assert weight.grad is None, "the first backward's end waited for its own addition"
        threading.Timer(WORKER_SETTLE_S, first.done.set).start()
        runtime._adder.add(torch.full((2,), 2.0), weight, second)
        runtime.wait_host()
        torch.testing.assert_close(weight.grad, torch.ones(2))
        second.done.set()
    torch.testing.assert_close(weight.grad, torch.full((2,), 3.0))


def test_host_adder_logs_each_addition_at_debug_level(caplog):
    adder = HostAdder()
    weight = torch.zeros(4, requires_grad=True)
    copy = _Copy()
    copy.done.set()
    with caplog.at_level(logging.DEBUG, logger="storm_compile"):
        adder.add(torch.ones(4), weight, copy)
        adder.join()
    (line,) = [r.getMessage() for r in caplog.records if "gradient of" in r.getMessage()]
    assert re.fullmatch(r"storm: gradient of 16 bytes waited [0-9.]+ ms for its copy home, "
                        r"added in [0-9.]+ ms; 0 jobs queued", line), line


def test_host_adder_steps_after_the_additions_it_was_given_not_an_earlier_micro_batchs():
    """An earlier micro-batch's addition still queued (``gradient_accumulation()``) when the
    final backward hands over its own with a step: the step waits for the final one."""
    adder = HostAdder()
    weight = torch.zeros(2, requires_grad=True)
    seen = []

    def step(param):
        seen.append(param.grad.clone())
        param.grad = None

    earlier, final = _Copy(), _Copy()
    adder.add(torch.ones(2), weight, earlier)
    adder.add(torch.full((2,), 2.0), weight, final, step)
    joining = threading.Thread(target=adder.join)
    joining.start()
    earlier.done.set()
    time.sleep(WORKER_SETTLE_S)
    assert seen == [], "stepped before its own addition arrived"
    final.done.set()
    joining.join()
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], torch.full((2,), 3.0))
    assert weight.grad is None


def _train_overlapped(net, batch, backend, deferred: bool = False) -> list[torch.Tensor]:
    """_train's loop with the streamed parameters stepped during each last backward (the
    micro-batches in ``gradient_accumulation()`` with ``deferred``)."""
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2, fused=True)
    schedule = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=2)
    overlapped = streaming.OverlappedOptimizer(optimizer)
    run = torch.compile(net, backend=backend)
    for _ in range(STEPS):
        with streaming.gradient_accumulation() if deferred else contextlib.nullcontext():
            for index in range(MICRO_BATCHES):
                loss = run(*batch) / MICRO_BATCHES
                if index < MICRO_BATCHES - 1:
                    loss.backward()
                    continue
                with overlapped.final_backward():
                    loss.backward()
                assert all(p.grad is None for n, p in net.named_parameters()
                           if "norm" not in n)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
    return [p.detach().cpu() for p in net.parameters()]


@pytest.mark.parametrize("backend", ["eager", "storm"])
def test_overlapped_optimizer_steps_like_the_optimizer(backend):
    reference, model, batch = _pair()
    _, expected = _train(reference, batch, storm(**CPU_TEST_OPTIONS), lr=1e-2, fused=True,
                         scheduled=True)
    params = _train_overlapped(model, batch, BACKENDS[backend] or "eager")
    for param, want in zip(params, expected):
        torch.testing.assert_close(param, want)


def _budget_with_room(room: int) -> int:
    """A byte budget ``room`` bytes above the predicted device peak of the streamed tiny
    Llama's plan with every activation kept (a fraction budget of 1.0 keeps weights streamed)."""
    graphs, _ = _streamed_graphs(offload="hidden", memory_budget=1.0)
    assert not graphs.storages.resident
    return device_bytes(graphs, simulate(graphs, cost_model())) + room


def _weights_in_read_order(graphs) -> list[fx.Node]:
    fetches = nodes(graphs.forward, ops.prefetch) + nodes(graphs.forward, ops.resident_weight)
    order = {n: i for i, n in enumerate(graphs.forward.graph.nodes)}
    first_read = {}
    for node in fetches:
        reader = min((u for u in node.users), key=order.__getitem__)
        while reader.target in (ops.record_event, ops.wait_event):
            reader = min(reader.users, key=order.__getitem__)
        first_read.setdefault(node.args[0], order[reader])
    return sorted(first_read, key=first_read.__getitem__)


def test_room_left_by_a_byte_budget_keeps_the_earliest_read_weights_on_the_device():
    plain, _ = _streamed_graphs()
    assert plain.storages.resident == () and not nodes(plain.forward, ops.resident_weight)
    order = _weights_in_read_order(plain)
    budget = _budget_with_room(2 * tensor_bytes(order[0].meta["val"]))
    graphs, _ = _streamed_graphs(offload="hidden", memory_budget=asking(budget))
    kept = [w.name for w in graphs.storages.resident]
    names = [w.name for w in order]
    assert kept and kept[0] == names[0] and len(kept) < len(names)
    assert kept == [n for n in names if n in kept], "chosen in the order of first read"
    prediction = simulate(graphs, cost_model())
    assert summary(graphs, prediction, "cpu-test")["device_bytes"] <= budget
    for gm in (graphs.forward, graphs.backward):
        assert {n.args[0].name for n in nodes(gm, ops.resident_weight)} <= set(kept)
        assert not set(kept) & {n.args[0].name for n in nodes(gm, ops.prefetch)}
    assert {n.args[0].name for n in nodes(graphs.forward, ops.prefetch)} == set(names) - set(kept)


def test_more_room_keeps_more_weights_and_never_passes_the_budget():
    streamed = len(_weights_in_read_order(_streamed_graphs()[0]))
    counts = []
    for room in (0, 1 << 18, 1 << 30):
        budget = _budget_with_room(room)
        graphs, _ = _streamed_graphs(offload="hidden", memory_budget=asking(budget))
        assert device_bytes(graphs, simulate(graphs, cost_model())) <= budget
        counts.append(len(graphs.storages.resident))
    assert counts == sorted(counts) and counts[0] < counts[-1] == streamed


def test_a_lower_activation_budget_leaves_the_room_for_weights_the_user_budget_gives():
    """The search plans activations against a lower budget to trade them for weights kept on
    the device (``Limits.budget_bytes``); ``plan_weights`` then keeps what the user's budget
    leaves beside those activations, as without the lower budget: the room the activations
    freed goes to weights, not back to the lower budget."""
    final, config = _streamed_graphs(offload="hidden",
                                     memory_budget=asking(_budget_with_room(1 << 30)))
    ctx = PassContext(config, cost_model(), resident_room=1 << 30)
    forward, backward = final.joint.split()
    decided = pipeline.plan_storages(
        StormGraphs(forward, backward, final.num_fwd_outputs, joint=final.joint), ctx)
    lowered = dataclasses.replace(ctx, limits=Limits(budget_bytes=decided.share.planned_bytes))
    kept = plan_weights(decided, ctx).storages.resident
    assert kept, "the user's budget has room for weights"
    assert plan_weights(decided, lowered).storages.resident == kept


def test_the_search_keeps_the_plan_fastest_over_two_micro_batches_with_its_sums(monkeypatch):
    """Every plan the search tries for a streamed graph under a byte budget gets its gradient
    sums, and the search keeps the one whose predicted step of two micro-batches (one that
    holds its sums on the device, and the last) is the fastest."""
    tried = []
    original = pipeline._summed

    def summed(candidate, user, room):
        tried.append(original(candidate, user, room))
        return tried[-1]

    monkeypatch.setattr(pipeline, "_summed", summed)
    graphs, _ = _streamed_graphs(offload="hidden",
                                 memory_budget=asking(_budget_with_room(1 << 18)))
    assert len(tried) > 1
    fastest = min(tried, key=lambda plan: plan.step_s)
    assert graphs.forward is fastest.graphs.forward
    cost = cost_model()
    two = simulate(graphs, cost, held=True).step_s + simulate(graphs, cost, folded=True).step_s
    assert two == pytest.approx(fastest.step_s)


def test_resident_weights_rewrite_is_idempotent():
    options = {"offload": "hidden", "memory_budget": asking(_budget_with_room(1 << 30))}
    graphs, config = _streamed_graphs(**options)
    assert len(graphs.storages.resident) == len(nodes(graphs.forward, ops.resident_weight)) > 0
    assert not nodes(graphs.forward, ops.prefetch), "every weight is kept on the device"
    fw_code, bw_code = graphs.forward.code, graphs.backward.code
    again = run_passes(graphs, PassContext(config, cost_model()))
    assert again.forward.code == fw_code and again.backward.code == bw_code


def test_resident_weights_follow_the_optimizer():
    """Every weight kept on the device: its copy there is refreshed after each optimizer step,
    so training matches the model it came from."""
    reference, model, batch = _pair()
    budget = asking(_budget_with_room(1 << 30))
    backend = storm(**{**CPU_TEST_OPTIONS, "offload": "hidden", "memory_budget": budget})
    ref_losses, ref_params = _train(reference, batch, storm(**CPU_TEST_OPTIONS), lr=1e-2,
                                    fused=True, scheduled=True)
    losses, params = _train(model, batch, backend, lr=1e-2, fused=True, scheduled=True)
    assert losses == pytest.approx(ref_losses)
    for param, expected in zip(params, ref_params):
        torch.testing.assert_close(param, expected)


def test_room_left_by_resident_weights_sums_their_gradients_on_the_device():
    graphs, _ = _streamed_graphs(offload="hidden",
                                 memory_budget=asking(_budget_with_room(1 << 30)))
    resident = graphs.storages.resident
    assert resident and all(w.summed for w in resident), "every gradient has room"
    sends = nodes(graphs.backward, ops.send_grad)
    assert sends and all(sums_on_device(n) and n.args[2].name in {w.name for w in resident}
                         for n in sends)
    prediction = simulate(graphs, cost_model())
    row = summary(graphs, prediction, "cpu-test")
    assert row["summed_gradient_bytes"] == sum(w.nbytes for w in resident)
    assert row["device_bytes"] == device_bytes(graphs, prediction)
    assert graphs.share.resident_bytes == 2 * row["summed_gradient_bytes"]


def test_room_for_sums_counts_a_resident_weight_once():
    """A weight kept on the device is an input of the rewritten graph and part of its share of
    the step: a budget with room for every kept weight and its sum, once each, sums them all."""
    graphs, config = _streamed_graphs(offload="hidden",
                                      memory_budget=asking(_budget_with_room(1 << 30)))
    resident = graphs.storages.resident
    assert resident and all(w.summed for w in resident)
    kept = sum(w.nbytes for w in resident)
    unsummed = dataclasses.replace(
        graphs, share=dataclasses.replace(graphs.share, resident_bytes=kept),
        storages=dataclasses.replace(graphs.storages, resident=tuple(
            dataclasses.replace(w, summed=False) for w in resident)))
    inputs = streaming.device_weights(graphs.forward, config.prefetch_window_bytes)
    exact = inputs.resident_bytes + graphs.share.planned_bytes + kept
    ctx = PassContext(dataclasses.replace(config, memory_budget=MemoryBudget(nbytes=exact,
                                                                             margin=0.0)),
                      cost_model(), resident_room=1 << 30)
    assert all(w.summed for w in plan_gradient_sums(unsummed, ctx).storages.resident)


def test_planning_gradient_sums_again_or_with_nothing_kept_changes_nothing():
    options = {"offload": "hidden", "memory_budget": asking(_budget_with_room(1 << 30))}
    graphs, config = _streamed_graphs(**options)
    code = graphs.backward.code
    ctx = PassContext(config, cost_model(), resident_room=1 << 30)
    again = insert_transfers(plan_gradient_sums(graphs, ctx), ctx)
    assert again.backward.code == code and again.storages == graphs.storages
    plain, config = _streamed_graphs()
    assert plan_gradient_sums(plain, PassContext(config, cost_model(),
                                                 resident_room=1 << 30)) is plain


def test_gradients_summed_on_the_device_are_sums_only_where_room_is_left():
    """With room for a few weights, only what is left after them holds sums, never more."""
    plain, _ = _streamed_graphs()
    first = _weights_in_read_order(plain)[0]
    budget = _budget_with_room(3 * tensor_bytes(first.meta["val"]))
    graphs, _ = _streamed_graphs(offload="hidden", memory_budget=asking(budget))
    resident = graphs.storages.resident
    assert resident and not all(w.summed for w in resident)
    assert device_bytes(graphs, simulate(graphs, cost_model())) <= budget
    summed = {w.name for w in resident if w.summed}
    assert {n.args[2].name for n in nodes(graphs.backward, ops.send_grad)
            if sums_on_device(n)} == summed


def test_a_held_micro_batch_sends_no_summed_gradient_home():
    graphs, _ = _streamed_graphs(offload="hidden",
                                 memory_budget=asking(_budget_with_room(1 << 30)))
    cost = _host_rates(add=1e6)
    sent, held = simulate(graphs, cost), simulate(graphs, cost, held=True)
    assert not [c for c in held.copies if c.graph == "bw"]
    assert not held.host and held.host_wait_s == 0.0
    assert [h.work for h in sent.host] == ["keep"] * len(sent.host), \
        "a sum comes home once a step, into a .grad that is None"
    step = predict_step(graphs, cost, micro_batches=4, overlapped=False)
    assert step.micro_batch_s == pytest.approx(held.step_s)
    assert step.last_micro_batch_s == pytest.approx(sent.step_s)
    assert step.last_micro_batch_s > step.micro_batch_s


def _summing(model, batch, micro_batches: int):
    """``model`` compiled with every weight kept on the device and its gradients summed there,
    its optimizer, stated to step after ``micro_batches`` backwards, and a backward of one
    micro-batch."""
    backend = storm(**{**CPU_TEST_OPTIONS, "offload": "hidden",
                       "memory_budget": asking(_budget_with_room(1 << 30))})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    streaming.overlap_optimizer(optimizer, backwards_per_step=micro_batches)
    run = torch.compile(model, backend=backend)

    def backward(scale: float = 1.0):
        (run(*batch) * scale).backward()

    return optimizer, backward


def _stored_grads(model) -> list:
    """The streamed parameters' ``.grad`` as stored, without the read that sends a device sum
    home."""
    return [torch.Tensor.grad.__get__(p) for p in streamed(model)]


def _assert_grads_of_one_backward(reference, model, batch) -> None:
    """The streamed parameters' ``.grad`` are the unstreamed ``reference``'s after one backward
    of ``batch``."""
    reference(*batch).backward()
    expected = {n: p.grad for n, p in reference.named_parameters()}
    for name, param in model.named_parameters():
        if getattr(param, "storm_streamed", False):
            torch.testing.assert_close(param.grad, expected[unstreamed_name(name)])


def test_a_read_between_micro_batches_sends_the_device_sum_home_first():
    reference, model, batch = _pair()
    _, backward = _summing(model, batch, micro_batches=3)
    backward()
    assert all(g is None for g in _stored_grads(model)), "the first micro-batch stayed there"
    _assert_grads_of_one_backward(reference, model, batch)


def test_a_gradient_set_to_none_between_micro_batches_drops_its_device_sum():
    reference, model, batch = _pair()
    _, backward = _summing(model, batch, micro_batches=2)
    backward(scale=5.0)
    for param in streamed(model):
        param.grad = None
    backward()                                   # the step's last: sends what it holds
    _assert_grads_of_one_backward(reference, model, batch)


def test_a_step_of_fewer_backwards_than_learned_steps_with_the_device_sums():
    reference, model, batch = _pair()
    optimizer, backward = _summing(model, batch, micro_batches=3)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
    ref_run = torch.compile(reference, backend=storm(**CPU_TEST_OPTIONS))
    for micro_batches in (3, 2):        # the model's first step is a whole one
        for _ in range(micro_batches):
            ref_run(*batch).backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    for _ in range(3):
        backward()
    optimizer.step()
    optimizer.zero_grad()
    for _ in range(2):
        backward()                               # both held: storm was told of three
    optimizer.step()
    for param, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.detach(), want.detach())


class _PlainSGD(torch.optim.Optimizer):
    """An optimizer storm does not know, so it never steps it during a backward."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.add_(param.grad, alpha=-group["lr"])


def test_gradients_are_summed_on_the_device_under_an_optimizer_storm_does_not_know():
    """The count of backwards a step has is learned whatever the optimizer; from the third step
    a micro-batch but the last leaves its gradients on the device."""
    reference, model, batch = _pair()
    budget = asking(_budget_with_room(1 << 30))
    runs = [(net, _PlainSGD(net.parameters(), lr=1e-2), torch.compile(net, backend=backend))
            for net, backend in ((reference, storm(**CPU_TEST_OPTIONS)),
                                 (model, storm(**{**CPU_TEST_OPTIONS, "offload": "hidden",
                                                  "memory_budget": budget})))]
    for step in range(4):
        for micro_batch in range(MICRO_BATCHES):
            for net, _, run in runs:
                run(*batch).backward()
            if step == 3 and micro_batch == 0:
                assert all(g is None for g in _stored_grads(model)), "not summed on the device"
        for _, optimizer, _ in runs:
            optimizer.step()
            optimizer.zero_grad()
    for param, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.detach(), want.detach())


@pytest.mark.gpu
@pytest.mark.parametrize("way", ["overlapped-optimizer", "resident-weights", "deferred",
                                 "deferred-overlapped", "plain-loop"])
def test_streamed_training_on_the_gpu_matches_each_way_of_running_the_step(way):
    """The host thread's additions and steps against real copy streams (the optimizer
    overlapped, the micro-batches' additions deferred, both, or both as the plain loop learns
    them), or the device copies kept
    across optimizer steps: the same weights as the streamed model stepped after its
    backward. Both step with the host's AdamW, so a difference is the way's alone (against
    the GPU's AdamW, a gradient near zero turns float noise into a step of up to the rate)."""
    torch.manual_seed(0)
    built, batch = build_llama(SHAPE, device="cuda")
    reference, model = copy.deepcopy(built).cpu(), copy.deepcopy(built).cpu()
    for net in (reference, model):
        stream_parameters(net, "cuda", resident_bytes=RESIDENT_BYTES)
    _, expected = _train(reference, batch, storm(min_offload_bytes=0), lr=1e-2, fused=True,
                         scheduled=True, overlap=False)
    if way == "plain-loop":
        _, params = _train(model, batch, storm(min_offload_bytes=0), lr=1e-2, fused=True,
                           scheduled=True)
    elif way == "overlapped-optimizer":
        params = _train_overlapped(model, batch, storm(min_offload_bytes=0))
    elif way == "deferred":
        _, params = _train(model, batch, storm(min_offload_bytes=0), lr=1e-2, fused=True,
                           scheduled=True, deferred=True)
    elif way == "deferred-overlapped":
        params = _train_overlapped(model, batch, storm(min_offload_bytes=0), deferred=True)
    else:
        everything = f"{torch.cuda.get_device_properties(0).total_memory}B"
        _, params = _train(model, batch, storm(min_offload_bytes=0, memory_budget=everything),
                           lr=1e-2, fused=True, scheduled=True)
    for param, want in zip(params, expected):
        torch.testing.assert_close(param, want, rtol=1e-4, atol=1e-4)


def test_overlapped_optimizer_without_a_streamed_parameter_fails_the_backward():
    _, model, batch = _pair()
    norms = [p for n, p in model.named_parameters() if "norm" in n]
    overlapped = streaming.OverlappedOptimizer(torch.optim.AdamW(norms))
    with pytest.raises(RuntimeError, match="optimizer step after it, failed") as caught, \
            overlapped.final_backward():
        model(*batch).backward()
    assert "is not in the optimizer" in str(caught.value.__cause__)


def _break_first_block(net) -> None:
    block = net.blocks[0]
    forward = block.forward

    def broken(*args):
        torch._dynamo.graph_break()
        return forward(*args)

    block.forward = broken


def test_overlapped_optimizer_waits_for_every_graph_of_a_broken_step():
    """A tied embedding read before and after a graph break gets its gradient from two
    backward graphs: it is stepped once, after both."""
    reference, model, batch = _pair(dataclasses.replace(SHAPE, tie_embeddings=True))
    for net in (reference, model):
        _break_first_block(net)
    _, expected = _train(reference, batch, storm(**CPU_TEST_OPTIONS), lr=1e-2, fused=True,
                         scheduled=True)
    planned = []
    backend = StormBackend(StormConfig.from_options(**CPU_TEST_OPTIONS), observer=planned.append)
    params = _train_overlapped(model, batch, backend)
    sending = [g for g in planned if nodes(g.backward, ops.accumulate_grad)]
    assert len(sending) >= 2, "the break did not split the step"
    for param, want in zip(params, expected):
        torch.testing.assert_close(param, want)


def _send_of(node: fx.Node) -> fx.Node:
    """The ``storm.send_grad`` an ``accumulate_grad`` adds the copy of."""
    while node.target is not ops.send_grad:
        node = node.args[0]
    return node


def _host_rates(add: float = 1e10, adamw: float = 5e9) -> CostModel:
    return CostModel(dataclasses.replace(PROFILES["cpu-test"], host_add_bandwidth=add,
                                         host_adamw_bandwidth=adamw))


def _one_at_a_time(work) -> bool:
    return all(b.start_s >= a.end_s - 1e-15 for a, b in zip(work, work[1:]))


def test_host_thread_adds_each_gradient_after_its_copy_and_the_backward_waits_for_it():
    graphs, _ = _streamed_graphs()
    adds = nodes(graphs.backward, ops.accumulate_grad)
    fast, slow = (simulate(graphs, _host_rates(add=rate)) for rate in (1e10, 1e6))
    for prediction, rate in ((fast, 1e10), (slow, 1e6)):
        copies = {c.node: c for c in prediction.copies if c.graph == "bw"}
        work = list(prediction.host)
        assert [(h.work, h.node) for h in work] == [("add", a.name) for a in adds]
        for h, add in zip(work, adds):
            assert h.start_s >= copies[_send_of(add).name].end_s
            assert h.end_s - h.start_s == pytest.approx(h.nbytes / rate)
        assert _one_at_a_time(work)
        assert prediction.step_s >= work[-1].end_s
    assert fast.host_wait_s < slow.host_wait_s
    assert slow.step_s == pytest.approx(slow.host[-1].end_s)


def test_overlapped_steps_follow_each_weights_last_addition():
    graphs, _ = _streamed_graphs()
    prediction = simulate(graphs, _host_rates(), steps=True)
    work = list(prediction.host)
    weights = {a.name: a.args[1].name for a in nodes(graphs.backward, ops.accumulate_grad)}
    last_add = {}
    for h in work:
        if h.work == "add":
            last_add[weights[h.node]] = h.end_s
    steps = [h for h in work if h.work == "step"]
    assert sorted(h.node for h in steps) == sorted(set(weights.values()))
    assert all(h.start_s >= last_add[h.node] for h in steps)
    assert _one_at_a_time(work)
    assert prediction.step_s >= work[-1].end_s


def test_predicted_optimizer_step_puts_micro_batches_and_the_optimizer_together():
    graphs, _ = _streamed_graphs()
    cost = _host_rates()
    weights = stepped_weights(graphs)
    assert len(weights) == len(nodes(graphs.backward, ops.accumulate_grad))
    after = predict_step(graphs, cost, 4, overlapped=False)
    during = predict_step(graphs, cost, 4, overlapped=True)
    for step in (after, during):
        assert step.micro_batch_s == pytest.approx(simulate(graphs, cost).step_s)
        assert step.first_micro_batch_s == pytest.approx(
            simulate(graphs, cost, first=True).step_s)
        assert step.step_s == pytest.approx(step.first_micro_batch_s + 2 * step.micro_batch_s
                                            + step.last_micro_batch_s + step.optimizer_s)
    assert after.optimizer_s == pytest.approx(
        sum(tensor_bytes(w.meta["val"]) for w in weights) / 5e9)
    assert after.last_micro_batch_s == pytest.approx(
        simulate(graphs, cost, folded=True).step_s)
    assert during.optimizer_s == 0
    assert during.micro_batch_s <= during.last_micro_batch_s
    assert during.step_s <= after.step_s
    with pytest.raises(ValueError, match="micro_batches must be at least 1"):
        predict_step(graphs, cost, 0, overlapped=False)


def test_a_steps_first_micro_batch_copies_the_trained_weights_kept_on_the_device_again():
    """The optimizer changes a trained weight the plan keeps on the device, so the next step's
    first read copies it there again, on the compute stream: the first micro-batch pays that
    copy, the others do not; a step's prediction without kept weights is unchanged."""
    graphs, _ = _streamed_graphs(offload="hidden",
                                 memory_budget=asking(_budget_with_room(1 << 30)))
    cost = _host_rates()
    kept = refreshed_weights(graphs)
    assert kept and kept == list(graphs.storages.resident)
    copies = sum(cost.transfer_seconds(w.nbytes, Lane.H2D) for w in kept)
    for micro_batches in (1, 4):
        step = predict_step(graphs, cost, micro_batches, overlapped=False)
        held = micro_batches > 1
        assert step.first_micro_batch_s == pytest.approx(
            simulate(graphs, cost, first=True, held=held).step_s + copies)
    assert predict_step(graphs, cost, 4, overlapped=False).micro_batch_s == pytest.approx(
        simulate(graphs, cost, held=True).step_s)
    streamed, _ = _streamed_graphs()
    assert not refreshed_weights(streamed)


def test_a_steps_first_gradients_cost_the_host_no_addition():
    """The first micro-batch's gradients stay in their buffers as ``.grad`` (``HostAdder``):
    the host thread adds nothing then, and a one-micro-batch step is that micro-batch alone,
    its host time AdamW's only."""
    graphs, _ = _streamed_graphs()
    cost = _host_rates(add=1e6)                 # additions slow enough to show
    first, later = simulate(graphs, cost, first=True), simulate(graphs, cost)
    assert {h.work for h in first.host} == {"keep"}
    assert all(h.end_s == h.start_s for h in first.host)
    assert {h.work for h in later.host} == {"add"}
    assert first.step_s < later.step_s and first.host_wait_s < later.host_wait_s
    after = predict_step(graphs, cost, 1, overlapped=False)
    during = predict_step(graphs, cost, 1, overlapped=True)
    assert after.step_s == pytest.approx(first.step_s + after.optimizer_s)
    assert during.step_s == pytest.approx(simulate(graphs, cost, steps=True, first=True).step_s)
    assert {h.work for h in simulate(graphs, cost, steps=True, first=True).host} == {
        "keep", "step"}


def test_a_gradient_is_sent_with_its_weight_only_where_folding_it_beats_the_host():
    """``insert_transfers`` gives a gradient's send its weight (folded in a step's last
    backward) only where the link copies its host sum in faster than the host adds it."""
    fast_host = nodes(_streamed_graphs()[0].backward, ops.send_grad)
    assert fast_host and not any(folds_on_device(n) for n in fast_host)


def test_a_steps_last_backward_folds_its_gradients_into_their_host_sums_on_the_device(
        slow_host_profile):
    """The last micro-batch of a step of several folds each gradient sent with its weight (those
    whose copy in beats the host's addition under the profile) into its host sum on the device:
    the sum comes in beside the gradient's copy home, and the host adds nothing for it; with
    additions slower than the link the micro-batch ends sooner, and a step of several
    micro-batches ends with that one."""
    graphs, _ = _streamed_graphs(profile=slow_host_profile)
    sends = nodes(graphs.backward, ops.send_grad)
    folding = [n for n in sends if folds_on_device(n)]
    profile = CostModel(DeviceProfile.from_json(slow_host_profile))
    assert folding and all(folds_on_device(n) == profile.folds_faster(tensor_bytes(n.meta["val"]))
                           for n in sends)
    cost = _host_rates(add=1e6)
    added, folded = simulate(graphs, cost), simulate(graphs, cost, folded=True)
    assert {h.work for h in added.host} == {"add"}
    work = {h.node: h for h in folded.host}
    for add in nodes(graphs.backward, ops.accumulate_grad):
        assert work[add.name].work == ("keep" if _send_of(add) in folding else "add")
    assert folded.step_s < added.step_s

    def moved(prediction, lane):
        return sum(c.nbytes for c in prediction.copies if c.graph == "bw" and c.lane is lane)
    assert moved(folded, Lane.H2D) == moved(added, Lane.H2D) + sum(
        tensor_bytes(n.meta["val"]) for n in folding)
    assert moved(folded, Lane.D2H) == moved(added, Lane.D2H)
    copies = {c.node: c for c in folded.copies}
    for add in nodes(graphs.backward, ops.accumulate_grad):
        send = _send_of(add)
        if send in folding:
            assert work[add.name].start_s >= max(copies[send.name].end_s,
                                                 copies[f"{send.name}.fold_in"].end_s)
    step = predict_step(graphs, cost, 3, overlapped=False)
    assert step.last_micro_batch_s == pytest.approx(folded.step_s)
    assert step.micro_batch_s == pytest.approx(added.step_s)
    assert predict_step(graphs, cost, 1, overlapped=False).last_micro_batch_s == pytest.approx(
        simulate(graphs, cost, first=True).step_s)


@pytest.mark.parametrize("add_rate", [1e10, 1e6], ids=["host-keeps-up", "host-bound"])
def test_accumulating_micro_batches_leave_their_additions_to_the_next(add_rate):
    graphs, _ = _streamed_graphs()
    cost = _host_rates(add=add_rate)
    each = simulate(graphs, cost)
    adding = sum(h.end_s - h.start_s for h in each.host if h.work == "add")
    waiting = predict_step(graphs, cost, 4, overlapped=False)
    deferred = predict_step(graphs, cost, 4, overlapped=False, accumulating=True)
    compute = each.step_s - each.host_wait_s
    assert each.host_wait_s > 0
    assert deferred.host_wait_s == 0
    assert deferred.micro_batch_s == pytest.approx(max(compute, adding))
    assert (adding > compute) == (add_rate == 1e6)
    assert deferred.last_micro_batch_s == waiting.last_micro_batch_s
    assert deferred.first_host_wait_s == 0
    assert deferred.host_s == pytest.approx(
        waiting.host_s - waiting.first_host_wait_s - 2 * each.host_wait_s)
    assert deferred.step_s <= waiting.step_s


def test_host_rates_are_measured_on_this_host():
    rates = host_rates(nbytes=1 << 20, repeats=1)
    assert set(rates) == {"host_add_bandwidth", "host_adamw_bandwidth"}
    assert all(0 < rate < float("inf") for rate in rates.values())


class _Twice(torch.nn.Module):
    def forward(self, weight):
        return 2 * weight


def test_a_streamed_weight_is_read_without_calling_its_parametrizations(monkeypatch):
    model, _ = build_llama(SHAPE, "cpu")
    reference = copy.deepcopy(model)
    stream_parameters(model, "cpu", resident_bytes=RESIDENT_BYTES)
    calls = []
    monkeypatch.setattr(streaming._Fetch, "forward", lambda self, w: calls.append(w))
    assert torch.equal(model.lm_head.weight, reference.lm_head.weight)
    assert calls == []


def test_a_deep_copy_of_a_streamed_model_reads_its_own_weights():
    model, _ = build_llama(SHAPE, "cpu")
    reference = copy.deepcopy(model)
    stream_parameters(model, "cpu", resident_bytes=RESIDENT_BYTES)
    duplicate = copy.deepcopy(model)
    with torch.no_grad():
        duplicate.lm_head.parametrizations.weight.original.mul_(2)
    assert torch.equal(model.lm_head.weight, reference.lm_head.weight)
    assert torch.equal(duplicate.lm_head.weight, 2 * reference.lm_head.weight)


@pytest.mark.parametrize("backend", [None, "eager"])
def test_a_parametrization_stacked_on_a_streamed_weight_still_applies(backend):
    model, inputs = build_llama(SHAPE, "cpu")
    reference = copy.deepcopy(model)
    stream_parameters(model, "cpu", resident_bytes=RESIDENT_BYTES)
    torch.nn.utils.parametrize.register_parametrization(model.lm_head, "weight", _Twice(),
                                                        unsafe=True)
    with torch.no_grad():
        reference.lm_head.weight.mul_(2)
    run = model if backend is None else torch.compile(model, backend=backend)
    torch.testing.assert_close(run(*inputs), reference(*inputs))


BLOCKS = 10
"""More blocks than Dynamo's recompile limit (8): past it, blocks that each needed a graph of
their own would run uncompiled."""


def test_identical_blocks_compiled_one_by_one_share_one_graph():
    """Regional compilation of a streamed model: the blocks' modules share their parametrized
    classes, so Dynamo guards pass from block to block and one storm graph serves them all; the
    gradients are the unstreamed model's."""
    model, (tokens, targets) = build_llama(dataclasses.replace(SHAPE, layers=BLOCKS), "cpu")
    reference = copy.deepcopy(model)
    stream_parameters(model, "cpu", resident_bytes=RESIDENT_BYTES)
    backend = storm(**CPU_TEST_OPTIONS)
    for block in model.blocks:
        block.compile(backend=backend)
    counters.clear()
    model(tokens, targets).backward()
    reference(tokens, targets).backward()
    assert counters["stats"]["unique_graphs"] == 1
    for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, expected.grad, msg=name)


REGIONAL_BUDGET = "3MiB"
"""Below what the tiny LoRA Llama's 10 blocks hold as one graph's plan: its runs before the
backward are planned again."""
REGIONAL_COMPILES = 6
"""Compiles of three such steps: the block graphs and their replans (12 when every run's
room was planned anew)."""


def test_identical_blocks_under_a_byte_budget_reuse_their_runs_plans():
    """Each block is a run of one graph before the backward; the rooms of the runs shrink by
    what each holds, and a plan made for an earlier run serves the later ones its peak fits,
    so three steps compile a few plans, not one per block; the gradients stay the unstreamed
    model's and the third step warns of nothing."""
    base = add_lora(build_llama(dataclasses.replace(SHAPE, layers=BLOCKS), "cpu")[0], 4)
    model, reference = copy.deepcopy(base), copy.deepcopy(base)
    stream_parameters(model, "cpu", resident_bytes=RESIDENT_BYTES, host_format="nf4")
    stream_parameters(reference, "cpu", resident_bytes=RESIDENT_BYTES, host_format="nf4")
    options = {k: v for k, v in CPU_TEST_OPTIONS.items() if k not in ("offload", "recompute")}
    backend = storm(**options, memory_budget=REGIONAL_BUDGET)
    for block in model.blocks:
        block.compile(backend=backend)
    counters.clear()
    generator = torch.Generator().manual_seed(0)
    for step in range(3):
        tokens = torch.randint(SHAPE.vocab, (SHAPE.batch, SHAPE.seq + 1), generator=generator)
        with warnings.catch_warnings():
            if step == 2:
                warnings.filterwarnings("error", message="storm")
            model(tokens[:, :-1], tokens[:, 1:]).backward()
        reference(tokens[:, :-1], tokens[:, 1:]).backward()
        for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
            if param.requires_grad:
                torch.testing.assert_close(param.grad, expected.grad, msg=name)
                param.grad = expected.grad = None
    assert counters["aot_autograd"]["total"] <= REGIONAL_COMPILES


def test_a_parametrization_stacked_on_one_shared_module_leaves_the_others_storms_getter():
    model, _ = build_llama(SHAPE, "cpu")
    reference = copy.deepcopy(model)
    stream_parameters(model, "cpu", resident_bytes=RESIDENT_BYTES)
    changed, other = model.blocks[0].q, model.blocks[1].q
    assert type(changed) is type(other)
    torch.nn.utils.parametrize.register_parametrization(changed, "weight", _Twice(),
                                                        unsafe=True)
    assert type(changed) is not type(other)
    assert type(other).__dict__["weight"].fget.__qualname__.startswith("_read_streamed")
    assert torch.equal(changed.weight, 2 * reference.blocks[0].q.weight)
    assert torch.equal(other.weight, reference.blocks[1].q.weight)


def test_a_streamed_weight_moved_by_to_is_read_on_its_new_device():
    model, _ = build_llama(SHAPE, "cpu")
    stream_parameters(model, "cpu", resident_bytes=RESIDENT_BYTES)
    model.to("meta")
    assert model.lm_head.parametrizations.weight.original.device.type == "cpu"
    assert model.lm_head.weight.device.type == "meta"


def test_a_streamed_weight_whose_list_is_edited_reads_through_the_list():
    model, _ = build_llama(SHAPE, "cpu")
    reference = copy.deepcopy(model)
    stream_parameters(model, "cpu", resident_bytes=RESIDENT_BYTES)
    chain = model.lm_head.parametrizations.weight
    chain[0] = torch.nn.Sequential(chain[0], _Twice())
    assert torch.equal(model.lm_head.weight, 2 * reference.lm_head.weight)


@pytest.fixture
def pinning(monkeypatch):
    """``runtime.pin_quickly`` on a pretend CUDA host, recording the allocator settings set."""
    from storm_compile.runtime import streams as runtime

    settings = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", settings.append,
                        raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    runtime.pin_quickly.cache_clear()
    yield runtime, settings
    runtime.pin_quickly.cache_clear()


def test_storm_pins_through_host_register_on_threads_once(pinning, monkeypatch):
    runtime, settings = pinning
    monkeypatch.setattr(torch.cuda.memory, "host_memory_stats", lambda: {"num_host_alloc": 0})
    assert runtime.pin_quickly() and runtime.pin_quickly()
    runtime.pin_quickly.cache_clear()
    monkeypatch.setattr(torch.cuda.memory, "host_memory_stats", dict)  # no allocator yet
    assert runtime.pin_quickly()
    settings.pop()
    assert settings == [f"pinned_use_cuda_host_register:True,"
                        f"pinned_num_register_threads:{runtime.PINNING_THREADS}"]


@pytest.mark.parametrize("configured, pinned_blocks", [
    ("pinned_use_background_threads:True", 0), ("expandable_segments:True", 2),
    ("", None)], ids=["user-chose", "already-pinned", "no-stats"])
def test_storm_leaves_pinning_alone_where_switching_is_not_safe_or_not_its_call(
        pinning, monkeypatch, configured, pinned_blocks):
    runtime, settings = pinning
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", configured)
    stats = None if pinned_blocks is None else (lambda: {"num_host_alloc": pinned_blocks})
    monkeypatch.setattr(torch.cuda.memory, "host_memory_stats", stats)
    assert not runtime.pin_quickly()
    assert settings == []


class _PinCounter:
    """``PinnedPool._pin`` on a machine without CUDA: a plain buffer, counted; with ``gate``,
    the first pin waits for it."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.sizes: list[int] = []
        self.gate = gate

    def __call__(self, size: int) -> torch.Tensor:
        if self.gate is not None and not self.sizes:
            self.sizes.append(size)
            self.gate.wait()
        else:
            self.sizes.append(size)
        return torch.empty(size, dtype=torch.uint8)


@pytest.fixture
def pool(monkeypatch):
    """A fresh pinned pool that pins through :class:`_PinCounter` (``pool.pins``)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    fresh = PinnedPool()
    fresh.pins = _PinCounter()
    monkeypatch.setattr(fresh, "_pin", fresh.pins)
    return fresh


POOL_LIMIT = 1 << 20


def test_a_reservation_pins_ahead_and_acquire_takes_what_it_pinned(pool):
    pool.reserve([1000, 1000, 5000], POOL_LIMIT).join()
    assert sorted(pool.pins.sizes) == sorted(map(bucket_bytes, [1000, 1000, 5000]))
    held = pool.acquire(1000, POOL_LIMIT).view(-1)  # in use: the next acquire takes the other
    second = pool.acquire(1000, POOL_LIMIT)
    assert second is not None and second.data_ptr() != held.data_ptr()
    assert len(pool.pins.sizes) == 3
    assert pool.reserve([1000, 5000], POOL_LIMIT) is None     # all held already


def test_a_pooled_gradient_stays_as_grad_only_while_the_pool_has_room(pool, monkeypatch):
    """A gradient that came home in a pinned pool buffer becomes ``.grad`` while the pool could
    still pin another buffer of its size (the next micro-batch's copies need their own);
    past that it is copied, and the buffer goes back to the pool."""
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)
    adder = HostAdder(pool)
    nbytes = 3 * 4
    limit = 2 * bucket_bytes(nbytes)
    kept, copied = torch.zeros(3, requires_grad=True), torch.zeros(3, requires_grad=True)
    first = pool.acquire(nbytes, limit)[:nbytes].view(torch.float32).fill_(1.0)
    adder.add(first, kept, None)
    assert kept.grad.data_ptr() == first.data_ptr()
    second = pool.acquire(nbytes, limit)[:nbytes].view(torch.float32).fill_(2.0)
    assert second.data_ptr() != first.data_ptr()
    adder.add(second, copied, None)
    adder.join()
    assert copied.grad.data_ptr() != second.data_ptr()
    torch.testing.assert_close(copied.grad, torch.full((3,), 2.0))
    torch.testing.assert_close(kept.grad, torch.ones(3))


def test_idle_pool_buffers_count_as_room_for_a_gradient_kept_as_grad(pool, monkeypatch):
    """A pool at its limit whose other buffers are idle still keeps a gradient in its buffer
    as ``.grad``: the next micro-batch's copy reuses an idle buffer, or ``acquire`` lets one
    go."""
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)
    adder = HostAdder(pool)
    nbytes = 3 * 4
    limit = 2 * bucket_bytes(nbytes)
    held = pool.acquire(nbytes, limit)[:nbytes].view(torch.float32).fill_(1.0)
    idle = pool.acquire(nbytes, limit)
    assert idle.data_ptr() != held.data_ptr() and pool.reserved_bytes == limit
    del idle
    kept = torch.zeros(3, requires_grad=True)
    adder.add(held, kept, None)
    adder.join()
    assert kept.grad.data_ptr() == held.data_ptr()
    assert pool.acquire(nbytes, limit) is not None


def test_a_reservation_stops_at_the_limit(pool):
    size = bucket_bytes(1000)
    pool.reserve([1000] * 5, 2 * size).join()
    assert pool.pins.sizes == [size, size] and pool.reserved_bytes == 2 * size


def test_acquire_waits_for_a_buffer_being_reserved_instead_of_pinning_another(pool):
    gate = threading.Event()
    pool.pins.gate = gate
    pool.reserve([1000], POOL_LIMIT)
    taken = []
    taker = threading.Thread(target=lambda: taken.append(pool.acquire(1000, POOL_LIMIT)))
    taker.start()
    taker.join(WORKER_SETTLE_S)
    assert taker.is_alive() and not taken       # waiting for the reservation's buffer
    gate.set()
    taker.join()
    assert taken[0] is not None and len(pool.pins.sizes) == 1


class _Reads(TorchDispatchMode):
    """The host weights ``storm.fetch_weight`` reads, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.weights: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is ops.fetch_weight:
            self.weights.append(args[0])
        return func(*args, **(kwargs or {}))


def test_the_backend_prepares_each_streamed_gradient_as_it_compiles(monkeypatch):
    """Every trainable streamed weight, once, in the order the backward sends
    them (the forward's reads reversed), under the option's host limit."""
    reserved = []
    monkeypatch.setattr(get_runtime(), "prepare_backward",
                        lambda weights, limit: reserved.append((weights, limit)))
    _, model, batch = _pair()
    model.blocks[0].q.parametrizations.weight.original.requires_grad_(False)
    with _Reads() as reads:
        model(*batch)
    sent, seen = [], set()
    for weight in reads.weights:
        if weight.requires_grad and id(weight) not in seen:
            seen.add(id(weight))
            sent.append(weight)
    torch.compile(model, backend=storm(**CPU_TEST_OPTIONS))(*batch).backward()
    (weights, limit), = reserved
    assert len(weights) == len(sent) == len(reads.weights) - 1
    assert all(w is s for w, s in zip(weights, reversed(sent)))
    assert limit == StormConfig.from_options(**CPU_TEST_OPTIONS).host_memory_limit


class _LoggedStream:
    """A CUDA stream's stand-in that logs the waits queued on it."""

    def __init__(self, name: str, device_index: int, log: list) -> None:
        self.name, self.device_index, self.log = name, device_index, log

    def wait_event(self, event) -> None:
        self.log.append(("wait", self.name, event))


class _LoggedEvent:
    """A CUDA event's stand-in that logs where it is recorded."""

    def __init__(self, log: list) -> None:
        self.log = log

    def record(self, stream) -> None:
        self.log.append(("record", stream.name, self))


def test_a_copy_waits_for_the_compute_streams_queued_work_and_leaves_the_current_stream(
        monkeypatch):
    """Each copy's stream waits on an event recorded on the compute stream as the copy is
    launched, the copy runs with its stream current, and the compute stream is current again
    after: one event per thread is recorded again for each copy; a copy for a device other than
    the current one goes through ``torch.cuda.stream``."""
    log: list = []
    compute, copies = _LoggedStream("compute", 0, log), _LoggedStream("d2h", 0, log)
    other = _LoggedStream("compute1", 1, log)
    current = {0: compute, 1: other}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: current[device.index])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "Event", lambda: _LoggedEvent(log))
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: log.append(("current", s.name)))

    @contextlib.contextmanager
    def switched(stream):
        log.append(("enter", stream.name))
        yield
        log.append(("exit", stream.name))

    monkeypatch.setattr(torch.cuda, "stream", switched)
    runtime = TransferRuntime()
    src = torch.arange(4.0)

    def launch(device_index: int) -> torch.Tensor:
        dst = torch.zeros(4)
        runtime.launch_copy(dst, src, copies, torch.device("cuda", device_index))
        log.append(("copied", bool(torch.equal(dst, src))))
        return dst

    kept = [launch(0), launch(0)]
    event = log[0][2]
    assert log == 2 * [("record", "compute", event), ("wait", "d2h", event), ("current", "d2h"),
                       ("current", "compute"), ("copied", True)]
    log.clear()
    threaded = threading.Thread(target=lambda: kept.append(launch(0)))
    threaded.start()
    threaded.join()
    assert log[0][2] is not event and log[1] == ("wait", "d2h", log[0][2])
    log.clear()
    kept.append(launch(1))
    assert [entry[:2] for entry in log] == [("record", "compute1"), ("wait", "d2h"),
                                            ("enter", "d2h"), ("exit", "d2h"), ("copied", True)]
    assert len(kept) == 4
