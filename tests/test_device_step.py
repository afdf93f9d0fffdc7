"""An optimizer's step of one host parameter run chunk by chunk through device buffers
(:mod:`storm_compile.runtime.device_step`), here with the CPU standing in for the GPU: the
update of each slice is the update of those elements, so the result equals the optimizer's
own step exactly."""

import pytest
import torch

from storm_compile.runtime.cycles import group_of
from storm_compile.runtime.device_step import (
    DeviceBuffer,
    StepStreams,
    device_steppable,
    step_on_device,
)

NUMEL = 1000
"""Elements of the test parameter: with the buffers below, seven chunks, the last ragged."""
BUFFER_BYTES = 1024 * 4
"""Bytes of each test buffer: a slot of 1024 bytes for each of four tensors (parameter,
gradient, two moments), so 128 float32 elements per chunk, 512 bfloat16 ones."""
STEPS = 3
NO_STREAMS = StepStreams(None, None, None)


def _pair(optimizer_class, dtype, **settings):
    """The same parameter and gradient twice, each with its own optimizer, which has taken
    one step (a device step needs the state its first step makes)."""
    made = []
    for _ in range(2):
        generator = torch.Generator().manual_seed(0)
        param = torch.nn.Parameter(torch.randn(NUMEL, generator=generator).to(dtype))
        optimizer = optimizer_class([param], lr=1e-2, **settings)
        param.grad = torch.randn(NUMEL, generator=generator).to(dtype)
        optimizer.step()
        made.append((param, optimizer))
    return made


@pytest.mark.parametrize(("optimizer_class", "dtype", "settings"), [
    (torch.optim.AdamW, torch.float32, {"fused": True, "weight_decay": 0.1}),
    (torch.optim.AdamW, torch.bfloat16, {"fused": True}),
    (torch.optim.Adam, torch.float32, {"amsgrad": True, "foreach": False}),
])
def test_a_parameter_stepped_chunk_by_chunk_through_buffers_equals_its_step(
        optimizer_class, dtype, settings):
    (param, optimizer), (expected, reference) = _pair(optimizer_class, dtype, **settings)
    buffers = [DeviceBuffer(torch.empty(BUFFER_BYTES, dtype=torch.uint8)) for _ in range(2)]
    for step in range(STEPS):
        grad = torch.randn(NUMEL, generator=torch.Generator().manual_seed(step)).to(dtype)
        param.grad, expected.grad = grad, grad.clone()
        group = group_of(optimizer, param)
        assert device_steppable(optimizer, group, param, param.grad)
        step_on_device(optimizer, {**group, "params": [param]}, param, param.grad, buffers,
                       NO_STREAMS)
        reference.step()
    assert torch.equal(param, expected)
    for key, value in reference.state[expected].items():
        assert torch.equal(optimizer.state[param][key], value), key
    torch.testing.assert_close(param.grad, expected.grad, rtol=0, atol=0)


def test_only_an_elementwise_optimizer_with_its_state_made_is_stepped_on_the_device():
    param = torch.nn.Parameter(torch.randn(8))
    param.grad = torch.randn(8)
    fresh = torch.optim.AdamW([param])
    assert not device_steppable(fresh, group_of(fresh, param), param, param.grad), \
        "no state yet: the first step makes it on the host"
    fresh.step()
    assert device_steppable(fresh, group_of(fresh, param), param, param.grad)
    assert not device_steppable(fresh, group_of(fresh, param), param, param.grad.double())
    sgd = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    sgd.step()
    assert not device_steppable(sgd, group_of(sgd, param), param, param.grad)


def test_buffers_too_small_for_one_element_of_each_tensor_are_refused():
    (param, optimizer), _ = _pair(torch.optim.AdamW, torch.float32)
    tiny = [DeviceBuffer(torch.empty(64, dtype=torch.uint8))]
    with pytest.raises(ValueError, match="too small"):
        step_on_device(optimizer, {**group_of(optimizer, param), "params": [param]}, param,
                       param.grad, tiny, NO_STREAMS)


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [True, None])
def test_a_host_parameter_stepped_on_the_gpu_matches_its_host_step(fused):
    """Pinned host tensors, the copies and the update on three CUDA streams: the GPU's step
    equals the host's to rounding."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    (param, optimizer), (expected, reference) = _pair(torch.optim.AdamW, torch.float32,
                                                      fused=fused)
    param.data = param.data.pin_memory()
    param.grad = param.grad.pin_memory()
    for key, value in list(optimizer.state[param].items()):
        if value.shape == param.shape:
            optimizer.state[param][key] = value.pin_memory()
    buffers = [DeviceBuffer(torch.empty(BUFFER_BYTES, dtype=torch.uint8, device="cuda"))
               for _ in range(2)]
    streams = StepStreams(*(torch.cuda.Stream() for _ in range(3)))
    for step in range(STEPS):
        grad = torch.randn(NUMEL, generator=torch.Generator().manual_seed(step))
        param.grad.copy_(grad)
        expected.grad = grad.clone()
        step_on_device(optimizer, {**group_of(optimizer, param), "params": [param]}, param,
                       param.grad, buffers, streams)
        reference.step()
    torch.testing.assert_close(param.detach(), expected.detach(), rtol=1e-6, atol=1e-6)
    for key, value in reference.state[expected].items():
        torch.testing.assert_close(optimizer.state[param][key].cpu(), value, rtol=1e-6,
                                   atol=1e-6, msg=key)
