"""Outputs upcast to float32 around a model are cast after storm's compiled graph: the same
values, dtypes and gradients as eager, and a zero gradient in the value's own dtype when
nothing reads the float32 output."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import CPU_TEST_OPTIONS
from storm_compile import StormBackend, StormConfig
from storm_compile.compiler.upcasts import move_upcasts


class Head(nn.Module):
    """A loss computed inside the model and the logits returned in float32, as accelerate's
    mixed-precision wrapper returns them."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 32)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits = self.proj(x)
        return nn.functional.cross_entropy(logits.float(), labels), logits.float()


def _step(backend, read_logits: bool):
    torch.manual_seed(0)
    model = Head().to(torch.bfloat16)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    labels = torch.randint(0, 32, (4,))
    run = model if backend is None else torch.compile(model, backend=backend)
    loss, logits = run(x, labels)
    (loss + logits.square().mean() if read_logits else loss).backward()
    return loss, logits, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("read_logits", [False, True])
def test_an_upcast_output_is_cast_after_the_graph_with_eager_values_and_gradients(read_logits):
    eager = _step(None, read_logits)
    stormed = _step(StormBackend(StormConfig.from_options(**CPU_TEST_OPTIONS)), read_logits)
    torch._dynamo.reset()
    assert stormed[1].dtype == torch.float32
    assert stormed[1].grad_fn.name() == "ToCopyBackward0"
    assert "CompiledFunction" in stormed[1].grad_fn.next_functions[0][0].name()
    torch.testing.assert_close(stormed[0], eager[0])
    torch.testing.assert_close(stormed[1], eager[1])
    for name, grad in eager[2].items():
        torch.testing.assert_close(stormed[2][name], grad)


def _moved(fn, *inputs) -> frozenset[int]:
    moved = []

    def backend(gm, example_inputs):
        moved.append(move_upcasts(gm))
        return gm.forward

    torch.compile(fn, backend=backend)(*inputs)
    torch._dynamo.reset()
    return moved[0]


def test_only_a_float32_cast_of_a_computed_half_value_read_by_nothing_else_moves():
    half = torch.randn(4, 8, dtype=torch.bfloat16)
    assert _moved(lambda x: (x * 2).float(), half) == {0}
    assert _moved(lambda x: x.float(), half) == frozenset()              # an input
    assert _moved(lambda x: ((x * 2).float(), (x * 2).float().sum()), half) == {0}
    assert _moved(lambda x: (x * 2).double(), half) == frozenset()       # not float32
    assert _moved(lambda x: (x * 2).float(), half.float()) == frozenset()  # not half precision

    def read_twice(x):
        y = (x * 2).float()
        return y, y + 1

    assert _moved(read_twice, half) == frozenset()


def test_accelerates_float32_outputs_leave_storms_graph_in_bfloat16():
    """The Hugging Face Trainer's mixed precision wraps the model's forward in accelerate's
    ``convert_outputs_to_fp32``, inside the frame dynamo compiles."""
    utils = pytest.importorskip("accelerate.utils")
    torch.manual_seed(0)
    model = Head().to(torch.bfloat16)
    model.forward = utils.convert_outputs_to_fp32(model.forward)
    model.compile(backend=StormBackend(StormConfig.from_options(**CPU_TEST_OPTIONS)))
    loss, logits = model(torch.randn(4, 16, dtype=torch.bfloat16), torch.randint(0, 32, (4,)))
    torch._dynamo.reset()
    assert logits.dtype == torch.float32 and logits.grad_fn.name() == "ToCopyBackward0"
    loss.backward()
    assert model.proj.weight.grad is not None
