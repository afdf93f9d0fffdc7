"""Numerics: storm gives the gradients of the backends it stands in for, on every zoo model."""

import logging

import pytest
import torch
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
import torch._inductor.lowering as inductor_lowering
from torch._inductor.utils import run_and_get_code

from helpers import CPU_TEST_OPTIONS, SEED, capture, step, transfer_count
from storm_compile import storm
from storm_compile.compiler import backend
from zoo import ZOO

MODELS = sorted(ZOO)
INDUCTOR_RTOL = 1e-4
INDUCTOR_ATOL = 1e-5
VOCAB, WIDTH = 50, 16


@pytest.mark.parametrize("name", MODELS)
def test_offloads_something(name):
    assert transfer_count(capture(name)) > 0


@pytest.mark.parametrize("name", MODELS)
def test_eager_inner_is_bitwise_aot_eager(name):
    ref_loss, ref_grads, ref_buffers = step(name, "aot_eager")
    loss, grads, buffers = step(name, storm(**CPU_TEST_OPTIONS))
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for key in ref_grads:
        assert torch.equal(grads[key], ref_grads[key]), key
    for key in ref_buffers:
        assert torch.equal(buffers[key], ref_buffers[key]), key


@pytest.mark.parametrize("name", MODELS)
def test_inductor_matches_eager(name):
    ref_loss, ref_grads, ref_buffers = step(name, None)
    options = {**CPU_TEST_OPTIONS, "inner": "inductor"}
    with inductor_config.patch(fallback_random=True):
        loss, grads, buffers = step(name, storm(**options))
    torch.testing.assert_close(loss, ref_loss, rtol=INDUCTOR_RTOL, atol=INDUCTOR_ATOL)
    assert grads.keys() == ref_grads.keys()
    for key in ref_grads:
        torch.testing.assert_close(grads[key], ref_grads[key], rtol=INDUCTOR_RTOL,
                                   atol=INDUCTOR_ATOL, msg=key)
    for key in ref_buffers:
        torch.testing.assert_close(buffers[key], ref_buffers[key], rtol=INDUCTOR_RTOL,
                                   atol=INDUCTOR_ATOL, msg=key)


def test_embedding_backward_runs_as_aten_kernel():
    """Under a budget, a bfloat16 embedding's gradient comes from aten's kernel, not from
    Inductor's float32 table of the whole vocabulary (``backend.KEPT_WHOLE``), and equals
    eager's."""
    torch.manual_seed(SEED)
    embed = torch.nn.Embedding(VOCAB, WIDTH, dtype=torch.bfloat16)
    tokens = torch.randint(VOCAB, (2, 8))

    def loss(module):
        return module(tokens).pow(2).sum()

    loss(embed).backward()
    expected, embed.weight.grad = embed.weight.grad, None
    bounded = {**CPU_TEST_OPTIONS, "inner": "inductor", "offload": "hidden", "memory_budget": 1.0}
    compiled = torch.compile(embed, backend=storm(**bounded))
    _, code = run_and_get_code(lambda: loss(compiled).backward())
    backward = code[-1]
    assert "aten.embedding_dense_backward" in backward
    assert "torch.float32" not in backward
    torch.testing.assert_close(embed.weight.grad, expected)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_storm_ops_lower_as_fallbacks_registered_before_inductor_meets_them():
    """Inductor lowers storm's ops as the fallbacks ``register_fallbacks`` gave them, not
    through its implicit fallback (which logs each op it meets, torch 2.11 formatting the
    line's arguments either way), and the numerics stay Inductor's; from a process's first
    compile on (the lowerings a test left are taken out, the caches are off)."""
    for op in backend.STORM_OPS:
        inductor_lowering.lowerings.pop(op, None)
    backend.register_fallbacks.cache_clear()
    graph_log, records = logging.getLogger("torch._inductor.graph"), _Records()
    level = graph_log.level
    graph_log.addHandler(records)
    graph_log.setLevel(logging.INFO)
    try:
        with inductor_config.patch(fx_graph_cache=False, fallback_random=True), \
                functorch_config.patch(enable_autograd_cache=False):
            loss, _, _ = step("mlp", storm(**{**CPU_TEST_OPTIONS, "inner": "inductor"}))
    finally:
        graph_log.removeHandler(records)
        graph_log.setLevel(level)
    implicit = [m for m in records.messages if "implicit fallback" in m and "storm." in m]
    assert implicit == []
    assert all(op in inductor_lowering.lowerings for op in backend.STORM_OPS)
    torch.testing.assert_close(loss, step("mlp", None)[0], rtol=INDUCTOR_RTOL, atol=INDUCTOR_ATOL)
