"""Graphs people actually compile: symbolic sizes, multi-output ops, checkpointed blocks."""

import importlib
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from helpers import CPU_TEST_OPTIONS, nodes
from storm_compile import StormBackend, StormConfig
from storm_compile.cli.models import GPTShape, build_gpt
from storm_compile.fx.plan import Rule
from storm_compile.runtime import ops
from storm_compile.runtime.streams import BUCKETS_PER_DOUBLING, bucket_bytes

PLAN_OPTIONS = {**CPU_TEST_OPTIONS, "offload": "hidden", "recompute": True}
LENGTHS = (24, 40, 32)
"""Sequence lengths of successive steps, as dynamic padding gives them."""
SHAPE = GPTShape(d_model=64, layers=2, heads=4, seq=32, batch=2, dtype="float32")


def _grads(model: nn.Module) -> list[torch.Tensor]:
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return grads


def _compare_steps(model, backend, mark_dynamic: bool = False, **compile_options):
    """Run each length through storm and aot_eager; gradients must agree at every one."""
    run = torch.compile(model, backend=backend, **compile_options)
    reference = torch.compile(model, backend="aot_eager", **compile_options)
    for length in LENGTHS:
        x = torch.randn(SHAPE.batch, length, SHAPE.d_model)
        if mark_dynamic:
            torch._dynamo.mark_dynamic(x, 1)
        run(x).pow(2).mean().backward()
        storm_grads = _grads(model)
        reference(x).pow(2).mean().backward()
        for ours, theirs in zip(storm_grads, _grads(model)):
            torch.testing.assert_close(ours, theirs)


def _backend(captured: list, **options) -> StormBackend:
    return StormBackend(StormConfig.from_options(**{**PLAN_OPTIONS, **options}),
                        observer=captured.append)


@pytest.mark.parametrize("compile_options", [{}, {"dynamic": True}, {"mark_dynamic": True}],
                         ids=["recompile", "dynamic", "mark_dynamic"])
@pytest.mark.parametrize("options", [{"offload": "all", "recompute": False},
                                     {"memory_budget": 0.3}], ids=["offload-all", "budget"])
def test_variable_lengths_keep_every_gradient(compile_options, options):
    torch.manual_seed(0)
    model, _ = build_gpt(SHAPE)
    captured = []
    _compare_steps(model, _backend(captured, **options), **compile_options)
    symbolic = [g for g in captured
                if any(isinstance(n.meta.get("val"), torch.SymInt)
                       for n in g.forward.graph.find_nodes(op="placeholder"))]
    assert symbolic, "no graph was compiled with symbolic sizes"
    for graphs in symbolic:
        moved = nodes(graphs.forward, ops.offload) or graphs.plan.recompute
        assert moved, "storm planned nothing on a graph with symbolic sizes"


def test_symbolic_graphs_offload_their_views():
    """q, k and v are views with symbolic sizes: they cross the link as their storage."""
    torch.manual_seed(0)
    model, _ = build_gpt(SHAPE)
    captured = []
    _compare_steps(model, _backend(captured, offload="all", recompute=False), dynamic=True)
    (graphs,) = captured
    rules = [s.eligibility.rule for s in graphs.storages.storages]
    assert Rule.VIEW_DEPENDS not in rules, rules


class MultiOutputBlock(nn.Module):
    """``unbind`` (a view with several outputs), ``topk`` and ``native_layer_norm`` (ops with
    several outputs) feeding the backward."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.router = nn.Linear(dim, dim)

    def forward(self, x):
        batch, tokens, dim = x.shape
        qkv = self.qkv(self.norm(x)).reshape(batch, tokens, 3, self.heads, -1)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        attn = F.scaled_dot_product_attention(q, k, v)
        x = x + self.out(attn.transpose(1, 2).reshape(batch, tokens, dim))
        values, _ = self.router(self.norm(x)).topk(8, dim=-1)
        return x + values.sum(-1, keepdim=True)


@pytest.mark.parametrize("budget", [0.5, 0.25, 0.1])
def test_multi_output_ops_are_recomputed_whole(budget):
    torch.manual_seed(0)
    model = nn.Sequential(MultiOutputBlock(), MultiOutputBlock())
    x = torch.randn(2, 16, 64)
    captured = []
    torch.compile(model, backend=_backend(captured, memory_budget=budget))(x).sum().backward()
    storm_grads = _grads(model)
    torch.compile(model, backend="aot_eager")(x).sum().backward()
    for ours, theirs in zip(storm_grads, _grads(model)):
        torch.testing.assert_close(ours, theirs)
    (graphs,) = captured
    assert graphs.plan.recompute, "the budget was met without recomputing anything"
    joint = {n.name: n for n in graphs.joint.module.graph.nodes}
    for name in graphs.plan.recompute:
        node = joint[name]
        if isinstance(node.meta.get("val"), (tuple, list)):
            items = {user.name for user in node.users}
            assert items <= set(graphs.plan.recompute), f"{name} recomputed in part"


def test_rejected_recompute_falls_back_to_offloads_with_one_warning(monkeypatch):
    module = importlib.import_module("storm_compile.passes.rematerialize")

    def reject(added, inputs):
        raise module.RecomputeRejectedError("a symbolic size the backward lacks (test)")

    monkeypatch.setattr(module, "_check_symbols", reject)
    torch.manual_seed(0)
    model, (x,) = build_gpt(SHAPE)
    captured = []
    with pytest.warns(RuntimeWarning, match="without recomputation") as caught:
        torch.compile(model, backend=_backend(captured, memory_budget=0.25))(x).sum().backward()
    assert len([w for w in caught if "without recomputation" in str(w.message)]) == 1
    storm_grads = _grads(model)
    torch.compile(model, backend="aot_eager")(x).sum().backward()
    for ours, theirs in zip(storm_grads, _grads(model)):
        torch.testing.assert_close(ours, theirs)
    (graphs,) = captured
    assert not graphs.plan.recompute and nodes(graphs.forward, ops.offload)


class Checkpointed(nn.Module):
    """The built-in blocks, each under non-reentrant ``torch.utils.checkpoint``, with dropout
    so the partitioner's RNG-state handling is in the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt, _ = build_gpt(SHAPE)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        for block in self.gpt.blocks:
            x = checkpoint(lambda h, b=block: self.drop(b(h)), x, use_reentrant=False)
        return x


@pytest.mark.parametrize("options", [{}, {"memory_budget": 0.5}, {"offload": "all"}],
                         ids=["defaults", "budget", "offload-all"])
def test_checkpointed_blocks_plan_around_the_checkpoints(options):
    torch.manual_seed(0)
    model = Checkpointed().train()
    x = torch.randn(SHAPE.batch, SHAPE.seq, SHAPE.d_model)
    torch.manual_seed(1)
    torch.compile(model, backend=_backend([], **options))(x).pow(2).mean().backward()
    storm_grads = _grads(model)
    torch.manual_seed(1)
    torch.compile(model, backend="aot_eager")(x).pow(2).mean().backward()
    for ours, theirs in zip(storm_grads, _grads(model)):
        torch.testing.assert_close(ours, theirs)


def test_pool_buckets_waste_at_most_an_eighth():
    for nbytes in (*range(1, 4096), 1 << 20, (1 << 20) + 1, 3_000_000, (5 << 30) + 12345):
        size = bucket_bytes(nbytes)
        assert nbytes <= size <= nbytes * (1 + 1 / BUCKETS_PER_DOUBLING)
    lengths = range(700, 1100)
    assert len({bucket_bytes(2 * length * 4096 * 2) for length in lengths}) <= \
        2 * BUCKETS_PER_DOUBLING


@pytest.mark.parametrize("options, pinned", [
    ({"min_offload_bytes": 1 << 40}, [False, False]),
    ({"offload": "all", "recompute": False}, [True, True]),
], ids=["unchanged", "rewritten"])
def test_peak_memory_reordering_stays_on(monkeypatch, options, pinned):
    """Inductor reorders every graph for peak memory; only graphs with transfers also run
    pin_transfers after it."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    from storm_compile.compiler import backend
    from storm_compile.compiler.pin_transfers import pin_transfers

    seen = []
    compile_graph = backend.compile_fx_inner

    def spy(gm, example_inputs, **kwargs):
        seen.append((inductor_config.reorder_for_peak_memory,
                     inductor_config.reorder_for_compute_comm_overlap and
                     pin_transfers in inductor_config.reorder_for_compute_comm_overlap_passes))
        return compile_graph(gm, example_inputs, **kwargs)

    monkeypatch.setattr(backend, "compile_fx_inner", spy)
    torch.manual_seed(0)
    model, (x,) = build_gpt(SHAPE)
    config = {**PLAN_OPTIONS, "inner": "inductor", **options}
    with inductor_config.patch(fx_graph_cache=False), \
            functorch_config.patch(enable_autograd_cache=False):  # Inductor must compile
        torch.compile(model, backend=StormBackend(StormConfig.from_options(**config)))(x).sum() \
            .backward()
    assert seen == [(True, pin) for pin in pinned]
