"""The memory planner: budgets met, numerics kept, recomputation driven through the partitioner."""

import dataclasses
import operator
import warnings

import pytest
import torch
from torch import fx
from torch._dynamo.exc import BackendCompilerFailed
from torch._subclasses.fake_tensor import FakeTensorMode

from helpers import CPU_TEST_OPTIONS, asking, capture, cost_model, nodes, step
from storm_compile import storm
from storm_compile.compiler.backend import StormBackend
from storm_compile.compiler import pipeline
from storm_compile.compiler.pipeline import run_passes
from storm_compile.config import StormConfig
from storm_compile.cost.simulate import device_bytes, simulate
from storm_compile.fx.graphs import PassContext, saved_values
from storm_compile.fx.plan import Action, Held
from storm_compile.fx.vocabulary import makes_choice
from storm_compile.passes import StormBudgetError
from storm_compile.runtime import ops
from storm_compile.runtime.streams import bucket_bytes
from storm_compile.weights.streaming import device_weights
from zoo import ZOO

MODELS = sorted(ZOO)
PLAN_OPTIONS = {**CPU_TEST_OPTIONS, "offload": "hidden", "recompute": True}
"""Every activation of the tiny CPU models may move; the planner may recompute."""

FRACTIONS = (0.75, 0.5, 0.25)


def _budget_options(budget) -> dict:
    return {**PLAN_OPTIONS, "memory_budget": budget}


def _recomputed(graphs) -> list[str]:
    """Names of the recomputed storages' owners and saved views."""
    return [n.name for storage, _ in graphs.plan.recomputed
            for n in (storage.root, *storage.members)]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("fraction", FRACTIONS)
def test_predicted_activation_memory_meets_the_budget(name, fraction):
    """A graph too small to reach its share of a fraction budget does what it can: it plans
    for its minimum instead of failing the compile."""
    unplanned = capture(name, **_budget_options(1.0)).plan
    target = max(int(fraction * unplanned.baseline.activation_bytes), unplanned.minimum_bytes)
    graphs = capture(name, **_budget_options(fraction))
    assert graphs.plan.target_bytes == target
    assert simulate(graphs, cost_model()).activation_bytes <= target


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("budget", [0.5, "auto"])
def test_budget_keeps_every_gradient(name, budget):
    ref_loss, ref_grads, ref_buffers = step(name, "aot_eager")
    loss, grads, buffers = step(name, storm(**_budget_options(budget)))
    torch.testing.assert_close(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for key in ref_grads:
        torch.testing.assert_close(grads[key], ref_grads[key], msg=key)
    for key in ref_buffers:
        torch.testing.assert_close(buffers[key], ref_buffers[key], msg=key)


def test_gpt_budget_recomputes_through_the_partitioner():
    graphs = capture("gpt", **_budget_options(0.25))
    recomputed = _recomputed(graphs)
    assert recomputed and graphs.plan.recompute_bytes > 0
    saved = {n.name for n in saved_values(graphs)}
    assert not saved & set(recomputed), "a storage planned for recompute is still saved"
    backward_ops = {n.name for n in graphs.backward.graph.nodes}
    assert set(recomputed) <= backward_ops, "the backward does not rebuild what was recomputed"


def test_random_ops_are_never_recomputed():
    graphs = capture("dropout", **_budget_options(0.1))
    joint = {n.name: n for n in graphs.joint.module.graph.nodes}
    for name in graphs.plan.recompute:
        target = joint[name].target
        assert not (isinstance(target, torch._ops.OpOverload)
                    and torch.Tag.nondeterministic_seeded in target.tags), name


class TopkHead(torch.nn.Module):
    """A router whose top-k choice is the largest thing saved for the backward, cheap to
    recompute: a budget would rebuild it in the backward if choices could be recomputed."""

    def __init__(self) -> None:
        super().__init__()
        self.router = torch.nn.Linear(8, 512, bias=False)

    def forward(self, x):
        values, chosen = self.router(x).topk(128, dim=-1)
        return values.sin() * chosen.float()


def test_a_data_dependent_choice_is_never_recomputed():
    """A recomputed ``topk`` could choose other entries in the backward than in the forward
    (its inputs rebuilt a last bit apart): every storage whose recompute chain holds one is
    offloaded or kept instead, with the reason, and the gradients stay eager's. The routed
    MoE block of the zoo plans no choice for recomputation at any fraction."""
    captured = []
    config = StormConfig.from_options(**{**PLAN_OPTIONS, "memory_budget": 0.1})
    torch.manual_seed(0)
    model, x = TopkHead(), torch.randn(64, 8)
    torch.compile(model, backend=StormBackend(config, observer=captured.append))(x) \
        .pow(2).mean().backward()
    (graphs,) = captured
    joint = {n.name: n for n in graphs.joint.module.graph.nodes}
    assert not [n for n in graphs.plan.recompute if makes_choice(joint[n])]
    reasons = {s.name: d.reason for s, d in graphs.storages if s.eligibility.movable}
    assert reasons and all("makes a data-dependent choice (topk)" in r for r in reasons.values())
    grad = model.router.weight.grad.clone()
    model.router.weight.grad = None
    model(x).pow(2).mean().backward()
    torch.testing.assert_close(grad, model.router.weight.grad)
    for fraction in FRACTIONS:
        routed = capture("routed", **_budget_options(fraction))
        joint = {n.name: n for n in routed.joint.module.graph.nodes}
        assert not [n for n in routed.plan.recompute if makes_choice(joint[n])], fraction


@pytest.mark.parametrize("options", [{"memory_budget": 0.5}, {"memory_budget": "1GiB"},
                                     {"offload": "all"}])
def test_a_budget_storm_cannot_plan_warns_with_the_way_out(options):
    """A budget (or ``offload="all"``) on a model on the CPU, which storm does not plan, warns
    once per compile saying so and what to do; defaults there, and the same budget with
    ``transfer_cpu_tensors=True``, warn nothing."""
    def train(**chosen):
        torch.manual_seed(0)
        model, inputs, loss_fn = ZOO["mlp"]()
        loss_fn(torch.compile(model, backend=storm(inner="eager", **chosen))(*inputs)).backward()

    with pytest.warns(RuntimeWarning) as raised:
        train(**options)
    ours = [str(w.message) for w in raised if str(w.message).startswith("storm:")]
    assert len(ours) == 1 and "move the model and its inputs to the GPU" in ours[0]
    assert "transfer_cpu_tensors=True" in ours[0]
    for quiet in ({}, {**options, "transfer_cpu_tensors": True}):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            train(**quiet)


def test_a_graph_of_a_gpu_model_saving_nothing_there_plans_nothing_without_a_warning():
    """A piece of a model on the GPU (its forward reads device tensors) that saves nothing on
    the device is left unplanned without the warning meant for a model on the CPU."""
    from storm_compile.passes.plan_memory import Goal, _target

    captured = capture("mlp")
    ctx = StormBackend(StormConfig.from_options(memory_budget=0.5)).ctx
    graphs = dataclasses.replace(captured, plan=None)
    saved = set(saved_values(graphs))
    placeholders = [n for n in graphs.forward.graph.find_nodes(op="placeholder")
                    if n not in saved]
    assert placeholders                   # read by the forward, not saved for the backward
    fake = FakeTensorMode()
    cpu_values = [n.meta["val"] for n in placeholders]
    baseline = simulate(graphs, ctx.cost)
    with pytest.warns(RuntimeWarning, match="move the model and its inputs to the GPU"):
        _target(graphs, ctx, baseline, 0)
    for node, value in zip(placeholders, cpu_values):
        with fake:
            node.meta["val"] = torch.empty_strided(value.shape, value.stride(),
                                                   dtype=value.dtype, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        target = _target(graphs, ctx, baseline, 0)
    assert target.goal is Goal.HIDDEN


@pytest.mark.parametrize("name", MODELS)
def test_no_recompute_means_offloads_only(name):
    graphs = capture(name, **{**PLAN_OPTIONS, "offload": "all", "recompute": False})
    assert not graphs.plan.recompute and not _recomputed(graphs)


@pytest.mark.parametrize("name", MODELS)
def test_full_budget_changes_nothing(name):
    graphs = capture(name, **_budget_options(1.0))
    assert not graphs.plan.recompute
    for gm in (graphs.forward, graphs.backward):
        assert not any(n.target in ops.TRANSFER_OPS for n in gm.graph.nodes)


@pytest.mark.parametrize("name", MODELS)
def test_auto_stays_within_max_overhead(name):
    graphs = capture(name, **_budget_options("auto"))
    allowance = StormConfig().max_overhead * graphs.plan.baseline.step_s
    assert graphs.plan.recompute_s <= allowance


def test_offload_all_moves_everything_movable():
    graphs = capture("gpt", **{**PLAN_OPTIONS, "offload": "all"})
    prediction = simulate(graphs, cost_model())
    assert prediction.activation_bytes == graphs.plan.minimum_bytes < \
        graphs.plan.baseline.activation_bytes


def test_budget_below_the_minimum_names_it():
    with pytest.raises(BackendCompilerFailed) as caught:
        step("gpt", storm(**_budget_options("1B")))
    error = caught.value.inner_exception
    assert isinstance(error, StormBudgetError) and isinstance(error, ValueError)
    assert "below the minimum feasible for the step" in str(error)


def _device_peak(graphs) -> int:
    return device_bytes(graphs, simulate(graphs, cost_model()))


@pytest.mark.parametrize("name", MODELS)
def test_a_byte_budget_bounds_the_predicted_device_peak(name):
    """A byte budget halfway between the peak without storm and a low one (every activation
    that may move offloaded, nothing copied ahead of its use): the plan's predicted device peak,
    inputs, activations, gradients and working set, is within it."""
    unplanned = _device_peak(capture(name, **_budget_options(1.0)))
    low = _device_peak(capture(name, **{**PLAN_OPTIONS, "offload": "all",
                                        "prefetch_window_bytes": 0}))
    budget = (unplanned + low) // 2
    assert _device_peak(capture(name, **_budget_options(asking(budget)))) <= budget


@pytest.mark.parametrize("name", MODELS)
def test_a_plan_is_planned_again_for_its_link_bound_offloads_only_when_it_waits_on_copies(
        name, monkeypatch):
    """The search plans a byte budget's graph again (``pipeline._relieved``) only when its
    predicted step waits on copies for more than ``RELIEF_SHARE`` of itself and it offloads
    storages whose copies cannot hide; it keeps a new plan only when that is faster."""
    seen, tries = [], []
    relieved, relief = pipeline._relieved, pipeline._relief

    def first(graphs, ctx, planned, prediction, room):
        seen.append((planned, prediction, relieved(graphs, ctx, planned, prediction, room)))
        return seen[-1][2]

    monkeypatch.setattr(pipeline, "_relieved", first)
    monkeypatch.setattr(pipeline, "_relief", lambda *args: tries.append(relief(*args))
                        or tries[-1])
    unplanned = _device_peak(capture(name, **_budget_options(1.0)))
    low = _device_peak(capture(name, **{**PLAN_OPTIONS, "offload": "all",
                                        "prefetch_window_bytes": 0}))
    capture(name, **_budget_options(asking((unplanned + low) // 2)))
    (planned, prediction, kept), = seen
    bound = [s for s, d in planned.storages
             if d.action is Action.OFFLOAD and not d.figures.hides]
    waits = prediction.exposed_transfer_s > pipeline.RELIEF_SHARE * prediction.step_s
    assert bool(tries) == bool(bound and waits)
    assert kept is None or kept.prediction.step_s < prediction.step_s


def test_a_byte_budget_below_the_least_peak_names_it():
    """Room for the graph's inputs and the activations that cannot move, none for the
    backward's working set: the error states the least peak storm's plans reached, and
    where."""
    graphs = capture("gpt", **_budget_options(1.0))
    inputs = device_weights(graphs.forward, 0).nbytes
    with pytest.raises(BackendCompilerFailed) as caught:
        step("gpt", storm(**_budget_options(asking(inputs + graphs.plan.minimum_bytes + 1))))
    error = caught.value.inner_exception
    assert isinstance(error, StormBudgetError)
    assert "below the device memory this graph needs at its peak" in str(error)
    assert "bytes planned, 2% left to the allocator" in str(error)
    assert "of the backward" in str(error) or "of the forward" in str(error)


@pytest.mark.parametrize("name", MODELS)
def test_budget_plan_is_idempotent(name):
    graphs = capture(name, **_budget_options(0.5))
    fw_code, bw_code = graphs.forward.code, graphs.backward.code
    config = StormConfig.from_options(**{k: v for k, v in _budget_options(0.5).items()
                                         if k != "inner"})
    again = run_passes(graphs, PassContext(config, cost_model()))
    assert again.forward.code == fw_code and again.backward.code == bw_code


def test_no_prefetch_is_read_before_its_wait_under_a_budget():
    graphs = capture("gpt", **_budget_options(0.25))
    bw = graphs.backward
    order = {n: i for i, n in enumerate(bw.graph.nodes)}
    for prefetch in nodes(bw, ops.prefetch):
        (record,) = prefetch.users
        (wait,) = record.users
        source = prefetch.args[0]
        readers = [u for u in source.users if u not in (prefetch, wait)]
        assert not readers
        assert all(order[u] > order[wait] for u in wait.users if isinstance(u, fx.Node))


def test_recomputations_never_chain_two_links():
    """A recomputation may read one other (one link: it is rebuilt one step early), never one
    that reads a third: the partitioner would rebuild the whole chain at its last link's first
    use (each residual sum from the one before, at the top of the backward) and hold it."""
    from types import SimpleNamespace

    from storm_compile.fx.plan import Action
    from storm_compile.passes.plan_memory import _Rebuilds

    def layers(x):
        for _ in range(4):
            x = x + torch.relu(x)
        return x

    graph = fx.symbolic_trace(layers).graph
    sums = [n for n in graph.nodes if n.op == "call_function" and n.target is operator.add]

    def rebuild(node):
        chain = (node, *(a for a in node.all_input_nodes if a.target is torch.relu))
        return SimpleNamespace(action=Action.RECOMPUTE, root=node, chain=chain,
                               storage=SimpleNamespace(members=()))

    rebuilds = _Rebuilds()
    first, second, third, fourth = map(rebuild, sums)
    rebuilds.take(second)
    assert not rebuilds.clashes(first) and not rebuilds.clashes(third)
    rebuilds.take(third)
    assert rebuilds.clashes(first) and rebuilds.clashes(fourth)
    assert not rebuilds.clashes(SimpleNamespace(action=Action.OFFLOAD))


def _rebuild_of(node):
    """A recomputation of ``node`` alone, as the selection sees it."""
    from types import SimpleNamespace

    from storm_compile.fx.plan import Action
    return SimpleNamespace(action=Action.RECOMPUTE, root=node, chain=(node,),
                           storage=SimpleNamespace(members=()))


def _feed_forward(x):
    s = x * 2                  # a residual sum: read again after the feed-forward
    up = torch.relu(s)         # the feed-forward's values, each read right after it is made
    act = torch.sigmoid(up)
    down = torch.tanh(act)
    return s * down


def test_links_between_compact_storages_are_free_and_groups_count_as_one():
    """Rebuilds that read each other only through compact storages form one group, however
    long; the group is one link of a counted chain: reading a rebuilt residual sum and being
    read by another is two counted links."""
    from storm_compile.passes.plan_memory import _Rebuilds

    graph = fx.symbolic_trace(_feed_forward).graph
    s, up, act, down, out = [n for n in graph.nodes if n.op in ("call_function",
                                                                "call_method")]
    feed_forward = frozenset({up, act, down})
    rebuilds = _Rebuilds(feed_forward)
    for node in (up, act, down):
        assert not rebuilds.clashes(_rebuild_of(node))
        rebuilds.take(_rebuild_of(node))
    assert not rebuilds.clashes(_rebuild_of(s)) and not rebuilds.clashes(_rebuild_of(out))
    rebuilds.take(_rebuild_of(s))
    assert rebuilds.clashes(_rebuild_of(out))

    counted = _Rebuilds()
    counted.take(_rebuild_of(up))
    counted.take(_rebuild_of(act))
    assert counted.clashes(_rebuild_of(down))


def test_compact_storages_are_those_read_before_another_is_made():
    """In a planned gpt, the feed-forward's values are compact and the residual sums are not."""
    from storm_compile.passes.plan_memory import compact_storages

    graphs = capture("gpt", **_budget_options(0.5))
    movable = graphs.storages.movable()
    compact = compact_storages(graphs, movable)
    order = {n: i for i, n in enumerate(graphs.forward.graph.nodes)}
    made = sorted(order[s.root] for s in movable)
    for storage in movable:
        reads = [order[u] for u in storage.root.users if u.op != "output"]
        between = [p for p in made if order[storage.root] < p < max(reads, default=0)]
        if not between:
            assert storage.root in compact, storage.root
    sums = [s.root for s in movable if s.root.target is torch.ops.aten.add.Tensor]
    assert sums and not any(s in compact for s in sums)
    assert any(s.root.target is torch.ops.aten.mm.default and s.root in compact
               for s in movable)


def _offloaded_host_bytes(graphs) -> int:
    return sum(bucket_bytes(s.nbytes) for s, d in graphs.storages if d.action is Action.OFFLOAD)


def test_offloads_never_pass_host_memory_limit_and_the_rest_is_recomputed():
    """With room on the host for half of what the plan at 0.5 offloads, the plan keeps its
    offloads within the room, recomputes what no longer fits there, and still meets the
    budget."""
    unbounded = capture("gpt", **_budget_options(0.5))
    limit = _offloaded_host_bytes(unbounded) // 2
    graphs = capture("gpt", **_budget_options(0.5), host_memory_limit=limit)
    assert _offloaded_host_bytes(graphs) <= limit
    (full,) = [d for _, d in graphs.plan.recomputed if d.figures.host_full]
    assert "host_memory_limit has no room left" in full.reason
    assert simulate(graphs, cost_model()).activation_bytes <= graphs.plan.target_bytes


def test_the_host_room_goes_first_to_offloads_that_cannot_be_recomputed():
    """At 0.06 with room on the host for only the offloads that cannot be recomputed, the
    storages that could take that room more cheaply per byte are recomputed instead, and the
    budget is met (the room taken in rank order left none for the others: a
    ``StormBudgetError``)."""
    unbounded = capture("gpt", **_budget_options(0.06))
    must = [s for s, d in unbounded.storages
            if d.action is Action.OFFLOAD and d.figures.recompute_s is None]
    limit = sum(bucket_bytes(s.nbytes) for s in must)
    assert must and limit < _offloaded_host_bytes(unbounded) + sum(
        bucket_bytes(s.nbytes) for s, _ in unbounded.plan.recomputed)
    graphs = capture("gpt", **_budget_options(0.06), host_memory_limit=limit)
    assert _offloaded_host_bytes(graphs) <= limit
    assert any(d.figures.host_full for _, d in graphs.plan.recomputed)
    assert simulate(graphs, cost_model()).activation_bytes <= graphs.plan.target_bytes


def test_a_budget_the_host_cannot_hold_names_host_memory_limit():
    with pytest.raises(BackendCompilerFailed) as caught:
        step("gpt", storm(**{**PLAN_OPTIONS, "offload": "all", "recompute": False,
                             "host_memory_limit": 1}))
    error = caught.value.inner_exception
    assert isinstance(error, StormBudgetError)
    assert str(error).startswith("offload='all': ") and "Raise host_memory_limit" in str(error)


def test_without_a_budget_an_offload_past_the_host_room_stays_and_says_why():
    graphs = capture("gpt", **PLAN_OPTIONS, host_memory_limit=1)
    held = [d.held for _, d in graphs.storages if d.figures is not None and d.figures.hides]
    assert held and all(h is Held.HOST_MEMORY for h in held)
    assert not any(d.action is Action.OFFLOAD for _, d in graphs.storages)
