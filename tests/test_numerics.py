"""Numerics: storm gives the gradients of the backends it stands in for, on every zoo model."""

import pytest
import torch
import torch._inductor.config as inductor_config
from torch._inductor.utils import run_and_get_code

from helpers import CPU_TEST_OPTIONS, SEED, capture, step, transfer_count
from storm_compile import storm
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
