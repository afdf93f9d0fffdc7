"""What the transfer ops need at run time: copy streams, the pinned host pool, pending copies.

One :class:`TransferRuntime` serves the process. The ops receive only tensors and scalars,
so the state that outlives a single call (streams, pooled pinned buffers, copies launched
but not yet recorded or waited on) lives here, in one object, rather than in module globals
scattered across the ops.
"""

from __future__ import annotations

import logging
import queue
import threading
import warnings

import torch
from torch.utils.weak import WeakIdKeyDictionary

log = logging.getLogger("storm_compile")


def _storage_use_count(tensor: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


BUCKETS_PER_DOUBLING = 8
"""Pinned buffers come in sizes rounded up to one of this many steps per power of two, so
tensors whose sizes vary from step to step (variable sequence lengths) reuse buffers instead
of pinning new ones; a buffer is at most 1/8 (12.5 %) larger than the tensor it holds."""


def bucket_bytes(nbytes: int) -> int:
    """``nbytes`` rounded up to its pool bucket."""
    step = 1 << max(0, (nbytes - 1).bit_length() - BUCKETS_PER_DOUBLING.bit_length())
    return -(-nbytes // step) * step


class PinnedPool:
    """Pinned host buffers reused across steps, bucketed by size (:func:`bucket_bytes`).

    Pinning is slow (143 ms for 256 MiB on the H100), so a buffer is pinned once and handed out
    again in later steps. A buffer is free again once no tensor other than the pool's own
    reference uses its storage: the backward dropped its host copy, or the graph that held it
    was freed without a backward. Reuse is safe for the device: a new copy into a reused buffer
    is issued on a stream that first waits on the compute stream, and the compute stream has
    already waited on the event of the last copy that read or wrote the buffer.

    The pool never holds more than the limit it is asked with: when a new buffer would pass it,
    idle buffers of other sizes (left by sizes no longer seen) are released first.
    """

    def __init__(self) -> None:
        self._buffers: dict[int, list[tuple[torch.Tensor, int]]] = {}
        self.reserved_bytes = 0

    def acquire(self, nbytes: int, limit: int) -> torch.Tensor | None:
        """A pinned uint8 buffer of at least ``nbytes`` not used by anyone, or None when one
        cannot be had within ``limit``."""
        size = bucket_bytes(nbytes)
        for buffer, idle_count in self._buffers.get(size, ()):
            if _storage_use_count(buffer) == idle_count:
                return buffer
        if self.reserved_bytes + size > limit:
            self._release_idle(self.reserved_bytes + size - limit)
        if self.reserved_bytes + size > limit:
            return None
        try:
            buffer = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as error:
            log.debug("pinning %d bytes failed: %s", size, error)
            return None
        self._buffers.setdefault(size, []).append((buffer, _storage_use_count(buffer)))
        self.reserved_bytes += size
        return buffer

    def _release_idle(self, needed: int) -> None:
        """Drop idle buffers, largest first, until ``needed`` bytes are released or none is
        left idle."""
        idle = sorted(((size, entry) for size, entries in self._buffers.items()
                       for entry in entries if _storage_use_count(entry[0]) == entry[1]),
                      key=lambda item: -item[0])
        for size, entry in idle:
            if needed <= 0:
                break
            self._buffers[size].remove(entry)
            self.reserved_bytes -= size
            needed -= size
        self._buffers = {size: entries for size, entries in self._buffers.items() if entries}

    def in_use_bytes(self) -> int:
        return sum(size for size, entries in self._buffers.items()
                   for buffer, idle in entries if _storage_use_count(buffer) != idle)

    def clear(self) -> None:
        """Forget every buffer; ones still referenced stay alive until their users drop them."""
        self._buffers.clear()
        self.reserved_bytes = 0


class HostAdder:
    """Adds gradients that arrive in host buffers into their parameters' ``.grad`` on one host
    thread, in arrival order, each after the copy that fills its buffer is done, so that the
    thread launching the backward's kernels never waits for a copy home or for the additions.

    A parameter whose ``.grad`` is None gets a buffer this object keeps for it, reused from
    step to step while nothing else holds it (after ``zero_grad``): a fresh host allocation of
    a model's gradients would pay its page faults at every step. An error on the thread is
    raised by the next :meth:`join`.
    """

    def __init__(self) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._buffers = WeakIdKeyDictionary()
        self._error: BaseException | None = None

    def add(self, x: torch.Tensor, param: torch.Tensor,
            event: torch.cuda.Event | None) -> None:
        """Add ``x`` into ``param.grad`` once ``event`` (when given) has completed: now when
        there is nothing to wait for and nothing queued, else on the thread."""
        if event is None and self._jobs.unfinished_tasks == 0:
            self._add_now(x, param)
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="storm-host-adder",
                                            daemon=True)
            self._thread.start()
        self._jobs.put((x, param, event))

    def join(self) -> None:
        """Wait until every queued addition is done; raise the first error one hit."""
        self._jobs.join()
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError("storm: adding a gradient into its host parameter failed") \
                from error

    def _run(self) -> None:
        while True:
            x, param, event = self._jobs.get()
            try:
                if event is not None:
                    event.synchronize()
                self._add_now(x, param)
            except BaseException as error:  # noqa: BLE001 - handed to join
                self._error = self._error or error
            finally:
                del x, param, event
                self._jobs.task_done()

    def _add_now(self, x: torch.Tensor, param: torch.Tensor) -> None:
        with torch.no_grad():
            if param.grad is not None:
                param.grad.add_(x)
                return
            buffer, idle_count = self._buffers.get(param, (None, 0))
            if buffer is None or _storage_use_count(buffer) != idle_count \
                    or buffer.shape != param.shape or buffer.dtype != param.dtype:
                buffer = torch.empty_like(param, memory_format=torch.contiguous_format)
                self._buffers[param] = (buffer, _storage_use_count(buffer))
            param.grad = buffer.copy_(x).detach()  # its own tensor: holders count as users


class TransferRuntime:
    """Streams, pool and pending copies. Copies are keyed by the destination's data pointer,
    which is unique while the destination is alive."""

    def __init__(self) -> None:
        self.pool = PinnedPool()
        self._d2h: dict[torch.device, torch.cuda.Stream] = {}
        self._h2d: dict[torch.device, torch.cuda.Stream] = {}
        self._launched: dict[int, tuple[torch.cuda.Stream, torch.device, bool]] = {}
        self._events: dict[int, tuple[torch.cuda.Event, torch.device]] = {}
        self._host_events: dict[int, torch.cuda.Event] = {}
        self._adder = HostAdder()
        self._warned_pinning = False

    def d2h_stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._d2h:
            self._d2h[device] = torch.cuda.Stream(device=device)
        return self._d2h[device]

    def h2d_stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._h2d:
            self._h2d[device] = torch.cuda.Stream(device=device)
        return self._h2d[device]

    def launch_copy(self, dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream,
                    device: torch.device, host_reads: bool = False) -> None:
        """Copy ``src`` into ``dst`` on ``stream``, after all the compute stream has queued;
        ``host_reads``: the host reads ``dst`` after it (:meth:`accumulate`)."""
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        self._launched[dst.data_ptr()] = (stream, device, host_reads)

    def record(self, tensor: torch.Tensor) -> None:
        """Record the completion event of the copy that produced ``tensor``, if one is pending."""
        launched = self._launched.pop(tensor.data_ptr(), None)
        if launched is None:
            return
        stream, device, host_reads = launched
        event = torch.cuda.Event()
        event.record(stream)
        self._events[tensor.data_ptr()] = (event, device)
        if host_reads:
            self._host_events[tensor.data_ptr()] = event

    def wait(self, tensor: torch.Tensor) -> None:
        """Make the compute stream wait on the recorded completion event of ``tensor``'s copy."""
        pending = self._events.pop(tensor.data_ptr(), None)
        if pending is not None:
            event, device = pending
            torch.cuda.current_stream(device).wait_event(event)

    def accumulate(self, x: torch.Tensor, param: torch.Tensor) -> None:
        """Add host tensor ``x`` into ``param.grad``, after the copy that produced ``x``
        (launched with ``host_reads``) when one is pending, without blocking the caller."""
        self._adder.add(x, param, self._host_events.pop(x.data_ptr(), None))

    def wait_host(self) -> None:
        """Block the host until every :meth:`accumulate` is done."""
        self._adder.join()

    def warn_pinning_failed(self, nbytes: int, limit: int) -> None:
        if not self._warned_pinning:
            self._warned_pinning = True
            warnings.warn(
                f"storm: could not pin {nbytes} more bytes of host memory (pool holds "
                f"{self.pool.reserved_bytes} of a {limit}-byte limit); activations that do not "
                f"fit stay on the GPU and gradients that do not go home synchronously. Raise "
                f"host_memory_limit or free host memory.",
                RuntimeWarning, stacklevel=2)


_RUNTIME = TransferRuntime()


def get_runtime() -> TransferRuntime:
    """The process's transfer runtime (it touches CUDA only when a copy is launched)."""
    return _RUNTIME
