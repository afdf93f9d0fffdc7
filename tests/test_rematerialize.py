"""``rematerialize``: the planner's recomputation rebuilt on the split it was planned on.

Properties on the streamed tiny Llama under a budget that recomputes (its graphs also fetch
weights again in the backward, which a recomputation may read): each recomputed value
is rebuilt once, from what stays saved, and no longer leaves the forward; every gradient
equals eager's; a plan that recomputes nothing leaves the graphs as they are. The printed
graphs of a tiny function are ``tests/goldens/recompute_*.txt`` (``test_golden.py``)."""

import collections
import importlib

import torch

from helpers import CPU_TEST_OPTIONS, asking, cost_model, nodes
from storm_compile.cli.commands import plan_model, planning_context
from storm_compile.cli.models import LLAMA_PRESETS, build_llama
from storm_compile.compiler import pipeline
from storm_compile.compiler.backend import StormBackend
from storm_compile.config import StormConfig
from storm_compile.cost.simulate import device_bytes, simulate
from storm_compile.fx.graphs import PassContext, StormGraphs, saved_values
from storm_compile.runtime import ops
from storm_compile.weights import streaming
from test_golden import RECOMPUTE_OPTIONS, capture_tiny

REMATERIALIZE = importlib.import_module("storm_compile.passes.rematerialize")
"""The pass's module (the package exports the pass function under the same name)."""

RESIDENT_BYTES = 4096
"""Above the tiny Llama's norm weights and below its smallest matrix: the matrices stream."""
ROOM_BYTES = 1 << 14
"""Budget room above the plan that keeps every activation: the search recomputes to fit."""


def _model():
    torch.manual_seed(0)
    return build_llama(LLAMA_PRESETS["tiny"])


def _streamed(**options):
    """The streamed tiny Llama's graphs under ``options``, and its parameters' gradients."""
    model, batch = _model()
    streaming.stream_parameters(model, "cpu", resident_bytes=RESIDENT_BYTES)
    captured = []
    config = StormConfig.from_options(**{**CPU_TEST_OPTIONS, "offload": "hidden", **options})
    torch.compile(model, backend=StormBackend(config, observer=captured.append))(*batch) \
        .backward()
    return captured[0], [p.grad for p in model.parameters()]


def _budget() -> str:
    graphs, _ = _streamed(memory_budget=1.0)
    return asking(device_bytes(graphs, simulate(graphs, cost_model())) + ROOM_BYTES)


def _repeated(graph: torch.fx.Graph) -> list[str]:
    """Nodes that compute what an earlier node of ``graph`` computed (same op, same inputs)."""
    seen, repeated = set(), []
    for node in (n for n in graph.nodes if n.op == "call_function"):
        key = (node.target, repr(node.args), repr(node.kwargs))
        if key in seen:
            repeated.append(node.name)
        seen.add(key)
    return repeated


def test_each_recomputed_value_is_rebuilt_once_and_gradients_match_eager():
    """The partitioner already rebuilds some forward nodes in the backward (each streamed
    weight's fetch, the rotary tables); a recomputation reading them runs them once."""
    graphs, grads = _streamed(memory_budget=0.3, recompute=True)
    assert graphs.plan.recompute, "the budget was met without recomputing anything"
    recomputed = set(graphs.plan.recompute)
    assert not recomputed & {n.name for n in saved_values(graphs)}
    assert [n for n in graphs.backward.graph.nodes if n.name in recomputed]
    fetched = collections.Counter(n.args[0] for n in graphs.backward.graph.find_nodes(
        op="call_function", target=ops.prefetch))
    assert fetched and max(fetched.values()) == 1, "a weight is fetched twice in the backward"
    assert not _repeated(graphs.backward.graph)
    model, batch = _model()
    model(*batch).backward()
    for grad, expected in zip(grads, [p.grad for p in model.parameters()]):
        torch.testing.assert_close(grad, expected)


def test_a_packed_weight_a_recomputation_reads_is_rebuilt_once():
    """The 70B shape's second layer under a 6.5 GiB budget recomputes matmuls of packed NF4
    weights. The partitioner already rebuilds each such weight in the backward; the copy of the
    code book each graph holds is the same constant, so the recomputation and the backward share
    one rebuilt weight (Inductor makes two rebuilds of one packed weight one kernel with two
    weight-sized outputs, live together)."""
    ctx = planning_context(memory_budget="6.5GiB", min_offload_bytes=0)
    graphs = plan_model("llama", ctx, stream=True, lora=16, host_format="nf4", preset="70b",
                        layers=2)
    lookups = graphs.backward.graph.find_nodes(op="call_function",
                                               target=torch.ops.aten.index.Tensor)
    rebuilt = {n.name for n in graphs.forward.graph.find_nodes(
        op="call_function", target=torch.ops.aten.index.Tensor)} & set(graphs.plan.recompute)
    assert rebuilt, "the plan recomputes no matmul of a packed weight"
    codes = collections.Counter(n.args[1][0].name for n in lookups)
    assert codes and max(codes.values()) == 1, f"rebuilt twice: {codes.most_common(3)}"


def test_a_plan_without_recomputation_leaves_the_graphs_as_they_are():
    graphs, _ = _streamed()
    assert not graphs.plan.recompute
    config = StormConfig.from_options(**CPU_TEST_OPTIONS)
    assert REMATERIALIZE.rematerialize(graphs, PassContext(config, cost_model())) is graphs



def test_a_backward_node_named_like_a_rebuilt_one_but_computing_else_stays():
    """The partitioner names nodes it adds to each graph apart (random-number states), so a
    backward node may share a rebuilt forward node's name and op with other inputs: both run."""
    graphs, _ = capture_tiny(RECOMPUTE_OPTIONS)
    ctx = StormBackend(StormConfig.from_options(**RECOMPUTE_OPTIONS)).ctx
    forward, backward = graphs.joint.split()
    first = StormGraphs(forward, backward, graphs.num_fwd_outputs, joint=graphs.joint)
    for storm_pass in pipeline.PLAN:
        first = storm_pass(first, ctx)
    assert "mm" in first.plan.recompute
    impostor = next(n for n in first.backward.graph.nodes if n.target is torch.ops.aten.mm.default)
    impostor._rename("mm")
    assert impostor.name == "mm"
    products = len(nodes(first.backward, torch.ops.aten.mm.default))
    rebuilt = REMATERIALIZE.rematerialize(first, ctx)
    assert len(nodes(rebuilt.backward, torch.ops.aten.mm.default)) == products + 1
