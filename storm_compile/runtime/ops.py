"""The typed transfer ops that storm inserts into graphs, under the ``storm`` namespace.

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

A streamed parameter (:mod:`storm_compile.weights.streaming`) lives in host memory and is read
through ``storm.fetch_weight(w, device)``, a copy to the device whose gradient is
``storm.grad_to_host(grad, w)``: a copy to ``w``'s device added into ``w.grad`` (set when it is
None), as the autograd engine would have accumulated it. Both are ordinary copies on the current
stream, so a streamed model is correct in eager mode and under any backend. In a storm graph,
fetches become prefetches (above), and each gradient's copy home is sent on the D2H stream as soon
as the gradient is produced and added into ``w.grad`` by a host thread once the copy is done, while
the GPU runs on::

    h  = storm.send_grad(g, host_limit[, w])  # D2H stream waits on compute, copies g into a
                                              # pinned buffer
    h1 = storm.record_event(h)
    ...compute...
    h2 = storm.wait_event(h1, g)        # compute stream waits; g's last use, its memory is freed
    t  = storm.accumulate_grad(h2, w)   # the host thread adds h2 into w.grad after the copy
    ...compute...
    storm.wait_host([t, ...])           # the graph's last node: every addition is done when
                                        # the autograd engine's backward pass ends (at once
                                        # outside one), so graphs split by a break all launch

A streamed weight the planner keeps on the device (``StoragePlan.resident``) is read through
``storm.resident_weight(w, device)`` instead: a device copy of ``w`` that the runtime keeps
across steps and copies again only when ``w`` may have changed (after an optimizer step that
may change it, or when its version counter or data moved), cloned on the device for each read
so that the compiled graph owns, and may reuse, the memory it reads.

A send given its weight (``w`` above: where the cost model finds the link faster than the host's
addition) folds its gradient in the backward that :mod:`storm_compile.runtime.cycles` learned to
be a step's last, where the weight's ``.grad`` already holds the step's earlier gradients in a
pinned buffer: that ``.grad`` is copied in, ``g`` added on the device, and the sum copied back
into it, in chunks through two device buffers, and the host thread adds nothing
(:meth:`~storm_compile.runtime.streams.TransferRuntime.send_grad`). The link carries the bytes
twice where the host would have added them at a third of the link's rate, on the thread that
steps the optimizer during that backward.

Such a weight whose gradients have room on the device too (``ResidentWeight.summed``) sends
each with ``summed``, ``storm.send_grad(g, host_limit, w, True)``: in a backward that is not its
step's last, the runtime adds ``g`` into a sum on the device and returns a placeholder that the
copy's event, wait and addition pass over; the step's last backward sends the sum home, once.

NOTE: the GPU memory of an offloaded tensor is released by ordinary reference counting (the
wait is the tensor's last use, after which Inductor and FX drop it), not by ``record_stream``
(which delays frees unpredictably and fragments the allocator) and not by shrinking the storage
in place (Inductor may hand a dead buffer's memory to a later buffer by aliasing it).
"""

from __future__ import annotations

import torch
from torch.fx.node import has_side_effect

from storm_compile.runtime.streams import get_runtime

_lib = torch.library.Library("storm", "DEF")
_lib.define("offload(Tensor x, int host_limit) -> Tensor")
_lib.define("prefetch(Tensor x, Device device) -> Tensor")
_lib.define("record_event(Tensor(a) x) -> Tensor(a)")
_lib.define("wait_event(Tensor(a) x, Tensor? keepalive=None) -> Tensor(a)")

_COMPOSITE = "CompositeExplicitAutograd"


def _copy_to_pool(x: torch.Tensor, host_limit: int, strides: tuple[int, ...],
                  host_reads: bool) -> torch.Tensor | None:
    """Launch the copy of CUDA tensor ``x`` on the D2H stream into a pooled pinned buffer,
    viewed with ``strides``; None (after warning once) when the pool cannot give one."""
    runtime = get_runtime()
    nbytes = x.numel() * x.element_size()
    buffer = runtime.pool.acquire(nbytes, host_limit)
    if buffer is None:
        runtime.warn_pinning_failed(nbytes, host_limit)
        return None
    host = buffer[:nbytes].view(x.dtype).as_strided(x.shape, strides)
    runtime.launch_copy(host, x, runtime.d2h_stream(x.device), x.device, host_reads=host_reads)
    return host


@torch.library.impl(_lib, "offload", _COMPOSITE)
def _offload(x: torch.Tensor, host_limit: int) -> torch.Tensor:
    if x.device.type != "cuda":
        return x.clone()
    host = _copy_to_pool(x, host_limit, x.stride(), host_reads=False)
    return x.clone() if host is None else host


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


_lib.define("fetch_weight(Tensor w, Device device) -> Tensor")
_lib.define("resident_weight(Tensor w, Device device) -> Tensor")
_lib.define("grad_to_host(Tensor grad, Tensor w) -> ()")
_lib.define("send_grad(Tensor grad, int host_limit, Tensor? weight=None, bool summed=False) "
            "-> Tensor")
_lib.define("accumulate_grad(Tensor(a) x, Tensor w) -> Tensor(a)")
_lib.define("wait_host(Tensor[] tokens) -> ()")


@torch.library.impl(_lib, "fetch_weight", _COMPOSITE)
def _fetch_weight(w: torch.Tensor, device: torch.device) -> torch.Tensor:
    if w.device == device:
        return w.clone()
    out = torch.empty_like(w, device=device)
    get_runtime().copy_from_host(out, w)
    return out


@torch.library.register_fake("storm::fetch_weight")
def _fetch_weight_fake(w: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.empty_strided(w.shape, w.stride(), dtype=w.dtype, device=device)


@torch.library.impl(_lib, "resident_weight", _COMPOSITE)
def _resident_weight(w: torch.Tensor, device: torch.device) -> torch.Tensor:
    return get_runtime().mirror(w, device).clone()


@torch.library.register_fake("storm::resident_weight")
def _resident_weight_fake(w: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.empty_strided(w.shape, w.stride(), dtype=w.dtype, device=device)


@torch.library.impl(_lib, "grad_to_host", _COMPOSITE)
def _grad_to_host(grad: torch.Tensor, w: torch.Tensor) -> None:
    runtime = get_runtime()
    runtime.accumulate(grad.to(w.device, copy=True), w)    # its own: it may become w.grad
    runtime.wait_host()


@torch.library.register_fake("storm::grad_to_host")
def _grad_to_host_fake(grad: torch.Tensor, w: torch.Tensor) -> None:
    return None


def copy_home(grad: torch.Tensor, host_limit: int) -> torch.Tensor:
    """``grad`` in a contiguous host tensor: on a GPU, copied on the D2H stream into a pinned
    buffer of the pool (the host reads it once the copy is done), or synchronously when the pool
    cannot give one; elsewhere a clone."""
    if grad.device.type != "cuda":
        host = grad.clone(memory_format=torch.contiguous_format)
    else:
        contiguous = torch.empty(grad.shape, device="meta").stride()
        host = _copy_to_pool(grad, host_limit, contiguous, host_reads=True)
        host = grad.to("cpu") if host is None else host
    get_runtime().sent(host, grad)
    return host


@torch.library.impl(_lib, "send_grad", _COMPOSITE)
def _send_grad(grad: torch.Tensor, host_limit: int, weight: torch.Tensor | None = None,
               summed: bool = False) -> torch.Tensor:
    if weight is None:
        return copy_home(grad, host_limit)
    return get_runtime().send_grad(grad, host_limit, weight, copy_home, summed)


@torch.library.register_fake("storm::send_grad")
def _send_grad_fake(grad: torch.Tensor, host_limit: int, weight: torch.Tensor | None = None,
                    summed: bool = False) -> torch.Tensor:
    return torch.empty(grad.shape, dtype=grad.dtype, device="cpu")


@torch.library.impl(_lib, "accumulate_grad", _COMPOSITE)
def _accumulate_grad(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    get_runtime().accumulate(x, w)
    return x


@torch.library.register_fake("storm::accumulate_grad")
def _accumulate_grad_fake(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x


@torch.library.impl(_lib, "wait_host", _COMPOSITE)
def _wait_host(tokens: list[torch.Tensor]) -> None:
    get_runtime().wait_host()


@torch.library.register_fake("storm::wait_host")
def _wait_host_fake(tokens: list[torch.Tensor]) -> None:
    return None


def _fetch_weight_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0])


def _fetch_weight_backward(ctx, grad: torch.Tensor):
    """The gradient goes into the host weight's ``.grad`` through ``storm.grad_to_host``, not
    through the autograd engine, so that a storm graph can add it on a host thread while the
    GPU runs on; the engine sees no gradient for the weight."""
    (w,) = ctx.saved_tensors
    torch.ops.storm.grad_to_host(grad, w)
    return None, None


torch.library.register_autograd("storm::fetch_weight", _fetch_weight_backward,
                                setup_context=_fetch_weight_context)

offload = torch.ops.storm.offload.default
prefetch = torch.ops.storm.prefetch.default
record_event = torch.ops.storm.record_event.default
wait_event = torch.ops.storm.wait_event.default

fetch_weight = torch.ops.storm.fetch_weight.default
resident_weight = torch.ops.storm.resident_weight.default
grad_to_host = torch.ops.storm.grad_to_host.default
send_grad = torch.ops.storm.send_grad.default
accumulate_grad = torch.ops.storm.accumulate_grad.default
wait_host = torch.ops.storm.wait_host.default

FAKE_IMPLS = {offload: _offload_fake, prefetch: _prefetch_fake, send_grad: _send_grad_fake}
"""The fake implementations of storm's ops that make a new tensor, by op. A pass computing an
inserted node's value calls the op's own under the graph's fake mode instead of dispatching the
op there: 51 µs a call against 197 µs on a 2-core CPU, for the thousands of copies a streamed
model's rewrite inserts."""

TRANSFER_OPS = (offload, prefetch, record_event, wait_event, send_grad, accumulate_grad,
                wait_host)
for _op in (*TRANSFER_OPS, grad_to_host):
    has_side_effect(_op)
