"""One budget for the whole step: the ledger's arithmetic, graph breaks, and DDP's pieces."""

import dataclasses
import os
import socket
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from helpers import CPU_TEST_OPTIONS, asking
from storm_compile import StormBackend, StormConfig, storm
from storm_compile.cli.models import GPTShape, build_gpt
from storm_compile.compiler import backend
from storm_compile.config import MemoryBudget
from storm_compile.cost.simulate import simulate
from storm_compile.passes import StormBudgetError
from storm_compile.planner.step_budget import (
    GraphId,
    GraphShare,
    RunRoom,
    StepBudget,
    StepView,
)
from storm_compile.weights.streaming import device_weights

PLAN_OPTIONS = {**CPU_TEST_OPTIONS, "offload": "hidden", "recompute": True}
FIRST, SECOND, SECOND_RECOMPILED = GraphId(0, 0, 0), GraphId(1, 0, 0), GraphId(1, 1, 0)
HALF = MemoryBudget(fraction=0.5)


def _bytes(nbytes: int) -> MemoryBudget:
    return MemoryBudget(nbytes=nbytes)


def _share(baseline: int, minimum: int, planned: int, step_s: float = 1.0,
           spent_s: float = 0.0) -> GraphShare:
    return GraphShare(baseline_bytes=baseline, minimum_bytes=minimum, planned_bytes=planned,
                      baseline_step_s=step_s, spent_s=spent_s)


def test_a_graph_too_small_for_its_share_leaves_the_rest_to_later_graphs():
    step = StepBudget()
    assert step.view(FIRST).target_bytes(HALF, baseline=100, minimum=90).nbytes == 90
    step.record(FIRST, _share(100, 90, 90))
    # The step so far must hold half of 100 + 1000: the second graph makes up the 40 over.
    assert step.view(SECOND).target_bytes(HALF, baseline=1000, minimum=0).nbytes == 550 - 90


def test_a_recompiled_frame_replaces_its_earlier_graphs():
    step = StepBudget()
    step.record(SECOND, _share(1000, 0, 1000))
    # Only the new compilation of frame 1 counts: the old one's 1000 bytes are gone.
    step.record(SECOND_RECOMPILED, _share(800, 0, 400))
    assert step.view(FIRST).target_bytes(HALF, baseline=200, minimum=0).nbytes == 100


def test_byte_budget_is_the_steps_total():
    step = StepBudget()
    assert step.view(FIRST).target_bytes(_bytes(500), baseline=300, minimum=10).nbytes == 300
    step.record(FIRST, _share(300, 10, 300))
    assert step.view(SECOND).target_bytes(_bytes(500), baseline=400, minimum=20).nbytes == 200


def test_infeasible_byte_budget_states_the_steps_minimum():
    step = StepBudget()
    step.record(FIRST, _share(300, 250, 300))
    with pytest.raises(StormBudgetError, match="at least 350 bytes"):
        step.view(SECOND).target_bytes(_bytes(300), baseline=400, minimum=100)


def test_byte_budget_taken_by_earlier_graphs_keeps_the_minimum_and_the_ledger_warns_once():
    step = StepBudget()
    step.record(FIRST, _share(300, 10, 300))
    target = step.view(SECOND).target_bytes(_bytes(320), baseline=400, minimum=100)
    assert (target.nbytes, target.over_bytes) == (100, 80)
    over = dataclasses.replace(_share(400, 100, 100), over_bytes=target.over_bytes)
    with pytest.warns(RuntimeWarning, match="over memory_budget") as caught:
        step.record(SECOND, over)
        step.record(SECOND, over)
    assert len(caught) == 1


def test_auto_allowance_is_shared_across_the_step():
    step = StepBudget()
    step.record(FIRST, _share(100, 0, 50, step_s=1.0, spent_s=0.005))
    assert step.view(SECOND).allowance_s(baseline_step_s=1.0, max_overhead=0.02) == \
        pytest.approx(0.02 * 2.0 - 0.005)


def _runs(step: StepBudget, graph: GraphId, count: int, budget: int = 100,
          planned_in: int = 0) -> tuple[list, list]:
    """``count`` runs of ``graph`` before a backward: the room each was given (None: the
    graph's own plan) and what releases each. A run planned again holds ``planned_in`` bytes of
    activations."""
    rooms, releases = [], []
    for _ in range(count):
        room = step.run_room(graph, budget)
        rooms.append(room)
        planned = step.share(graph).planned_bytes if room is None else planned_in
        releases.append(step.ran(graph, planned, measured=True))
    return rooms, releases


def _backward(releases: list) -> None:
    for release in releases:
        release()


def _peaked(share: GraphShare, fixed: int) -> GraphShare:
    """``share`` of a plan that holds ``fixed`` bytes besides activations, at its peak."""
    return dataclasses.replace(share, fixed_bytes=fixed, peak_bytes=fixed + share.planned_bytes)


def test_a_run_the_step_shows_first_is_planned_at_its_minimum_beside_what_is_held():
    step = StepBudget()
    step.record(FIRST, _peaked(_share(100, 10, 60), fixed=20))
    rooms, releases = _runs(step, FIRST, 3, planned_in=10)
    # Its own plan serves the first run; the next are planned at the graph's minimum (more
    # runs may follow), their peak checked against what the held runs leave (a plan over it is
    # kept with a warning: the room is not a known run's).
    assert rooms == [None, RunRoom(40, 30, known=False), RunRoom(30, 30, known=False)]
    _backward(releases)


def test_once_a_step_showed_its_runs_the_last_keeps_room_for_its_least_peak():
    step = StepBudget()
    step.record(FIRST, _peaked(_share(100, 10, 60), fixed=20))
    _backward(_runs(step, FIRST, 2, planned_in=10)[1])
    # The last run's backward runs beside the first run's activations: it keeps room for the
    # least peak a plan of the graph reached (its own plan's, 80), so the first may hold 20.
    rooms, releases = _runs(step, FIRST, 2, planned_in=20)
    assert rooms == [RunRoom(100, 40, known=True), None]
    _backward(releases)
    step.saw_peak(FIRST, 50)             # a plan of a run peaked lower: the first may hold 50
    assert _runs(step, FIRST, 2, planned_in=50)[0] == [RunRoom(100, 70, known=True),
                                                       RunRoom(50, 50, known=True)]


def test_runs_that_fit_their_plan_are_not_planned_again():
    step = StepBudget()
    step.record(FIRST, _peaked(_share(100, 10, 30), fixed=20))
    _backward(_runs(step, FIRST, 2, planned_in=30)[1])
    assert _runs(step, FIRST, 2)[0] == [None, None]


def test_runs_that_cannot_fit_at_their_minimum_are_an_error_once_known():
    step = StepBudget()
    step.record(FIRST, _peaked(_share(100, 45, 60), fixed=20))
    _backward(_runs(step, FIRST, 2, planned_in=45)[1])
    with pytest.raises(StormBudgetError, match="runs 2 times before the backward: the last "
                                               "run's backward.* needs 125 bytes"):
        step.run_room(FIRST, 100)


def test_the_other_graphs_plans_come_first():
    step = StepBudget()
    step.record(FIRST, _peaked(_share(100, 10, 40), fixed=10))
    step.record(SECOND, _peaked(_share(100, 0, 30), fixed=10))
    _backward([*_runs(step, SECOND, 1)[1], *_runs(step, FIRST, 2, planned_in=10)[1]])
    _runs(step, SECOND, 1)
    # The second graph holds 30, and the last run keeps 50 for its peak: the first may hold 20.
    assert _runs(step, FIRST, 2, planned_in=20)[0] == [RunRoom(70, 30, known=True), None]


def test_a_streamed_graphs_resident_weights_are_its_plans_own():
    step = StepBudget()
    step.record(FIRST, dataclasses.replace(_peaked(_share(100, 5, 50), fixed=20),
                                           resident_bytes=30))
    # Its resident weights are in its plans' peaks (and in fixed_bytes), never counted twice.
    assert _runs(step, FIRST, 2, planned_in=20)[0] == [None, RunRoom(50, 25, known=False)]


def test_a_run_released_by_its_backward_no_longer_counts():
    step = StepBudget()
    step.record(FIRST, _peaked(_share(100, 0, 60), fixed=20))
    rooms, releases = _runs(step, FIRST, 1)
    releases[0]()
    releases[0]()                        # its backward started and its graph is gone: once
    _backward(_runs(step, FIRST, 1)[1])
    # Gradient accumulation, one run per backward: its own plan, every time.
    assert _runs(step, FIRST, 1)[0] == [None]


BLOCKS_SHAPE = GPTShape(d_model=64, layers=4, heads=4, seq=32, batch=2, dtype="float32")


def _blocks_compiled_one_by_one(budget) -> tuple[nn.Module, torch.Tensor, list]:
    """torchtitan's way: each block compiled on its own, so all four run one graph."""
    torch.manual_seed(0)
    model, (x,) = build_gpt(BLOCKS_SHAPE)
    captured = []
    backend = StormBackend(StormConfig.from_options(**{**PLAN_OPTIONS, "memory_budget": budget}),
                           observer=captured.append)
    for block in model.blocks:
        block.compile(backend=backend)
    return model, x, captured


def _block_graph_bytes() -> tuple[int, int, int, int]:
    """One block's graph: its activation memory without storm, what its device peak holds
    besides them (a byte budget bounds the peak), its least activation memory, and its inputs
    (each block's run passes its own weights and hidden state)."""
    model, x, captured = _blocks_compiled_one_by_one(0.25)
    model(x).sum().backward()
    assert len(captured) == 1
    graphs = captured[0]
    return (graphs.plan.baseline.activation_bytes, graphs.share.fixed_bytes,
            graphs.plan.minimum_bytes, device_weights(graphs.forward, 0).nbytes)


def test_a_byte_budget_over_a_block_graph_run_by_every_block_is_shared_by_its_runs():
    per_block, fixed, minimum, inputs = _block_graph_bytes()
    torch.manual_seed(0)
    reference, (x,) = build_gpt(BLOCKS_SHAPE)
    # Room for one run's peak and the others at their minimum, with their own weights: the
    # first step shows the four runs (those past the first planned at their minimum, over what
    # is left), the second measures the weights each run adds, and from the third the last run
    # keeps room for its least peak and the first three share the rest.
    budget = fixed + per_block + (BLOCKS_SHAPE.layers - 1) * (minimum + inputs)
    model, x, captured = _blocks_compiled_one_by_one(asking(budget))
    with pytest.warns(RuntimeWarning, match="ran again before the backward"):
        model(x).sum().backward()
    with warnings.catch_warnings(record=True):
        model.zero_grad()
        model(x).sum().backward()
    for _ in range(2):
        model.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model(x).sum().backward()
    assert captured[1].plan.target_bytes == minimum
    shared = captured[-1]
    assert minimum <= shared.plan.target_bytes < per_block
    reference(x).sum().backward()
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, ref.grad, msg=name)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(),
                         nn.Linear(512, 64))


def _mlp_graph_bytes() -> tuple[int, int, int]:
    """Activation memory of :func:`_mlp`'s graph without storm, what its device peak holds
    besides them (its least peak is its peak without storm: the weights' gradients), and its
    inputs."""
    captured, _ = _captured_step(_mlp(), [torch.randn(64, 64)], memory_budget=0.5)
    graphs = captured[0]
    return (graphs.plan.baseline.activation_bytes, graphs.share.fixed_bytes,
            device_weights(graphs.forward, 0).nbytes)


def _assert_grads_equal(model: nn.Module, reference: nn.Module) -> None:
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, ref.grad, msg=name)
        param.grad, ref.grad = None, None


def test_a_siamese_step_shares_a_byte_budget_between_its_two_forwards():
    activations, fixed, _ = _mlp_graph_bytes()
    batch = 64 * 64 * 4                  # the second run's input, held beside the first's
    # One run's peak and half its activations: the second run's backward runs beside the first
    # run's activations.
    budget = fixed + activations + activations // 2 + batch
    model, reference = _mlp(), _mlp()
    captured = []
    backend = StormBackend(StormConfig.from_options(
        **{**PLAN_OPTIONS, "memory_budget": asking(budget)}), observer=captured.append)
    run = torch.compile(model, backend=backend)
    torch.manual_seed(1)
    for step in range(3):
        a, b = torch.randn(64, 64), torch.randn(64, 64)
        with warnings.catch_warnings():
            if step:
                warnings.simplefilter("error")
            (run(a) - run(b)).pow(2).mean().backward()
        (reference(a) - reference(b)).pow(2).mean().backward()
        _assert_grads_equal(model, reference)
    # The first step planned the second run at its minimum; once the step has measured the
    # second run's input, the first run is planned for what the second run's peak leaves: half
    # the activations.
    assert captured[1].plan.target_bytes == captured[0].plan.minimum_bytes
    assert captured[-1].plan.target_bytes == activations // 2
    assert captured[-1].share.planned_bytes <= activations // 2


def test_a_gan_step_shares_a_byte_budget_between_its_graphs_and_its_runs():
    generator, discriminator = _mlp(), _mlp()
    references = _mlp(), _mlp()
    activations, fixed, inputs = _mlp_graph_bytes()
    # The two nets are one graph (the same code, weights as inputs) run twice, then once more
    # for the generated batch: both nets' weights, one run's peak, and room for the other
    # runs' activations.
    budget = fixed + inputs + 2 * activations + activations // 2
    backend = storm(**PLAN_OPTIONS, memory_budget=asking(budget))
    compiled = torch.compile(generator, backend=backend), torch.compile(discriminator,
                                                                       backend=backend)
    torch.manual_seed(1)
    for step in range(3):
        z, real = torch.randn(64, 64), torch.randn(64, 64)
        for make, judge in (compiled, references):
            with warnings.catch_warnings():
                if step:
                    warnings.simplefilter("error")
                (judge(real).mean() - judge(make(z)).mean()).backward()
        _assert_grads_equal(generator, references[0])
        _assert_grads_equal(discriminator, references[1])


def test_a_validation_loss_kept_with_grad_enabled_trains_within_a_byte_budget():
    model, reference = _mlp(), _mlp()
    run = torch.compile(model, backend=storm(
        **PLAN_OPTIONS, memory_budget=asking(sum(_mlp_graph_bytes()[:2]))))
    torch.manual_seed(1)
    validation = torch.randn(64, 64)
    kept = run(validation).pow(2).mean()                 # its autograd graph lives on
    for _ in range(2):
        x = torch.randn(64, 64)
        run(x).pow(2).mean().backward()
        reference(x).pow(2).mean().backward()
        _assert_grads_equal(model, reference)
    assert kept.grad_fn is not None


def test_a_fraction_budget_over_a_block_graph_holds_for_every_run():
    model, x, captured = _blocks_compiled_one_by_one(0.5)
    for _ in range(2):                   # a second step: the runs start again
        model(x).sum().backward()
    assert len(captured) == 1 and captured[0].plan.recompute


def test_runs_whose_outputs_are_dropped_unused_release_their_share():
    per_block, fixed, minimum, inputs = _block_graph_bytes()
    model, x, captured = _blocks_compiled_one_by_one(asking(fixed + per_block + minimum + inputs))
    block = model.blocks[0]
    for _ in range(3):
        block(x)                         # each run's autograd graph is freed at once
    kept = [block(x)]
    assert len(captured) == 1            # one run held: its own plan
    kept.append(block(x))
    assert len(captured) == 2            # a second: planned again, at its minimum
    assert captured[-1].plan.target_bytes == captured[0].plan.minimum_bytes


def test_a_byte_budget_with_room_for_every_run_trains():
    per_block, fixed, _, inputs = _block_graph_bytes()
    layers = BLOCKS_SHAPE.layers
    budget = fixed + layers * per_block + (layers - 1) * inputs
    model, x, _ = _blocks_compiled_one_by_one(asking(budget))
    for _ in range(2):
        model(x).sum().backward()


class BrokenMLP(nn.Module):
    """A small graph, a graph break, then a large one: the first cannot reach half."""

    def __init__(self) -> None:
        super().__init__()
        self.small = nn.Linear(16, 16)
        self.large = nn.Sequential(nn.Linear(16, 512), nn.GELU(), nn.Linear(512, 512),
                                   nn.GELU(), nn.Linear(512, 16))

    def forward(self, x):
        h = torch.tanh(self.small(x))
        torch._dynamo.graph_break()
        return self.large(h)


def _captured_step(model, inputs, **options):
    captured = []
    backend = StormBackend(StormConfig.from_options(**{**PLAN_OPTIONS, **options}),
                           observer=captured.append)
    torch.compile(model, backend=backend)(*inputs).pow(2).mean().backward()
    return captured, backend


def _step_activation(captured, backend) -> tuple[int, int]:
    baseline = sum(g.plan.baseline.activation_bytes for g in captured)
    planned = sum(simulate(g, backend.ctx.cost).activation_bytes for g in captured)
    return baseline, planned


def test_fraction_budget_holds_over_graph_breaks():
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        captured, backend = _captured_step(BrokenMLP(), (torch.randn(64, 16),),
                                           memory_budget=0.5)
    assert not [w for w in seen if "DDP gradient bucket" in str(w.message)], \
        "a graph break resumes in a new frame: no split to warn of"
    assert len(captured) == 2
    baseline, planned = _step_activation(captured, backend)
    assert planned <= 0.5 * baseline
    small = captured[0].plan
    assert small.target_bytes == small.minimum_bytes > 0.5 * small.baseline.activation_bytes


def test_a_graph_whose_peak_the_earlier_graphs_left_no_room_for_warns_and_trains():
    """A byte budget the second graph's peak fits alone, planned after the first graph kept all
    its activations: the second keeps its least plan, and storm says why."""
    torch.manual_seed(0)
    captured, _ = _captured_step(BrokenMLP(), (torch.randn(64, 16),), memory_budget=0.5)
    large = captured[1]
    budget = large.share.fixed_bytes + large.plan.baseline.activation_bytes
    torch.manual_seed(0)
    with pytest.warns(RuntimeWarning, match="compiled before this one .* took the room"):
        _captured_step(BrokenMLP(), (torch.randn(64, 16),), memory_budget=asking(budget))


def test_a_graph_planned_in_a_later_step_takes_the_place_of_the_one_run_there():
    """Once a step has finished, a new graph is planned beside the graphs the step ran before
    it and those the last step ran after the point it takes, not beside the one it replaces."""
    step, other_side = StepBudget(), GraphId(2, 0, 0)
    step.record(FIRST, _share(300, 300, 300))
    step.record(SECOND, _share(400, 400, 400))
    view = step.view(other_side)
    assert sorted(s.planned_bytes for s in view.others) == [300, 400], "no step has finished"
    for release in [step.ran(FIRST, 0), step.ran(SECOND, 0)]:
        release()
    step.ran(FIRST, 0)
    assert [s.planned_bytes for s in step.view(other_side).others] == [300]
    assert step.view(other_side).target_bytes(_bytes(800), baseline=500,
                                              minimum=450).nbytes == 500


class Branches(nn.Module):
    """A data-dependent branch: dynamo compiles the code after it once per side, as two
    frames, and the sides alternate between steps."""

    def __init__(self) -> None:
        super().__init__()
        self.before = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256))
        self.one = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256))
        self.other = nn.Sequential(nn.Linear(256, 512), nn.Tanh(), nn.Linear(512, 256))

    def forward(self, x: torch.Tensor, side: torch.Tensor) -> torch.Tensor:
        h = self.before(x)
        h = self.one(h) if side > 0 else self.other(h)
        return h.pow(2).mean()


BRANCH_BUDGET = "8MB"
"""Above the peak of one side's backward beside the activations of the part before the branch
(about 7.3 MB, every activation kept: ``min_offload_bytes`` above them all), below that peak
beside both (about 10 MB)."""


def test_sides_of_a_branch_never_share_a_byte_budget():
    torch.manual_seed(0)
    model = Branches()
    run = torch.compile(model, backend=storm(**{
        **CPU_TEST_OPTIONS, "offload": "hidden", "memory_budget": BRANCH_BUDGET,
        "min_offload_bytes": 10**8}))
    x = torch.randn(512, 256)
    for side in (1, -1, 1, -1):
        run(x, torch.tensor(side)).backward()


def test_byte_budget_below_the_steps_minimum_is_the_only_budget_error():
    torch.manual_seed(0)
    with pytest.raises(Exception) as caught:
        _captured_step(BrokenMLP(), (torch.randn(64, 16),), memory_budget="1B")
    error = getattr(caught.value, "inner_exception", caught.value)
    assert isinstance(error, StormBudgetError)
    assert "minimum feasible for the step" in str(error)


def test_cpu_model_with_a_budget_compiles_unchanged():
    torch.manual_seed(0)
    captured, _ = _captured_step(BrokenMLP(), (torch.randn(64, 16),),
                                 transfer_cpu_tensors=False, memory_budget="1B")
    for graphs in captured:
        assert graphs.plan.target_bytes is None and not graphs.plan.recompute


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def single_rank_group():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


DDP_SHAPE = GPTShape(d_model=128, layers=6, heads=4, seq=32, batch=2, dtype="float32")
DDP_BUCKET_MB = 1
"""DDPOptimizer's first bucket is 1 MB; with 1 MB buckets the 6-block model splits into several
pieces, each compiled by storm."""


@pytest.mark.parametrize("budget", [0.5, "auto"])
def test_ddp_pieces_share_one_budget(single_rank_group, budget):
    torch.manual_seed(0)
    model, inputs = build_gpt(DDP_SHAPE)
    ddp = DistributedDataParallel(model, bucket_cap_mb=DDP_BUCKET_MB)
    with pytest.warns(RuntimeWarning, match="optimize_ddp = 'python_reducer'") as caught:
        captured, backend = _captured_step(ddp, inputs, memory_budget=budget)
    assert len([w for w in caught if "DDP gradient bucket" in str(w.message)]) == 1
    assert len(captured) > 2, "DDPOptimizer did not split the model"
    baseline, planned = _step_activation(captured, backend)
    if budget == "auto":
        assert planned < baseline
    else:
        assert planned <= budget * baseline


def test_host_room_is_the_limit_less_the_other_graphs_offloads():
    step = StepBudget()
    step.record(FIRST, dataclasses.replace(_share(100, 0, 50), host_bytes=30))
    assert step.view(SECOND).host_room(100) == 70
    step.record(SECOND, dataclasses.replace(_share(100, 0, 50), host_bytes=60))
    assert step.view(FIRST).host_room(100) == 40
    assert step.view(SECOND).host_room(100) == 70


def test_the_passes_return_the_graphs_share_and_only_the_pipeline_records_it():
    """The passes see the step as a frozen :class:`StepView` (no field of the pass context is
    the ledger) and return the graph's share; the ledger holds exactly that share."""
    torch.manual_seed(0)
    model, (x,) = build_gpt(BLOCKS_SHAPE)
    captured = []
    backend = StormBackend(StormConfig.from_options(**{**PLAN_OPTIONS, "memory_budget": 0.5}),
                           observer=captured.append)
    torch.compile(model, backend=backend)(x).sum().backward()
    (graphs,) = captured
    assert graphs.share is not None and graphs.share.planned_bytes < graphs.share.baseline_bytes
    assert backend.step.share(backend.step.last) == graphs.share
    assert isinstance(backend.ctx.others, StepView)
    assert not any(isinstance(getattr(backend.ctx, f.name), StepBudget)
                   for f in dataclasses.fields(backend.ctx))


def test_a_run_no_plan_fits_is_the_steps_budget_error():
    def replan(room: RunRoom):
        raise StormBudgetError(f"the least predicted peak is {room.peak_bytes + 1} bytes")

    with pytest.raises(StormBudgetError, match="memory_budget leaves the step 100 bytes .* runs "
                                               "again before the backward: beside the 40 bytes"
                                               ".* least predicted peak is 61 bytes"):
        backend._replanned(replan, RunRoom(60, 60, known=True), 100)


def test_a_run_holds_the_device_inputs_the_earlier_runs_did_not_pass():
    seen: set[int] = set()
    device = "cuda" if torch.cuda.is_available() else "cpu"      # host tensors: streamed
    weights, batch, other = (torch.zeros(n, device=device) for n in (256, 64, 32))
    assert backend._new_inputs([weights, batch, 3], seen, first=True) == 0
    # A second run of the graph: the same weights, another batch (and a view of it).
    assert backend._new_inputs([weights, other, other[:8]], seen, first=False) == other.nbytes
    assert backend._new_inputs([weights, other], seen, first=False) == 0
    assert backend._new_inputs([other], seen, first=True) == 0 and seen == {
        other.untyped_storage().data_ptr()}
