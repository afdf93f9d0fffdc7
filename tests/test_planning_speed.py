"""Planning does each piece of work once: the partitioner once per joint graph, whose code is
never generated, the
storage decisions once per plan that differs in more than the room for resident weights, and
the placement's and rewrite's shortcuts give what the long way gives. Counts, never timings."""

import gc
import importlib
import random

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx._lazy_graph_module import _LazyGraphModule


from helpers import CPU_TEST_OPTIONS, asking, cost_model
from storm_compile.cli.models import LLAMA_PRESETS, build_llama
from storm_compile.compiler import pipeline
from storm_compile.compiler.backend import StormBackend
from storm_compile.config import StormConfig
from storm_compile.cost.placement import _InFlight
from storm_compile.cost.simulate import device_bytes, simulate
from storm_compile.fx import graphs as graphs_module
from storm_compile.fx.plan import Unplaced
from storm_compile.runtime import ops
from storm_compile.weights import streaming

INSERT_TRANSFERS = importlib.import_module("storm_compile.passes.insert_transfers")
"""The pass's module (the package exports the pass function under the same name)."""

RESIDENT_BYTES = 4096
"""Above the tiny Llama's norm weights and below its smallest matrix: the matrices stream."""
ROOM_BYTES = 1 << 16
"""Room above the plan without resident weights for a few of the tiny Llama's weights: a
resident try follows the plan without them, and another the plan that trades activations for
weights kept."""
FEW_ROOM_BYTES = 1 << 14
"""Room for fewer weights: with recomputation, the plans that fit the budget recompute two
different sets of storages."""


def _streamed_graphs(**options):
    """The graphs storm made of the streamed tiny Llama under the CPU test options updated
    with ``options``."""
    torch.manual_seed(0)
    model, batch = build_llama(LLAMA_PRESETS["tiny"])
    streaming.stream_parameters(model, "cpu", resident_bytes=RESIDENT_BYTES)
    captured = []
    config = StormConfig.from_options(**{**CPU_TEST_OPTIONS, **options})
    torch.compile(model, backend=StormBackend(config, observer=captured.append))(*batch) \
        .backward()
    return captured[0]


def _budget(room: int) -> str:
    """A byte budget ``room`` bytes above the predicted device peak of the streamed tiny
    Llama's plan with every activation kept and no resident weight."""
    graphs = _streamed_graphs(offload="hidden", memory_budget=1.0)
    return asking(device_bytes(graphs, simulate(graphs, cost_model())) + room)


def _counting(monkeypatch, module, name: str, seen: list, record=lambda result: result):
    """Replace ``module.name`` by a wrapper appending ``record`` of each call's result."""
    original = getattr(module, name)

    def counted(*args, **kwargs):
        result = original(*args, **kwargs)
        seen.append(record(result))
        return result

    monkeypatch.setattr(module, name, counted)


def test_a_budget_partitions_once(monkeypatch):
    """Re-plans under a byte budget start from copies of the one split, and each plan's
    recomputation is rebuilt on its copy: the partitioner runs once, however many plans
    recompute."""
    budget = _budget(FEW_ROOM_BYTES)
    partitions, recomputed = [], []
    _counting(monkeypatch, graphs_module, "min_cut_rematerialization_partition", partitions,
              lambda split: 1)
    _counting(monkeypatch, pipeline, "plan_storages", recomputed,
              lambda graphs: frozenset(graphs.plan.recompute))
    _streamed_graphs(offload="hidden", memory_budget=budget, recompute=True)
    distinct = {names for names in recomputed if names}
    assert len(recomputed) > 1 and len(distinct) > 1, "the budget makes re-plans that recompute"
    assert len(partitions) == 1


@pytest.mark.parametrize("enabled", [True, False])
def test_the_cycle_collector_is_off_while_storm_plans_and_as_it_was_after(monkeypatch, enabled):
    """Planning drops copies of large graphs full of reference cycles: the collector's passes
    over them are skipped while storm plans, and the user's setting stands after."""
    seen = []
    _counting(monkeypatch, pipeline, "plan_within_budget", seen, lambda graphs: gc.isenabled())
    (gc.enable if enabled else gc.disable)()
    try:
        _streamed_graphs(offload="hidden", memory_budget=0.5)
        assert seen == [False]
        assert gc.isenabled() is enabled
    finally:
        gc.enable()


def test_the_joint_graph_never_generates_its_code():
    """The joint graph is rewritten and split, never run: its Python code is never made, even
    when AOTAutograd hands it over as an eager graph module (dynamo's lazy modules off)."""
    budget = _budget(FEW_ROOM_BYTES)
    with torch._dynamo.config.patch(use_lazy_graph_module=False):
        graphs = _streamed_graphs(offload="hidden", memory_budget=budget, recompute=True)
    joint = graphs.joint.module
    assert isinstance(joint, _LazyGraphModule) and joint._needs_recompile()


def test_plans_differing_only_in_resident_room_are_decided_once(monkeypatch):
    """Each try at keeping weights on the device rewrites a copy of the decisions of the plan
    it starts from; no try decides the storages again, and the decided graphs stay as they
    were decided (the copies are what is rewritten)."""
    budget = _budget(ROOM_BYTES)
    decided, copied = [], []
    _counting(monkeypatch, pipeline, "plan_storages", decided)
    original = pipeline.copy_decided

    def copy_decided(graphs):
        copied.append(graphs.forward)
        return original(graphs)

    monkeypatch.setattr(pipeline, "copy_decided", copy_decided)
    graphs = _streamed_graphs(offload="hidden", memory_budget=budget)
    assert graphs.storages.resident, "the room keeps weights on the device"
    assert {id(gm) for gm in copied} == {id(d.forward) for d in decided}
    assert len(copied) > len(decided), "a resident try reuses a plan's decisions"
    for plan in decided:
        assert not any(n.target in ops.TRANSFER_OPS for gm in (plan.forward, plan.backward)
                       for n in gm.graph.nodes), "a decided plan is never rewritten"


def test_device_weights_finds_the_graph_constants_once(monkeypatch):
    """What a streamed forward holds on the device walks its graph for constants once, not once
    per streamed weight (the 28-layer Llama streams 196 weights in a graph of 10 000 nodes)."""
    graphs = _streamed_graphs(offload="hidden")
    walks = []
    _counting(monkeypatch, streaming, "graph_constants", walks)
    weights = streaming.device_weights(graphs.forward, 0)
    streamed = [n for n in graphs.forward.graph.find_nodes(op="placeholder")
                if any(u.target in (ops.fetch_weight, ops.prefetch) for u in n.users)]
    assert weights is not None and len(streamed) > 1
    assert len(walks) == 1


def _names_its_own_nodes(graphs) -> bool:
    """Whether every node ``graphs``' storage plan names is a node of ``graphs``' modules."""
    forward = set(graphs.forward.graph.nodes)
    backward = set(graphs.backward.graph.nodes)
    return all(
        storage.root in forward and set(storage.members) <= forward
        and (storage.first_read is None or storage.first_read in backward)
        and not (isinstance(decision.held, Unplaced) and decision.held.read is not None
                 and decision.held.read not in backward)
        for storage, decision in graphs.storages)


def test_a_copy_of_decided_graphs_names_its_own_nodes(monkeypatch):
    """Checked as each copy is made: the passes that run on it later rewrite it (an offloaded
    storage's saved views are rebuilt after its wait)."""
    copies = []
    _counting(monkeypatch, pipeline, "copy_decided", copies, record=_names_its_own_nodes)
    _streamed_graphs(offload="hidden", memory_budget=_budget(ROOM_BYTES))
    assert copies and all(copies)


def _in_flight(intervals, at: int) -> int:
    return sum(nbytes for issue, read, nbytes in intervals if issue <= at < read)


def test_in_flight_peak_is_the_most_bytes_at_any_issue_before_the_read():
    """The placement's window check: the peak from an issue up to a read equals the largest
    sum, over the placed copies, at the issue and at every later issue before the read."""
    rng = random.Random(0)
    for _ in range(2000):
        intervals = [(rng.randrange(30), rng.randrange(30), rng.randrange(1, 10))
                     for _ in range(rng.randrange(12))]
        issue, use = rng.randrange(31), rng.randrange(31)
        checks = [issue] + [i for i, _, _ in intervals if issue <= i < use]
        expected = max(_in_flight(intervals, q) for q in checks)
        assert _InFlight(intervals, use).peak(issue) == expected, (intervals, issue, use)


@pytest.mark.parametrize("target", sorted(INSERT_TRANSFERS.PASS_THROUGH, key=str))
def test_pass_through_ops_return_their_first_argument_under_fake_tensors(target):
    """insert_transfers reads these ops' values from their first argument: dispatched through
    a fake-tensor mode, they return that very tensor."""
    with FakeTensorMode():
        x = torch.empty(4, 8)
        args = {ops.record_event: (x,), ops.wait_event: (x, x),
                ops.accumulate_grad: (x, x)}[target]
        assert target(*args) is x
