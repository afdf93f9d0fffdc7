"""The model zoo (``benchmarks/model_zoo.py``) through storm: one training step of every model
under every storm configuration gives aot_eager's loss, gradients and buffers, and with
``offload="all"`` storm moves something out of every model.

On the CPU (tiny sizes, fp32) the whole pipeline runs with ``transfer_cpu_tensors`` and the
graphs run directly (``inner="eager"``), so storm's plan is exercised as on a GPU. The ``gpu``
tests run the same models in bf16 with Inductor as the inner compiler, against
``torch.compile``.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch._inductor.config as inductor_config

from benchmarks import model_zoo
from storm_compile.compiler.backend import StormBackend
from storm_compile.config import StormConfig
from storm_compile.fx.graphs import StormGraphs
from storm_compile.runtime import ops

MODELS = model_zoo.ZOO_NAMES
CPU_OPTIONS = {"transfer_cpu_tensors": True, "inner": "eager", "profile": "cpu-test",
               "min_offload_bytes": 0}
"""Run storm's whole pipeline on the CPU and plan every activation, however small."""
CONFIGS: dict[str, dict] = {
    "defaults": {},
    "budget-0.75": {"memory_budget": 0.75},
    "budget-0.25": {"memory_budget": 0.25},
    "budget-auto": {"memory_budget": "auto"},
    "offload-all": {"offload": "all"},
}
MODEL_SEED = 0
"""Seed before ``model_zoo.build``: both compared models get the same weights."""
STEP_SEED = 1
"""Seed before the step: dropout draws the same numbers in both runs."""
RTOL = 1e-5
ATOL = 1e-6
"""fp32: the same ops on the same values, except that recomputation may round the last bits
differently."""

GPU_CONFIGS: dict[str, dict] = {
    "defaults": {"min_offload_bytes": 0},
    "budget-0.5": {"memory_budget": 0.5, "min_offload_bytes": 0},
}
"""Inner Inductor. The tiny models' activations are all below the default
``min_offload_bytes``; planning every one of them makes storm move them as on a large model."""
BF16_NOISE_RATIO = 1.5
"""bf16 fidelity is judged against a float32 eager step of the same weights: storm's largest
gradient error there may exceed Inductor's (two bf16 compiled runs round differently, the more
so in conv nets with normalisation, where two Inductor runs already differ by a few percent)
by at most half. A stale or missing activation gives errors of order one."""
LOSS_ROUNDING = 2 ** -8
"""One bf16 rounding step, relative: the loss bound's floor where Inductor's own loss happens
to land next to the float32 one."""


@dataclasses.dataclass
class Step:
    loss: torch.Tensor
    grads: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]


def _step(name: str, backend, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Step:
    """One forward and backward of zoo model ``name`` (tiny) compiled with ``backend`` (None:
    eager)."""
    torch.manual_seed(MODEL_SEED)
    case = model_zoo.build(name, "tiny", device=device, dtype=dtype)
    run = case.model if backend is None else torch.compile(case.model, backend=backend)
    torch.manual_seed(STEP_SEED)
    loss = case.loss(run(*case.inputs))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in case.model.named_parameters()
             if p.grad is not None}
    buffers = {n: b.detach().clone() for n, b in case.model.named_buffers()}
    torch._dynamo.reset()
    return Step(loss.detach(), grads, buffers)


@functools.cache
def _reference(name: str) -> Step:
    return _step(name, "aot_eager")


@functools.cache
def _storm(name: str, config: str) -> tuple[Step, list[StormGraphs]]:
    """One step under storm with ``CONFIGS[config]``, and the graphs of every compiled region
    (the offload test reads the run the numerics test made)."""
    captured: list[StormGraphs] = []
    options = {**CPU_OPTIONS, **CONFIGS[config]}
    backend = StormBackend(StormConfig.from_options(**options), observer=captured.append)
    return _step(name, backend), captured


def _assert_same(step: Step, ref: Step, **tolerance) -> None:
    torch.testing.assert_close(step.loss, ref.loss, **tolerance)
    assert step.grads.keys() == ref.grads.keys()
    for key, grad in ref.grads.items():
        torch.testing.assert_close(step.grads[key], grad, msg=f"gradient of {key}", **tolerance)
    assert step.buffers.keys() == ref.buffers.keys()
    for key, buffer in ref.buffers.items():
        torch.testing.assert_close(step.buffers[key], buffer, msg=f"buffer {key}", **tolerance)


@pytest.mark.parametrize("name", MODELS)
def test_aot_eager_matches_eager(name):
    """The reference itself: every model compiles and trains as in eager mode."""
    _assert_same(_reference(name), _step(name, None), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("name", MODELS)
def test_storm_matches_aot_eager(name, config):
    _assert_same(_storm(name, config)[0], _reference(name), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", MODELS)
def test_offload_all_moves_something(name):
    graphs = _storm(name, "offload-all")[1]
    assert graphs, f"{name}: storm compiled no region"
    offloads = sum(len(g.forward.graph.find_nodes(op="call_function", target=ops.offload))
                   for g in graphs)
    recomputed = sum(len(g.plan.recompute) for g in graphs if g.plan is not None)
    assert offloads + recomputed > 0, f"{name}: nothing offloaded or recomputed in " \
                                      f"{len(graphs)} regions"


def _rel_error(grad: torch.Tensor, ref: torch.Tensor) -> float:
    return ((grad.float() - ref.float()).norm() / ref.float().norm()).item()


@functools.cache
def _float32_on_gpu(name: str) -> Step:
    return _step(name, None, device="cuda", dtype=torch.float32)


def _largest_error(step: Step, ref: Step) -> float:
    assert step.grads.keys() == ref.grads.keys()
    return max(_rel_error(grad, ref.grads[key]) for key, grad in step.grads.items())


@pytest.mark.gpu
@pytest.mark.parametrize("config", GPU_CONFIGS)
@pytest.mark.parametrize("name", MODELS)
def test_storm_matches_inductor_on_gpu(name, config):
    exact = _float32_on_gpu(name)
    with inductor_config.patch(fallback_random=True):
        ref = _step(name, "inductor", device="cuda", dtype=torch.bfloat16)
        step = _step(name, StormBackend(StormConfig.from_options(**GPU_CONFIGS[config])),
                     device="cuda", dtype=torch.bfloat16)
    loss_noise = abs(ref.loss.float() - exact.loss)
    assert abs(step.loss.float() - exact.loss) <= BF16_NOISE_RATIO * loss_noise + \
        LOSS_ROUNDING * abs(exact.loss)
    assert _largest_error(step, exact) <= BF16_NOISE_RATIO * _largest_error(ref, exact)
