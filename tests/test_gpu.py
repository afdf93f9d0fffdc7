"""On a CUDA device: real copies on side streams, freed device memory, pooled pinned buffers."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from helpers import FP8_GRADIENT_ERROR, asking
from storm_compile import StormBackend, StormConfig, storm
from storm_compile.cli.models import GPTShape, build_gpt
from storm_compile.cost.simulate import device_bytes, simulate
from storm_compile.fx.graphs import StormGraphs
from storm_compile.fx.plan import Action
from storm_compile.runtime.streams import get_runtime

pytestmark = pytest.mark.gpu

SHAPE = GPTShape(d_model=256, layers=2, heads=4, seq=512, batch=4, dtype="bfloat16")
BF16_RTOL = 1e-2
"""Relative gradient-norm error accepted between two bf16 compiled runs (8 mantissa bits)."""
UNMODELLED = 0.15
"""How far the measured device peak may exceed a byte budget: storm bounds the peak it predicts
from what the graphs allocate, and the caching allocator's rounding and Inductor's temporaries
come on top (10 % on this model, H200: benchmarks/RESULTS.md)."""


def _step(backend, steps: int = 1):
    torch.manual_seed(0)
    model, (x,) = build_gpt(SHAPE, "cuda")
    run = torch.compile(model, backend=backend)
    base = torch.cuda.memory_allocated()
    for _ in range(steps):
        for p in (*model.parameters(), x):
            p.grad = None
        out = run(x)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - base
        out.float().pow(2).mean().backward()
    torch.cuda.synchronize()
    return held, {n: p.grad.float() for n, p in model.named_parameters()}


def _rel_error(grads, ref):
    return max(((grads[n] - ref[n]).norm() / ref[n].norm()).item() for n in ref)


def test_fp8_offloads_halve_the_host_bytes_and_keep_gradients_close():
    ref_held, ref_grads = _step("inductor")
    get_runtime().pool.clear()
    torch._dynamo.reset()
    _step(storm(min_offload_bytes=0, offload="all", recompute=False))
    exact = get_runtime().pool.reserved_bytes
    get_runtime().pool.clear()
    torch._dynamo.reset()
    held, grads = _step(storm(min_offload_bytes=0, offload="all", recompute=False,
                              offload_format="fp8"))
    assert get_runtime().pool.reserved_bytes < 0.6 * exact, (exact,)
    assert held < ref_held / 2, (held, ref_held)
    assert _rel_error(grads, ref_grads) < FP8_GRADIENT_ERROR


def test_storm_frees_device_memory_and_matches_compile():
    ref_held, ref_grads = _step("inductor")
    torch._dynamo.reset()
    held, grads = _step(storm(min_offload_bytes=0, offload="all"))
    assert held < ref_held / 2, (held, ref_held)
    assert _rel_error(grads, ref_grads) < BF16_RTOL


def test_eager_inner_is_bitwise_aot_eager_on_cuda():
    _, ref_grads = _step("aot_eager")
    torch._dynamo.reset()
    _, grads = _step(storm(inner="eager", min_offload_bytes=0, offload="all", recompute=False))
    for name in ref_grads:
        assert torch.equal(grads[name], ref_grads[name]), name


REPEATS = 8
"""Steps of one compiled model compared bit for bit: copies that race their readers or writers
land at other times from step to step."""


@pytest.mark.parametrize("options", [dict(offload="all"), dict(memory_budget=0.5)],
                         ids=["offload-all", "budget-0.5"])
def test_a_planned_step_gives_bitwise_the_same_gradients_at_every_step(options):
    """Offloads, prefetches and rebuilt values give the same gradients at every step of one
    compiled model: a copy read before it lands, or a buffer reused while a copy still reads
    or writes it, would change some of them from one step to the next. Attention runs through
    its math kernels, whose backward adds in one order (a fused kernel's may not)."""
    torch.manual_seed(0)
    model, (x,) = build_gpt(SHAPE, "cuda")
    planned: list[StormGraphs] = []
    config = StormConfig.from_options(min_offload_bytes=0, **options)
    run = torch.compile(model, backend=StormBackend(config, observer=planned.append))
    first = None
    with sdpa_kernel(SDPBackend.MATH):
        for _ in range(REPEATS):
            for p in model.parameters():
                p.grad = None
            run(x).float().pow(2).mean().backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            first = first or grads
            for name, grad in grads.items():
                assert torch.equal(grad, first[name]), name
    moved = [(*graphs.storages.with_action(Action.OFFLOAD), *graphs.plan.recomputed)
             for graphs in planned]
    assert any(moved), "the plan neither offloaded nor rebuilt a value"


def test_pinned_pool_does_not_grow_after_first_step():
    get_runtime().pool.clear()
    _step(storm(min_offload_bytes=0, offload="all", recompute=False), steps=1)
    reserved = get_runtime().pool.reserved_bytes
    assert reserved > 0
    torch._dynamo.reset()
    _step(storm(min_offload_bytes=0, offload="all", recompute=False), steps=3)
    assert get_runtime().pool.reserved_bytes == reserved


PINNING_LIMIT = 64 * 2**20
"""Room the plan sees on the host: more than the model's activations (about 35 MB)."""


def test_pinning_limit_keeps_tensors_on_device_with_one_warning():
    """The plan fits ``host_memory_limit``, but at run time the pool is full (another user
    holds its buffers): each offload keeps its tensor on the device, warned once."""
    _, ref_grads = _step("inductor")
    torch._dynamo.reset()
    pool = get_runtime().pool
    pool.clear()
    pooled = pool.acquire(PINNING_LIMIT, PINNING_LIMIT)
    assert pooled is not None
    blocker = pooled.view(-1)      # a second user of the buffer: the pool sees it busy
    del pooled
    with pytest.warns(RuntimeWarning, match="could not pin") as caught:
        _, grads = _step(storm(min_offload_bytes=0, offload="all", recompute=False,
                               host_memory_limit=PINNING_LIMIT), steps=2)
    del blocker
    pool.clear()
    assert len([w for w in caught if "could not pin" in str(w.message)]) == 1
    assert _rel_error(grads, ref_grads) < BF16_RTOL


@pytest.mark.parametrize("budget", [0.75, 0.5, 0.1])
def test_memory_budget_is_met_on_device(budget):
    _, ref_grads = _step("inductor")
    torch._dynamo.reset()
    captured = []
    config = StormConfig.from_options(memory_budget=budget, min_offload_bytes=0)
    held, grads = _step(StormBackend(config, observer=captured.append))
    assert held <= captured[0].plan.target_bytes, (held, captured[0].plan)
    assert _rel_error(grads, ref_grads) < BF16_RTOL


def _probe():
    """A backend planning at ``memory_budget=0.5``, and the list of each graph it plans with
    its predicted device peak (computed as the observer sees the graphs, before Inductor
    rewrites them)."""
    seen = []
    probe = StormBackend(StormConfig.from_options(memory_budget=0.5, min_offload_bytes=0),
                         observer=lambda g: seen.append((device_bytes(g, simulate(g, cost)), g)))
    cost = probe.ctx.cost
    return probe, seen


def _outside(model, *inputs) -> int:
    """Device memory the process holds besides the graph's inputs (cuBLAS's workspaces)."""
    torch.cuda.synchronize()
    held = sum(p.nbytes for p in model.parameters()) + sum(x.nbytes for x in inputs)
    return torch.cuda.memory_allocated() - held


def test_a_byte_budget_bounds_the_steps_device_peak():
    """A byte budget below the step's peak without storm (the peak storm predicts for half the
    activations): the step's device memory at its peak, inputs, activations, gradients and
    working set, stays within it and what storm does not model."""
    torch.manual_seed(0)
    model, (x,) = build_gpt(SHAPE, "cuda")

    def loss(x):
        return model(x).float().pow(2).mean()

    probe, seen = _probe()
    torch.compile(loss, backend=probe)(x).backward()
    budget, graphs = seen[0]
    assert budget < graphs.plan.baseline.peak_bytes + sum(
        p.nbytes for p in model.parameters()) + x.nbytes
    torch._dynamo.reset()
    run = torch.compile(loss, backend=storm(memory_budget=asking(budget), min_offload_bytes=0))
    for _ in range(2):                   # compile, and the allocator's first blocks
        model.zero_grad(set_to_none=True)
        run(x).backward()
    model.zero_grad(set_to_none=True)
    outside = _outside(model, x)
    torch.cuda.reset_peak_memory_stats()
    run(x).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - outside
    assert peak <= budget * (1 + UNMODELLED), (peak, budget)


def test_a_siamese_step_holds_a_byte_budget_on_device():
    """Two forwards before one backward under a byte budget of one run's peak and half its
    activations: from the second step the first run holds half, and the step's device peak
    stays within the budget."""
    torch.manual_seed(0)
    model, (x,) = build_gpt(SHAPE, "cuda")
    y = x.flip(0)
    probe, seen = _probe()
    torch.compile(model, backend=probe)(x).float().pow(2).mean().backward()
    _, graphs = seen[0]
    budget = graphs.share.fixed_bytes + graphs.plan.baseline.activation_bytes * 3 // 2
    torch._dynamo.reset()
    model.zero_grad()
    run = torch.compile(model, backend=storm(memory_budget=asking(budget), min_offload_bytes=0))
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        outside = _outside(model, x, y)
        torch.cuda.reset_peak_memory_stats()
        a, b = run(x), run(y)
        (a.float() - b.float()).pow(2).mean().backward()
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - outside
    grads = {n: p.grad.float() for n, p in model.named_parameters()}
    torch._dynamo.reset()
    model.zero_grad()
    reference = torch.compile(model, backend="inductor")
    (reference(x).float() - reference(y).float()).pow(2).mean().backward()
    eager_loss = 8 * a.nbytes            # a and b in float32, their difference, its square
    assert peak <= budget * (1 + UNMODELLED) + eager_loss, (peak, budget)
    assert _rel_error(grads, {n: p.grad.float() for n, p in model.named_parameters()}) \
        < BF16_RTOL