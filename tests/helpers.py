"""Shared test helpers: one training step under a backend, and graph capture."""

from __future__ import annotations

import torch
from torch import fx

from storm_compile.compiler.backend import StormBackend
from storm_compile.config import CPU_PLANNING, PEAK_MARGIN, MemoryBudget, StormConfig
from storm_compile.cost.cost_model import CostModel
from storm_compile.fx.graphs import COST_KEY, StormGraphs
from storm_compile.runtime import ops
from zoo import ZOO

CPU_TEST_OPTIONS = {**CPU_PLANNING, "inner": "eager", "min_offload_bytes": 0,
                    "profile": "cpu-test", "offload": "all", "recompute": False}
"""Offload every eligible activation of the tiny CPU models, running the graphs directly."""

FP8_GRADIENT_ERROR = 0.15
"""Largest relative error (norm of the difference over the norm) of a parameter gradient with
every activation offloaded in fp8 (``offload_format="fp8"``; the tiny Llama in float32: 0.065 run
eagerly, 0.088 compiled by Inductor on the CPU). fp8 keeps 3 mantissa bits, about 3 % of each saved value; a gradient sums
many of them."""

SEED = 0
STEP_SEED = 1


def asking(planned: int) -> str:
    """The byte ``memory_budget`` that storm plans as ``planned`` bytes
    (:attr:`MemoryBudget.planned`: the budget less its margin): a test that derives a budget
    from predicted bytes asks for this one."""
    asked = int(planned / (1 - PEAK_MARGIN))
    while MemoryBudget(nbytes=asked).planned.nbytes < planned:
        asked += 1
    return f"{asked}B"


def step(name: str, backend
         ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Build zoo model ``name`` (fixed seed), run one forward/backward through ``backend``
    (None for eager), and return the loss, every parameter gradient and every buffer."""
    torch.manual_seed(SEED)
    model, inputs, loss_fn = ZOO[name]()
    run = model if backend is None else torch.compile(model, backend=backend)
    torch.manual_seed(STEP_SEED)
    loss = loss_fn(run(*inputs))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    return loss.detach(), grads, buffers


def capture(name: str, cost_override=None, **options) -> StormGraphs:
    """The rewritten graphs of zoo model ``name`` under storm with ``options``."""
    captured: list[StormGraphs] = []
    config = StormConfig.from_options(**{**CPU_TEST_OPTIONS, **options})
    step(name, StormBackend(config, observer=captured.append, cost_override=cost_override))
    assert len(captured) == 1, f"{name}: expected one graph pair, got {len(captured)}"
    return captured[0]


def nodes(gm: fx.GraphModule, target) -> list[fx.Node]:
    return list(gm.graph.find_nodes(op="call_function", target=target))


def compute_between(gm: fx.GraphModule, first: fx.Node, last: fx.Node) -> int:
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return sum(1 for n in gm.graph.nodes
               if order[first] < order[n] < order[last]
               and COST_KEY in n.meta and n.meta[COST_KEY].is_compute)


def cost_model(**options) -> CostModel:
    return StormBackend(StormConfig.from_options(**{**CPU_TEST_OPTIONS, **options})).ctx.cost


def transfer_count(graphs: StormGraphs) -> int:
    return len(nodes(graphs.forward, ops.offload))


def streamed(model: torch.nn.Module) -> list[torch.Tensor]:
    """``model``'s parameters streamed from host memory."""
    return [p for p in model.parameters() if getattr(p, "storm_streamed", False)]


def unstreamed_name(name: str) -> str:
    """A streamed model's parameter name as the model had it before streaming."""
    return name.replace("parametrizations.", "").replace(".original", "")
