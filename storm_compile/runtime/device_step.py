"""An optimizer's step of one host parameter, run on a GPU chunk by chunk.

At the end of a backward that steps an overlapped optimizer, storm's host thread may still have
parameters to step, at the host's memory bandwidth, while the GPU and the link sit idle. The
thread that waits for it takes the steps whose gradients completed last and runs them here
(:meth:`~storm_compile.runtime.streams.HostAdder.join`), so the two ends of the queue are
worked at once.

Per chunk of the parameter, one device buffer (the fold's, so no memory is added) takes a slice
of the parameter, of its gradient and of each state tensor of its shape, copied in on the H2D
stream; the optimizer's own update runs over the slices on a stream of its own, with a copy of
the scalar state (the step count) on the device; the parameter's and the state's slices go back
into the host tensors on the D2H stream. Chunks alternate between the buffers, each waiting
until the chunk before it in its buffer has gone home. The update of a slice is the update of
those elements: :data:`DEVICE_STEPPED` optimizers are elementwise. Run on the GPU, it rounds as
the optimizer's CUDA implementation does, which may differ from its host implementation in the
last bit of a bf16 value.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from storm_compile.runtime.cycles import step_alone

DEVICE_STEPPED = (torch.optim.Adam, torch.optim.AdamW)
"""The optimizers stepped on a GPU: their update of a parameter is elementwise over it, its
gradient and state tensors of its shape, with a step count advanced once per step, and it runs
fused on CUDA as on the host."""
SLICE_ALIGNMENT = 256
"""Bytes each tensor's slice of a buffer starts on: the alignment the CUDA allocator gives a
tensor, which vectorized kernels expect."""


@dataclasses.dataclass
class DeviceBuffer:
    """A device buffer and the event after which its last chunk has gone home (None before its
    first use, or off CUDA)."""

    data: torch.Tensor
    free: torch.cuda.Event | None = None


@dataclasses.dataclass(frozen=True)
class StepStreams:
    """Where a device step's copies and update run; all None off CUDA (everything in order)."""

    h2d: torch.cuda.Stream | None
    update: torch.cuda.Stream | None
    d2h: torch.cuda.Stream | None


def on_stream(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)


def device_steppable(optimizer: torch.optim.Optimizer, group: dict,
                     param: torch.Tensor, grad: torch.Tensor | None) -> bool:
    """Whether :func:`step_on_device` can take ``param``'s step: a :data:`DEVICE_STEPPED`
    optimizer, not differentiable, whose state for ``param`` exists (the first step creates it
    on the host), over a contiguous ``param`` and ``grad`` of one shape and dtype."""
    state = optimizer.state.get(param)
    return isinstance(optimizer, DEVICE_STEPPED) and not group.get("differentiable") \
        and bool(state) and grad is not None and grad.shape == param.shape \
        and grad.dtype == param.dtype and param.is_contiguous() and grad.is_contiguous() \
        and all(t.is_contiguous() for t in _elementwise(state, param).values())


def _elementwise(state: dict, param: torch.Tensor) -> dict[str, torch.Tensor]:
    return {key: value for key, value in state.items()
            if isinstance(value, torch.Tensor) and value.shape == param.shape}


def pin_state(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> None:
    """Move the state tensors of ``param``'s shape into pinned memory, so that their copies run
    asynchronously at the link's rate (an optimizer makes its state with ``zeros_like``, in
    pageable memory): once per parameter, the first time it steps on a GPU."""
    state = optimizer.state[param]
    for key, value in _elementwise(state, param).items():
        if not value.is_pinned():
            state[key] = value.pin_memory()


def step_on_device(optimizer: torch.optim.Optimizer, group: dict, param: torch.Tensor,
                   grad: torch.Tensor, buffers: list[DeviceBuffer],
                   streams: StepStreams) -> None:
    """Step ``optimizer`` with ``group``'s settings for the host ``param`` with gradient
    ``grad``, chunk by chunk through ``buffers`` on ``buffers``' device, as the module says;
    returns once the last chunk is home and the scalar state is written back. Assumes
    :func:`device_steppable`."""
    state = optimizer.state[param]
    elementwise = _elementwise(state, param)
    hosts = [param.detach().view(-1), grad.view(-1),
             *(t.view(-1) for t in elementwise.values())]
    device = buffers[0].data.device
    cuda = device.type == "cuda"
    slot = buffers[0].data.numel() // len(hosts) // SLICE_ALIGNMENT * SLICE_ALIGNMENT
    per_chunk = slot // max(t.element_size() for t in hosts)
    if per_chunk == 0:
        raise ValueError(f"storm: device buffers of {buffers[0].data.numel()} bytes are too "
                         f"small for a step over {len(hosts)} tensors")
    scalars = {key: value for key, value in state.items() if key not in elementwise}
    fused = bool(group.get("fused"))
    stepped = {}
    with torch.no_grad():
        for index, start in enumerate(range(0, param.numel(), per_chunk)):
            buffer = buffers[index % len(buffers)]
            pieces = [t[start:start + per_chunk] for t in hosts]
            slices = [buffer.data[i * slot:i * slot + p.numel() * p.element_size()]
                      .view(p.dtype) for i, p in enumerate(pieces)]
            with on_stream(streams.h2d):
                if buffer.free is not None:
                    streams.h2d.wait_event(buffer.free)
                for piece, copy in zip(pieces, slices):
                    copy.copy_(piece, non_blocking=cuda)
                loaded = _recorded(streams.h2d)
            with on_stream(streams.update):
                if loaded is not None:
                    streams.update.wait_event(loaded)
                chunk, chunk_grad, *moments = slices
                chunk.grad = chunk_grad
                stepped = {key: _scalar_copy(value, device if fused else None)
                           for key, value in scalars.items()}
                stepped.update(zip(elementwise, moments))
                step_alone(optimizer, {**group, "params": [chunk]}, {chunk: stepped})
                chunk.grad = None
                updated = _recorded(streams.update)
            with on_stream(streams.d2h):
                if updated is not None:
                    streams.d2h.wait_event(updated)
                for i, (piece, copy) in enumerate(zip(pieces, slices)):
                    if i != 1:               # the gradient is read, not written
                        piece.copy_(copy, non_blocking=cuda)
                buffer.free = _recorded(streams.d2h)
    for buffer in buffers:
        if buffer.free is not None:
            buffer.free.synchronize()
    for key, value in scalars.items():
        if isinstance(value, torch.Tensor):
            value.copy_(stepped[key])
        else:
            state[key] = stepped[key]


def _recorded(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


def _scalar_copy(value, device: torch.device | None):
    """A chunk's own copy of a scalar state entry (on ``device`` where the fused update wants
    it there): every chunk advances it once, from the same value."""
    if not isinstance(value, torch.Tensor):
        return value
    return value.to(device, copy=True) if device is not None else value.clone()
