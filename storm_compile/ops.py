"""The four typed transfer ops that storm inserts into graphs, under the ``storm`` namespace.

Passes find them by ``node.target`` (the ``*.default`` overloads below), never by name.

Forward, per offloaded activation ``x``::

    h  = storm.offload(x, host_limit)   # D2H stream waits on compute, copies x into a pinned buffer
    h1 = storm.record_event(h)          # event recorded on the D2H stream after the copy
    ...compute...
    h2 = storm.wait_event(h1, x)        # compute stream waits on the event; x's last use, so its
                                        # GPU memory returns to the caching allocator right after

Backward, per prefetched activation ``h`` (a graph input)::

    y  = storm.prefetch(h, device)      # GPU buffer allocated on compute; H2D stream copies into it
    y1 = storm.record_event(y)          # event recorded on the H2D stream after the copy
    ...compute...
    y2 = storm.wait_event(y1, h)        # compute stream waits on the event; then y2 is read

On CPU tensors offload and prefetch are plain copies and the event ops do nothing, so graphs
carrying them run, and are tested, without a GPU.

NOTE: the GPU memory of an offloaded tensor is released by ordinary reference counting (the
wait is the tensor's last use, after which Inductor and FX drop it), not by ``record_stream``
(which delays frees unpredictably and fragments the allocator) and not by shrinking the storage
in place (Inductor may hand a dead buffer's memory to a later buffer by aliasing it).
"""

from __future__ import annotations

import torch
from torch.fx.node import has_side_effect

from storm_compile.runtime import get_runtime

_lib = torch.library.Library("storm", "DEF")
_lib.define("offload(Tensor x, int host_limit) -> Tensor")
_lib.define("prefetch(Tensor x, Device device) -> Tensor")
_lib.define("record_event(Tensor(a) x) -> Tensor(a)")
_lib.define("wait_event(Tensor(a) x, Tensor? keepalive=None) -> Tensor(a)")

_COMPOSITE = "CompositeExplicitAutograd"


@torch.library.impl(_lib, "offload", _COMPOSITE)
def _offload(x: torch.Tensor, host_limit: int) -> torch.Tensor:
    if x.device.type != "cuda":
        return x.clone()
    runtime = get_runtime()
    nbytes = x.numel() * x.element_size()
    buffer = runtime.pool.acquire(nbytes, host_limit)
    if buffer is None:
        runtime.warn_pinning_failed(nbytes, host_limit)
        return x.clone()
    host = buffer.view(x.dtype).as_strided(x.shape, x.stride())
    runtime.launch_copy(host, x, runtime.d2h_stream(x.device), x.device)
    return host


@torch.library.register_fake("storm::offload")
def _offload_fake(x: torch.Tensor, host_limit: int) -> torch.Tensor:
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cpu")


@torch.library.impl(_lib, "prefetch", _COMPOSITE)
def _prefetch(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    if x.device == device or device.type != "cuda":
        return x.to(device, copy=True)
    runtime = get_runtime()
    out = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device)
    runtime.launch_copy(out, x, runtime.h2d_stream(device), device)
    return out


@torch.library.register_fake("storm::prefetch")
def _prefetch_fake(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device)


@torch.library.impl(_lib, "record_event", _COMPOSITE)
def _record_event(x: torch.Tensor) -> torch.Tensor:
    get_runtime().record(x)
    return x


@torch.library.register_fake("storm::record_event")
def _record_event_fake(x: torch.Tensor) -> torch.Tensor:
    return x


@torch.library.impl(_lib, "wait_event", _COMPOSITE)
def _wait_event(x: torch.Tensor, keepalive: torch.Tensor | None = None) -> torch.Tensor:
    get_runtime().wait(x)
    return x


@torch.library.register_fake("storm::wait_event")
def _wait_event_fake(x: torch.Tensor, keepalive: torch.Tensor | None = None) -> torch.Tensor:
    return x


offload = torch.ops.storm.offload.default
prefetch = torch.ops.storm.prefetch.default
record_event = torch.ops.storm.record_event.default
wait_event = torch.ops.storm.wait_event.default

TRANSFER_OPS = (offload, prefetch, record_event, wait_event)
for _op in TRANSFER_OPS:
    has_side_effect(_op)
