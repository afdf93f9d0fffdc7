"""What the transfer ops need at run time: copy streams, the pinned host pool, pending copies.

One :class:`TransferRuntime` serves the process. The ops receive only tensors and scalars,
so the state that outlives a single call (streams, pooled pinned buffers, copies launched
but not yet recorded or waited on) lives here, in one object, rather than in module globals
scattered across the ops.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import os
import queue
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils.weak import WeakIdKeyDictionary

from storm_compile.fx.torch_private import (
    execution_engine,
    optional,
    storage_use_count,
    will_engine_execute_node,
)
from storm_compile.runtime.cycles import (
    Cycles,
    HeldGrad,
    ParameterStep,
    StormOverlapError,
    held,
    streamed_parameters,
)

log = logging.getLogger("storm_compile")


def _storage_use_count(tensor: torch.Tensor) -> int:
    return storage_use_count(tensor.untyped_storage()._cdata)


class StormAutogradError(RuntimeError):
    """An autograd entry point that cannot serve a streamed parameter, whose gradient reaches
    its ``.grad`` on storm's host thread rather than through the autograd engine."""


def _current_backward() -> int | None:
    """The autograd engine's running backward pass (its graph task id), or None outside one
    (or where this torch cannot tell)."""
    current = optional("current_graph_task_id")
    task = -1 if current is None else current()
    return None if task == -1 else task


_TENSOR_GRAD = torch.Tensor.grad
"""``.grad`` as the tensor holds it: the host thread adds into it without the wait that a
streamed parameter's own ``.grad`` does (:class:`storm_compile.weights.streaming.HostParameter`)."""

TORCH_OPTIMIZERS = "torch.optim."
"""The module prefix of torch's own optimizers, each of which leaves a parameter without a
gradient unchanged (:meth:`TransferRuntime._may_change`)."""

BUCKETS_PER_DOUBLING = 8
"""Pinned buffers come in sizes rounded up to one of this many steps per power of two, so
tensors whose sizes vary from step to step (variable sequence lengths) reuse buffers instead
of pinning new ones; a buffer is at most 1/8 (12.5 %) larger than the tensor it holds."""


PINNING_THREADS = 8
"""Threads that map a new pinned buffer's pages before ``cudaHostRegister`` pins them (torch's
``pinned_use_cuda_host_register`` and ``pinned_num_register_threads``, for which torch's
documentation names 8): on the H100 host pinning 3.2 GiB then ran at 5.4-6.1 GB/s, against
1.4-1.9 GB/s through ``cudaHostAlloc``, torch's default, with copies into either as fast."""
PINNED_OPTIONS = "pinned_"
"""The prefix of the allocator options about pinned memory: where ``PYTORCH_CUDA_ALLOC_CONF``
names one, the user chose how to pin and storm leaves it."""


@functools.cache
def pin_quickly() -> bool:
    """Before storm's first pinned allocation in a process: pin with :data:`PINNING_THREADS`
    threads through ``cudaHostRegister``. Not where CUDA is absent, ``PYTORCH_CUDA_ALLOC_CONF``
    sets an option about pinned memory, this torch cannot set it or count pinned blocks, or
    the process has pinned memory already: some torch versions free a pinned block the way the
    setting says at the time, so a block pinned the other way must never exist. (Torch reports
    no host statistics at all before its pinned allocator exists.) Whether it switched."""
    configured = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    setter = optional("set_allocator_settings")
    stats = getattr(torch.cuda.memory, "host_memory_stats", None)
    if not torch.cuda.is_available() or PINNED_OPTIONS in configured or setter is None \
            or stats is None or stats().get("num_host_alloc", 0) != 0:
        return False
    setter(f"pinned_use_cuda_host_register:True,pinned_num_register_threads:{PINNING_THREADS}")
    log.debug("pinning through cudaHostRegister on %d threads", PINNING_THREADS)
    return True


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

    :meth:`reserve` pins buffers ahead, on a thread of its own, while the caller goes on (the
    backend reserves a streamed graph's gradient buffers while it compiles the graph, or loads it
    from torch's caches); :meth:`acquire` of a size still being reserved waits for that buffer
    instead of pinning another.
    """

    def __init__(self) -> None:
        self._buffers: dict[int, list[tuple[torch.Tensor, int]]] = {}
        self.reserved_bytes = 0
        self.limit: int | None = None
        """The limit the pool was last asked to stay within (None before the first ask)."""
        self._changed = threading.Condition()
        """Held while the buffers or :attr:`_pending` change; notified after each change."""
        self._pending: collections.Counter[int] = collections.Counter()
        """Buffers of each bucket size a reservation will still pin."""

    def _pin(self, size: int) -> torch.Tensor | None:
        """A new pinned uint8 buffer of ``size`` bytes, or None when it cannot be pinned."""
        pin_quickly()
        try:
            return torch.empty(size, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as error:
            log.debug("pinning %d bytes failed: %s", size, error)
            return None

    def _idle(self, size: int) -> torch.Tensor | None:
        for buffer, idle_count in self._buffers.get(size, ()):
            if _storage_use_count(buffer) == idle_count:
                return buffer
        return None

    def _keep(self, buffer: torch.Tensor, size: int) -> None:
        self._buffers.setdefault(size, []).append((buffer, _storage_use_count(buffer)))
        self.reserved_bytes += size

    def acquire(self, nbytes: int, limit: int) -> torch.Tensor | None:
        """A pinned uint8 buffer of at least ``nbytes`` not used by anyone, or None when one
        cannot be had within ``limit``."""
        size = bucket_bytes(nbytes)
        self.limit = limit
        with self._changed:
            idle = self._idle(size)
            while idle is None and self._pending[size] > 0:
                self._changed.wait()
                idle = self._idle(size)
            if idle is not None:
                return idle
            if self.reserved_bytes + size > limit:
                self._release_idle(self.reserved_bytes + size - limit)
            if self.reserved_bytes + size > limit:
                return None
            buffer = self._pin(size)
            if buffer is not None:
                self._keep(buffer, size)
            return buffer

    def reserve(self, sizes: list[int], limit: int) -> threading.Thread | None:
        """Pin a buffer for each of ``sizes`` (bytes) that the pool does not hold yet, in that
        order, on a new thread, never past ``limit``: the thread, or None when there is nothing
        to pin (or no CUDA to pin with)."""
        if not torch.cuda.is_available():
            return None
        self.limit = limit
        with self._changed:
            held = collections.Counter(
                {size: len(entries) for size, entries in self._buffers.items()})
            wanted, order = collections.Counter(), []
            for size in map(bucket_bytes, sizes):
                wanted[size] += 1
                if wanted[size] > held[size] + self._pending[size]:
                    order.append(size)
            self._pending.update(order)
        if not order:
            return None
        thread = threading.Thread(target=self._pin_reserved, args=(order, limit),
                                  name="storm-pin", daemon=True)
        thread.start()
        return thread

    def _pin_reserved(self, sizes: list[int], limit: int) -> None:
        left = collections.Counter(sizes)
        try:
            for size in sizes:
                buffer = self._pin(size) if self.reserved_bytes + size <= limit else None
                with self._changed:
                    left[size] -= 1
                    self._pending[size] -= 1
                    if buffer is not None and self.reserved_bytes + size <= limit:
                        self._keep(buffer, size)
                    self._changed.notify_all()
        finally:
            with self._changed:
                self._pending.subtract(left)
                self._changed.notify_all()

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

    def has_room(self, nbytes: int) -> bool:
        """Whether one more buffer of ``nbytes`` would stay within :attr:`limit`, idle buffers
        counted as room (:meth:`acquire` reuses one of that size, or lets idle ones of other
        sizes go to pin it)."""
        if self.limit is None:
            return True
        size = bucket_bytes(nbytes)
        if self.reserved_bytes + size <= self.limit:
            return True
        with self._changed:
            return self.in_use_bytes() + size <= self.limit

    def in_use_bytes(self) -> int:
        return sum(size for size, entries in self._buffers.items()
                   for buffer, idle in entries if _storage_use_count(buffer) != idle)

    def clear(self) -> None:
        """Forget every buffer; ones still referenced stay alive until their users drop them."""
        with self._changed:
            self._buffers.clear()
            self.reserved_bytes = 0


FOLD_CHUNK_BYTES = 32 << 20
"""Bytes of a gradient folded into its host sum per chunk (:meth:`TransferRuntime.send_grad`):
a chunk's copy in and copy home each pay the link's latency once (about 25 us on the H100
against 0.6 ms moving 32 MiB at 55 GB/s), and two chunks in flight hold 64 MiB of the device."""
FOLD_BUFFERS = 2
"""Device buffers a fold cycles through: one chunk's sum goes home while the next comes in."""


def fold_device_bytes(largest: int) -> int:
    """The device memory a process holds for folds from its first on, where the largest
    gradient it folds has ``largest`` bytes."""
    return FOLD_BUFFERS * min(FOLD_CHUNK_BYTES, largest)


@dataclasses.dataclass
class _FoldBuffer:
    """A device buffer of :data:`FOLD_CHUNK_BYTES` and the event after which its last chunk has
    gone home (None before its first use, or off CUDA)."""

    data: torch.Tensor
    free: torch.cuda.Event | None = None


def indexed(device: torch.device) -> torch.device:
    """``device`` with its index where CUDA is present: ``cuda`` names the current CUDA device,
    and compares unequal to ``cuda:0`` (a dictionary keyed by devices holds both apart)."""
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _on(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)


Step = Callable[[torch.Tensor], None]
"""Applies the optimizer to one parameter whose gradient is complete."""


@dataclasses.dataclass
class _PendingStep:
    param: torch.Tensor
    step: Step
    adds_left: int
    complete: bool = False
    """Every addition of this backward for it is handed over: it steps once they are done,
    before the backward is all launched."""


@dataclasses.dataclass(frozen=True)
class KeptNorm:
    """The 2-norm of a gradient, computed where it was made before it came home, and the
    ``.grad`` it is the norm of while unchanged (its data pointer and version)."""

    norm: torch.Tensor
    data_ptr: int
    version: int


class HostAdder:
    """Adds gradients that arrive in host buffers into their parameters' ``.grad`` on one host
    thread, in arrival order, each after the copy that fills its buffer is done, so that the
    thread launching the backward's kernels never waits for a copy home or for the additions.

    An addition may carry a ``step`` for its parameter (an optimizer overlapped with the
    backward): it runs once the parameter's additions are all done and either the addition
    that came said it was the parameter's last of this backward (``complete``) or :meth:`join`
    has been called, that is, once the whole backward has been launched and every gradient it
    sends is known; on the thread, between additions, while the GPU runs the backward. An
    addition for a parameter already stepped in this backward raises
    :class:`~storm_compile.runtime.cycles.StormOverlapError`.

    A parameter whose ``.grad`` is None takes the buffer its gradient came home in as its
    ``.grad``, without a copy: the buffer ``storm.send_grad`` made for this gradient alone, which
    nobody writes again (a pinned buffer goes back to ``pool`` only once nothing holds it: after
    ``zero_grad`` drops the gradient, or when the user lets go of it). The first micro-batch of
    a step then costs the host no addition, and the gradients need no host memory besides their
    pinned buffers. A pinned buffer is kept so only while ``pool`` has room for another of its
    size (the next micro-batch's copies need buffers of their own); past that, the gradient is
    copied into new host memory. An error on the thread is raised by the next :meth:`join`.
    At ``DEBUG`` level the ``storm_compile`` logger gets a line per addition: its bytes, how
    long it waited for its copy, how long the addition took, and how many jobs were still
    queued (the thread falling behind shows as a growing queue).
    """

    def __init__(self, pool: PinnedPool | None = None) -> None:
        self.pool = pool
        """Where the pinned buffers gradients come home in are from (None: none are pinned)."""
        self._jobs: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._steps: dict[int, _PendingStep] = {}
        self._launched = threading.Event()
        self.norms = WeakIdKeyDictionary()
        """A :class:`KeptNorm` per parameter whose ``.grad`` is one gradient copied home."""
        self.versions = WeakIdKeyDictionary()
        """The version of each parameter's ``.grad`` after this object's last addition into it
        since the last optimizer step over streamed parameters: a later one is someone else's
        write."""
        self._finished = threading.Condition()
        self._handed_over = 0
        self._done = 0
        self._queued: collections.Counter[int] = collections.Counter()
        """Jobs handed to the thread and not done, by ``id`` of their parameter."""
        self._stepped: set[int] = set()
        """``id`` of each parameter stepped since the last :meth:`join`."""

    def add(self, x: torch.Tensor, param: torch.Tensor, event: torch.cuda.Event | None,
            step: Step | None = None, norm: torch.Tensor | None = None,
            folded: bool = False, complete: bool = False) -> None:
        """Add ``x`` into ``param.grad`` once ``event`` (when given) has completed: now when
        there is nothing to wait for and nothing queued, else on the thread; then ``step``
        it, when given, as the class says. ``norm``: the 2-norm of ``x``, kept in
        :attr:`norms` while ``param.grad`` is ``x`` alone, or, ``folded`` (``x`` is
        ``param.grad``, the sum the event's copy wrote into it), the 2-norm of that sum;
        ``complete``: no other addition for ``param`` comes in this backward."""
        if step is not None:
            with self._lock:
                if id(param) in self._stepped:
                    raise StormOverlapError(
                        f"storm: a backward brought another gradient to a streamed parameter "
                        f"(shape {tuple(param.shape)}) after its optimizer stepped it, having "
                        f"learned how many its backwards bring; call storm_compile."
                        f"overlap_optimizer(optimizer, enabled=False) for a loop whose "
                        f"backwards differ")
                pending = self._steps.setdefault(id(param), _PendingStep(param, step, 0))
                pending.adds_left += 1
                pending.complete = pending.complete or complete
        if event is None and self._jobs.unfinished_tasks == 0:
            self._add_now(x, param, step is not None, norm, folded=folded)
            return
        with self._finished:
            self._queued[id(param)] += 1
        self._put((x, param, event, step is not None, norm, folded))

    def wait_added(self, param: torch.Tensor) -> None:
        """Wait until every job handed over for ``param`` is done (the thread no longer
        touches its ``.grad``)."""
        with self._finished:
            self._finished.wait_for(lambda: self._queued[id(param)] == 0)

    def join(self) -> None:
        """Run the pending steps, wait until every queued addition and step is done; raise the
        first error one hit."""
        if self._steps:
            self._launched.set()
            self._put(None)
        self._jobs.join()
        self._launched.clear()
        error, self._error = self._error, None
        leftover = [p.param for p in self._steps.values()]
        self._steps.clear()
        self._stepped.clear()
        if error is not None:
            raise RuntimeError("storm: adding a gradient into its host parameter, or the "
                               "optimizer step after it, failed") from error
        if leftover:
            raise RuntimeError(f"storm: {len(leftover)} parameters' optimizer steps did not "
                               f"run: their gradients did not all arrive")

    def settle(self) -> None:
        """Wait until every job handed over so far is done; raise the first error one hit."""
        self.wait_for(self._handed_over)
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError("storm: adding a gradient into its host parameter, or the "
                               "optimizer step after it, failed") from error

    def handed_over(self) -> int:
        """How many jobs the thread has been given so far: a mark for :meth:`wait_for`."""
        return self._handed_over

    def wait_for(self, mark: int) -> None:
        """Wait until the thread has finished the first ``mark`` jobs it was given (their
        errors are raised by the next :meth:`join`)."""
        with self._finished:
            self._finished.wait_for(lambda: self._done >= mark)

    def on_thread(self) -> bool:
        """Whether the caller runs on this object's host thread."""
        return threading.current_thread() is self._thread

    def _put(self, job) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="storm-host-adder",
                                            daemon=True)
            self._thread.start()
        self._handed_over += 1
        self._jobs.put(job)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is not None:
                    x, param, event, counted, norm, folded = job
                    begin = time.perf_counter()
                    while event is not None and not event.query():
                        if not self._step_one():
                            event.synchronize()
                    self._add_now(x, param, counted, norm, time.perf_counter() - begin, folded)
                while self._step_one():
                    pass
            except BaseException as error:  # noqa: BLE001 - handed to join
                self._error = self._error or error
            finally:
                owner = None if job is None else id(job[1])
                job = x = param = event = norm = None
                with self._finished:
                    if owner is not None:
                        self._queued[owner] -= 1
                        if not self._queued[owner]:
                            del self._queued[owner]
                    self._done += 1
                    self._finished.notify_all()
                self._jobs.task_done()

    def _step_one(self) -> bool:
        """Run one step whose additions are done, once they are known complete or the backward
        is launched; whether one ran."""
        launched = self._launched.is_set()
        with self._lock:
            ready = next((key for key, p in self._steps.items()
                          if p.adds_left == 0 and (launched or p.complete)), None)
            if ready is None:
                return False
            pending = self._steps.pop(ready)
            self._stepped.add(ready)
        pending.step(pending.param)
        return True

    def _add_now(self, x: torch.Tensor, param: torch.Tensor, counted: bool,
                 norm: torch.Tensor | None, waited_s: float = 0.0, folded: bool = False) -> None:
        """Add ``x`` into ``param.grad``, ``waited_s`` after its job started waiting for its
        copy; ``counted``: an addition its pending step waits for (an earlier micro-batch's,
        still queued, is not one); ``norm``: the 2-norm of ``x``, or None; ``folded``: ``x`` is
        ``param.grad`` with the gradient already added on the device."""
        begin = time.perf_counter()
        with torch.no_grad():
            grad = _TENSOR_GRAD.__get__(param)
            self.norms.pop(param, None)
            if folded:
                if norm is not None:
                    self.norms[param] = KeptNorm(norm, grad.data_ptr(), grad._version)
            elif grad is not None:
                grad.add_(x)
            else:
                kept = not x.is_pinned() or self.pool is None \
                    or self.pool.has_room(x.untyped_storage().nbytes())
                param.grad = x.detach() if kept else x.clone()    # holders count as users
                if norm is not None:
                    grad = _TENSOR_GRAD.__get__(param)
                    self.norms[param] = KeptNorm(norm, grad.data_ptr(), grad._version)
            self.versions[param] = _TENSOR_GRAD.__get__(param)._version
        if counted:
            with self._lock:
                self._steps[id(param)].adds_left -= 1
        log.debug("storm: gradient of %d bytes waited %.3f ms for its copy home, added in "
                  "%.3f ms; %d jobs queued",
                  x.numel() * x.element_size(), waited_s * 1e3,
                  (time.perf_counter() - begin) * 1e3, self._jobs.qsize())


@dataclasses.dataclass(frozen=True)
class LaunchedCopy:
    """A copy launched on a copy stream whose completion event is not recorded yet."""

    stream: torch.cuda.Stream
    device: torch.device
    host_reads: bool
    """The host reads the copy's destination once it is done (a gradient to add)."""
    host_source: int | None
    """``data_ptr`` of the host tensor the copy reads, for a copy from host memory: a write
    into that tensor must wait for it."""


@dataclasses.dataclass(frozen=True)
class PendingCopy:
    """A recorded copy the compute stream has not waited for yet."""

    event: torch.cuda.Event
    device: torch.device


class TransferRuntime:
    """Streams, pool and pending copies, the host thread that adds gradients (and steps the
    parameters of an overlapped optimizer), the device copies of resident weights, and what is
    learned of the training loop (:mod:`storm_compile.runtime.cycles`). Copies are keyed by the
    destination's data pointer, which is unique while the destination is alive.

    A backward returns once its copies home are launched and the additions of the backward
    before it are done: the host thread adds one micro-batch's gradients while the GPU runs the
    next, and no more than two micro-batches' gradients wait in pinned buffers. Whatever reads
    a streamed parameter's gradient waits for its additions first (:meth:`read_grad`, called
    by :class:`storm_compile.weights.streaming.HostParameter`), and so does every optimizer step.
    """

    def __init__(self) -> None:
        self.pool = PinnedPool()
        self._d2h: dict[torch.device, torch.cuda.Stream] = {}
        self._h2d: dict[torch.device, torch.cuda.Stream] = {}
        self._launched: dict[int, LaunchedCopy] = {}
        self._follow: dict[tuple[int, int], torch.cuda.Event] = {}
        """The event a copy stream waits on for the compute stream's queued work, one per
        launching thread and device (:meth:`launch_copy`)."""
        self._events: dict[int, PendingCopy] = {}
        self._host_events: dict[int, torch.cuda.Event] = {}
        self._host_reads: dict[int, torch.cuda.Event] = {}
        self._mirrors = WeakIdKeyDictionary()
        self._optimizer_steps: collections.Counter[int] = collections.Counter()
        """Optimizer steps taken off the host thread that may have changed a host weight, by
        the weight's storage (:meth:`_may_change`)."""
        self._changing_now: list[frozenset[int]] = []
        """The storages each running optimizer step may change, innermost last; a step that
        began before storm watched optimizers (:meth:`watch_optimizers`) has none here and
        counts as changing all of its parameters."""
        self._thread_steps: collections.Counter[int] = collections.Counter()
        """Steps of one parameter each the host thread took, by the parameter's data pointer."""
        self._arrived: dict[int, tuple[torch.Tensor, int]] = {}
        """Each parameter given gradients in the running backward, by ``id``, with how many."""
        self._reads: collections.Counter[int] = collections.Counter()
        """Copies launched in the running backward from each host tensor, by data pointer."""
        self._last_counts: dict[int, tuple[int, int]] = {}
        """Gradients and host reads of each parameter in the last backward, by ``id``."""
        self._expected: dict[int, tuple[int, int]] = {}
        """The same, for each parameter that had the same counts in the two backwards before."""
        self._stepped_ptrs: set[int] = set()
        """Data pointers of the parameters the host thread stepped in the running backward: a
        copy from one of them now would read the stepped weight."""
        self._host_writes = 0
        self._optimizer_hooks = None
        self._adder = HostAdder(self.pool)
        self._joined_task: int | None = None
        self._previous_backward = 0
        self.stepper: ParameterStep | None = None
        """While set (:class:`storm_compile.weights.streaming.OverlappedOptimizer`), each streamed
        parameter is stepped once its gradient is complete."""
        self.cycles = Cycles()
        self.backwards = 0
        """Backwards that brought streamed gradients since the last optimizer step over
        streamed parameters."""
        self._carried = False
        self._stepping = False
        self._unguarded = False
        self._deferring = 0
        self._written_after: int | None = None
        self._sent_norms: dict[int, torch.Tensor] = {}
        """The 2-norm of each gradient sent home while :attr:`norms_wanted`, by its host
        copy's data pointer, until the copy is handed to the host thread."""
        self.norms_wanted = False
        """Set once a gradient's norm was read without a kept one: from then on each gradient
        sent home has its 2-norm computed where it was made (a kernel per gradient)."""
        self.norms_served = 0
        """Reads of a gradient's norm answered with a norm computed where it was made."""
        self._hidden: list[tuple[torch.Tensor, torch.Tensor]] = []
        """Parameters stepped during the backward, with the ``.grad`` hidden from the step."""
        self._in_step = 0
        self._steps_streamed = False
        self._warned_pinning = False
        self._warned_writes: weakref.WeakSet = weakref.WeakSet()
        """Optimizers warned about writes (held weakly: a new one may reuse a dead one's id)."""
        self._sums = WeakIdKeyDictionary()
        """The device sum of each streamed parameter's gradients held there since the last
        time they went home (:meth:`send_grad`)."""
        self._placeholders: dict[tuple, torch.Tensor] = {}
        """What ``storm.send_grad`` returns for a gradient it kept on the device, per shape and
        dtype: a host tensor never written or read (its pages are never touched)."""
        self._sending: dict[int, torch.Tensor] = {}
        """A sum on its way home, by its host copy's data pointer, kept alive until the compute
        stream waits for the copy (:meth:`wait`)."""
        self._folded: set[int] = set()
        """The data pointers of ``.grad`` tensors a fold wrote a gradient into, until the host
        thread is handed them (:meth:`accumulate`)."""
        self._fold_buffers: dict[torch.device, list[_FoldBuffer]] = {}
        self._fold_streams: dict[torch.device, torch.cuda.Stream] = {}
        self.fold_chunk_bytes = FOLD_CHUNK_BYTES
        self.folds = 0
        """Gradients folded into their host sums on the device so far."""

    def d2h_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The device's one stream for copies to the host."""
        device = indexed(device)
        if device not in self._d2h:
            self._d2h[device] = torch.cuda.Stream(device=device)
        return self._d2h[device]

    def h2d_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The device's one stream for copies from the host: activations' prefetches and
        weights' fetches queue on it in the order they are issued, as the placement and the
        simulator order them (copies on two streams run in an order of the copy engines'
        choosing: a weight needed now can wait behind activations needed later)."""
        device = indexed(device)
        if device not in self._h2d:
            self._h2d[device] = torch.cuda.Stream(device=device)
        return self._h2d[device]

    def launch_copy(self, dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream,
                    device: torch.device, host_reads: bool = False) -> None:
        """Copy ``src`` into ``dst`` on ``stream``, after all the compute stream has queued;
        ``host_reads``: the host reads ``dst`` after it (:meth:`accumulate`).

        A compiled graph calls this for every copy, so it spends little host time: ``stream``
        waits on one event per launching thread and device, recorded on the compute stream
        again for each copy (a wait holds the record it was queued after; a later record does
        not move it), and the current stream is switched by ``torch.cuda.set_stream`` and back
        where ``device`` is the current device (elsewhere through ``torch.cuda.stream``, which
        restores the device too)."""
        host_source = src.data_ptr() if src.device.type == "cpu" else None
        if host_source is not None:
            self._host_read(src)
        compute = torch.cuda.current_stream(device)
        key = (threading.get_ident(), compute.device_index)
        follow = self._follow.get(key)
        if follow is None:
            follow = self._follow[key] = torch.cuda.Event()
        follow.record(compute)
        stream.wait_event(follow)
        if compute.device_index == torch.cuda.current_device():
            torch.cuda.set_stream(stream)
            try:
                dst.copy_(src, non_blocking=True)
            finally:
                torch.cuda.set_stream(compute)
        else:
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
        self._launched[dst.data_ptr()] = LaunchedCopy(stream, device, host_reads, host_source)

    def _host_read(self, host: torch.Tensor) -> None:
        """A copy from ``host`` is launched: counted for :meth:`_complete` inside a backward;
        :class:`StormOverlapError` where the host thread has stepped it during this one."""
        if _current_backward() is None:
            return
        if host.data_ptr() in self._stepped_ptrs:
            raise StormOverlapError(
                f"storm: a backward read a streamed weight (shape {tuple(host.shape)}) after its "
                f"optimizer stepped it, having learned that its backwards read it no later; call "
                f"storm_compile.overlap_optimizer(optimizer, enabled=False) for a loop whose "
                f"backwards differ")
        self._reads[host.data_ptr()] += 1

    def _complete(self, param: torch.Tensor) -> bool:
        """Count a gradient of ``param`` arriving in the running backward; whether it is the
        last, and every copy from ``param`` this backward launches is launched: the counts
        match the two backwards before, and ``param`` has no device copy kept across steps
        (whose reads and copies the optimizer's step would have to wait for)."""
        arrived = self._arrived.get(id(param), (param, 0))[1] + 1
        self._arrived[id(param)] = (param, arrived)
        return param not in self._mirrors and self._expected.get(id(param)) == (
            arrived, self._reads[param.data_ptr()])

    def _learn_counts(self) -> None:
        """At the end of a backward: keep the counts of the parameters whose gradients and
        host reads were the same in this backward and the one before."""
        counts = {key: (arrived, self._reads[param.data_ptr()])
                  for key, (param, arrived) in self._arrived.items()}
        self._expected = {key: c for key, c in counts.items() if self._last_counts.get(key) == c}
        self._last_counts = counts
        self._arrived.clear()
        self._reads.clear()
        self._stepped_ptrs.clear()

    def record(self, tensor: torch.Tensor) -> None:
        """Record the completion event of the copy that produced ``tensor``, if one is pending."""
        launched = self._launched.pop(tensor.data_ptr(), None)
        if launched is None:
            return
        event = torch.cuda.Event()
        event.record(launched.stream)
        self._events[tensor.data_ptr()] = PendingCopy(event, launched.device)
        if launched.host_reads:
            self._host_events[tensor.data_ptr()] = event
        if launched.host_source is not None:
            self._host_reads[launched.host_source] = event

    def watch_optimizers(self) -> None:
        """Follow every optimizer step from now on (idempotent)."""
        if self._optimizer_hooks is None:
            self._optimizer_hooks = (
                register_optimizer_step_pre_hook(self._before_optimizer_step),
                register_optimizer_step_post_hook(self._after_optimizer_step))

    def note_host_write(self) -> None:
        """A streamed parameter's ``.data`` was read or replaced: a write through it moves no
        version counter, so every device copy kept of a host weight is copied again before its
        next read."""
        self._host_writes += 1

    def mirror(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The device copy of ``host`` kept across calls, copied again when ``host`` may have
        changed since: an optimizer stepped a parameter in its storage (fused optimizers update
        parameters without moving their version counters; :meth:`_may_change` says which a step
        may change), its version counter moved (``load_state_dict``,
        ``copy_`` and other in-place writes), a streamed parameter's ``.data`` was touched
        (:meth:`note_host_write`) or its data was replaced; the caller reads it after the
        current stream's queued work."""
        self.watch_optimizers()
        state = (self._optimizer_steps[host.untyped_storage().data_ptr()],
                 self._thread_steps[host.data_ptr()], self._host_writes,
                 host._version, host.data_ptr(), device)
        kept = self._mirrors.get(host)
        if kept is not None and kept[1] == state:
            return kept[0]
        copy = kept[0] if kept is not None and kept[0].device == device \
            else torch.empty_like(host, device=device)
        self.copy_from_host(copy, host)
        self._mirrors[host] = (copy, state)
        return copy

    def copy_from_host(self, dst: torch.Tensor, host: torch.Tensor) -> None:
        """Copy ``host`` into ``dst`` on the current stream, asynchronously from pinned memory
        to a GPU: the host thread's optimizer step of ``host`` waits for the copy to have read
        it (:meth:`_step`), and inside a backward the copy counts as a read of it
        (:meth:`_host_read`)."""
        self._host_read(host)
        asynchronous = host.is_pinned() and dst.device.type == "cuda"
        dst.copy_(host, non_blocking=asynchronous)
        if asynchronous:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(dst.device))
            self._host_reads[host.data_ptr()] = event

    def prepare_backward(self, weights: list[torch.Tensor], limit: int) -> None:
        """Ahead of a backward that sends the gradients of the streamed ``weights`` home (in
        that order), on a thread of its own while the caller goes on: pin their buffers
        (:meth:`PinnedPool.reserve`, within ``limit`` bytes), which a step's first gradients then
        stay in as the weights' ``.grad`` (:class:`HostAdder`). Nothing without CUDA, where no
        copy is pinned."""
        if torch.cuda.is_available():
            self.pool.reserve([w.numel() * w.element_size() for w in weights], limit)

    def wait(self, tensor: torch.Tensor) -> None:
        """Make the compute stream wait on the recorded completion event of ``tensor``'s copy;
        a sum that copy reads is then released (the compute stream, where it was made, now
        follows the copy)."""
        pending = self._events.pop(tensor.data_ptr(), None)
        if pending is not None:
            torch.cuda.current_stream(pending.device).wait_event(pending.event)
        self._sending.pop(tensor.data_ptr(), None)

    def send_grad(self, grad: torch.Tensor, limit: int, param: torch.Tensor,
                  copy_home: Callable[[torch.Tensor, int], torch.Tensor],
                  summed: bool) -> torch.Tensor:
        """``storm.send_grad`` of a gradient of ``param``.

        Not ``summed``: in the backward learned to be the step's last
        (:meth:`Cycle.last_backward`), or run inside ``OverlappedOptimizer.final_backward()``,
        where ``param.grad`` holds the step's earlier gradients (in a pinned buffer, on a GPU),
        fold ``grad`` into it (:meth:`_fold`) and return that ``.grad``; else send ``grad``
        home with ``copy_home``. Only there: the host thread steps the optimizer during that
        backward, and the fold leaves it that time, where in the backwards before the host's
        additions run beside the GPU's work and the fold's copies would take the link from the
        weights' (``storm throughput`` prices a micro-batch of the streamed 3B preset at 16384
        tokens that folds at 742 ms, against 706 ms for one that does not).

        ``summed`` (the plan left room to sum ``param``'s gradients on the device): when the
        running backward accumulates into ``param`` and is not its step's last, add ``grad``
        into ``param``'s sum there (a copy of it, the first time) and return a placeholder that
        :meth:`accumulate` passes over; else send the sum with ``grad`` added, or ``grad``
        alone, home with ``copy_home``. The sum goes home early wherever the gradient is read
        or replaced before then (:meth:`read_grad`, :meth:`grad_replaced`, every optimizer
        step)."""
        if not summed:
            folded = self._fold(grad, param) if self._folds(param) else None
            return copy_home(grad, limit) if folded is None else folded
        if not self._accumulates(param):
            return copy_home(grad, limit)
        total = self._sums.pop(param, None)
        if total is not None:
            total.add_(grad)
        if self._sums_later(param):
            self._sums[param] = grad.clone(memory_format=torch.contiguous_format) \
                if total is None else total
            return self._placeholder(grad)
        if total is None:
            return copy_home(grad, limit)
        host = copy_home(total, limit)
        self._sending[host.data_ptr()] = total
        return host

    def _folds(self, param: torch.Tensor) -> bool:
        """Whether this backward is one after the first of a step, the step's last (stated by
        :attr:`stepper`, or learned), and accumulates into ``param``."""
        if not self.backwards:
            return False
        if self.stepper is None:
            owner = self.cycles.owner(param)
            if owner is None or owner[1].last_backward() != self.backwards:
                return False
        return self._accumulates(param)

    def _fold(self, grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor | None:
        """Add ``grad`` into ``param.grad`` on ``grad``'s device once the host thread is done
        with it: chunk by chunk along the first dimension, each chunk of ``.grad`` copied in
        on a stream of its own, ``grad``'s added to it and the sum copied back on the D2H
        stream, through :data:`FOLD_BUFFERS` device buffers. Returns that ``.grad``, whose
        copy home :meth:`record` then records, or None where ``.grad`` cannot take it (None,
        not pinned on a GPU, another shape, dtype or layout than contiguous; rows larger than
        a chunk). Off CUDA the same chunks are added in place, so the bookkeeping runs in
        CPU tests."""
        self._adder.wait_added(param)
        total = _TENSOR_GRAD.__get__(param)
        cuda = grad.device.type == "cuda"
        if total is None or total.shape != grad.shape or total.dtype != grad.dtype \
                or not total.is_contiguous() or (cuda and not total.is_pinned()):
            return None
        rows = total.reshape(1, -1) if total.dim() == 0 else total
        sources = grad.reshape(1, -1) if grad.dim() == 0 else grad
        row_bytes = max(rows[0].numel() * rows.element_size() if len(rows) else 1, 1)
        chunk_bytes = min(self.fold_chunk_bytes, len(rows) * row_bytes)
        per_chunk = chunk_bytes // row_bytes
        if per_chunk == 0:
            return None
        buffers = self._fold_buffers_of(grad.device, chunk_bytes)
        load = self._fold_streams[grad.device] if cuda else None
        home = self.d2h_stream(grad.device) if cuda else None
        if home is not None:
            home.wait_stream(torch.cuda.current_stream(grad.device))
        squares = None
        if self.norms_wanted:
            with _on(home):
                squares = torch.zeros((), dtype=torch.float32, device=grad.device)
        with torch.no_grad():
            for index, start in enumerate(range(0, len(rows), per_chunk)):
                buffer = buffers[index % FOLD_BUFFERS]
                host = rows[start:start + per_chunk]
                chunk = buffer.data[:host.numel() * host.element_size()].view(
                    host.dtype).view(host.shape)
                with _on(load):
                    if buffer.free is not None:
                        load.wait_event(buffer.free)
                    chunk.copy_(host, non_blocking=cuda)
                    loaded = torch.cuda.Event() if cuda else None
                    if loaded is not None:
                        loaded.record(load)
                with _on(home):
                    if loaded is not None:
                        home.wait_event(loaded)
                    chunk.add_(sources[start:start + per_chunk])
                    if squares is not None:
                        squares += torch.linalg.vector_norm(chunk, 2.0,
                                                            dtype=torch.float32).square()
                    host.copy_(chunk, non_blocking=cuda)
                    if cuda:
                        buffer.free = torch.cuda.Event()
                        buffer.free.record(home)
        if cuda:
            self._launched[total.data_ptr()] = LaunchedCopy(home, grad.device, True, None)
        if squares is not None:
            with _on(home):
                self._sent_norms[total.data_ptr()] = squares.sqrt()
        self._folded.add(total.data_ptr())
        self.folds += 1
        return total

    def _fold_buffers_of(self, device: torch.device, nbytes: int) -> list[_FoldBuffer]:
        """The device's fold buffers, of at least ``nbytes`` each: made on the fold stream at
        the first fold that needs them this large, once the fold stream has waited for every
        use of the smaller ones they replace, so that the allocator hands their memory to
        nothing still running. A process's buffers are as large as the largest chunk it
        folded: a gradient's bytes, at most :attr:`fold_chunk_bytes`
        (:func:`~storm_compile.cost.simulate.device_bytes` counts that)."""
        held = self._fold_buffers.get(device, [])
        if not held or held[0].data.numel() < nbytes:
            stream = None
            if device.type == "cuda":
                stream = self._fold_streams.setdefault(device, torch.cuda.Stream(device=device))
            with _on(stream):
                for buffer in held:
                    if buffer.free is not None:
                        stream.wait_event(buffer.free)
                self._fold_buffers[device] = [
                    _FoldBuffer(torch.empty(nbytes, dtype=torch.uint8, device=device))
                    for _ in range(FOLD_BUFFERS)]
        return self._fold_buffers[device]

    def _sums_later(self, param: torch.Tensor) -> bool:
        owner = self.cycles.owner(param)
        last = None if owner is None else owner[1].last_backward()
        return last is not None and self.backwards < last

    def _placeholder(self, grad: torch.Tensor) -> torch.Tensor:
        key = (tuple(grad.shape), grad.dtype)
        if key not in self._placeholders:
            self._placeholders[key] = torch.empty(grad.shape, dtype=grad.dtype, device="cpu")
        return self._placeholders[key]

    def _send_sum(self, param: torch.Tensor) -> None:
        """Add ``param``'s device sum, if it has one, into its ``.grad`` now."""
        total = self._sums.pop(param, None)
        if total is not None:
            self._adder.add(total.to(param.device), param, None)
            self._adder.settle()

    def grad_replaced(self, param: torch.Tensor, cleared: bool) -> None:
        """``param``'s ``.grad`` is set or deleted off the host thread: the additions still
        running finish first (into the gradient replaced), its device sum belongs to that
        gradient and is dropped, and ``cleared`` (set to None) is :meth:`grad_cleared`."""
        if self._adder.on_thread():
            return
        self._adder.settle()
        self._sums.pop(param, None)
        if cleared:
            self.grad_cleared()

    def accumulate(self, x: torch.Tensor, param: torch.Tensor) -> None:
        """Add host tensor ``x`` into ``param.grad``, after the copy that produced ``x``
        (launched with ``host_reads``) when one is pending, without blocking the caller, when
        the running backward accumulates into ``param`` (:meth:`_accumulates`); with a
        :attr:`stepper`, or in the backward that :mod:`storm_compile.runtime.cycles` learned to be a
        step's last, step ``param`` once its gradient is complete and no copy launched from it
        is still reading it."""
        if any(x is p for p in self._placeholders.values()):
            self._carried = True        # summed on the device (send_grad): it came all the same
            return
        event = self._host_events.pop(x.data_ptr(), None)
        norm = self._sent_norms.pop(x.data_ptr(), None)
        folded = x.data_ptr() in self._folded
        self._folded.discard(x.data_ptr())
        if not self._accumulates(param):
            return
        self._carried = True
        self._unguarded = self._unguarded or not getattr(param, "storm_streamed", False)
        stepper = self.stepper or self._learned_stepper(param)
        step = None if stepper is None else functools.partial(self._step, stepper)
        self._stepping = self._stepping or step is not None
        complete = self._complete(param) and step is not None
        self._adder.add(x, param, event, step, norm, folded, complete)

    def sent(self, host: torch.Tensor, grad: torch.Tensor) -> None:
        """``grad`` is on its way home into ``host``: while :attr:`norms_wanted`, take its
        2-norm now, where it was made, for :meth:`kept_norm`."""
        if self.norms_wanted:
            with torch.no_grad():
                self._sent_norms[host.data_ptr()] = torch.linalg.vector_norm(grad, 2.0)

    def kept_norm(self, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor | None:
        """The 2-norm of ``grad``, ``param``'s ``.grad``, on its device, where it is one
        gradient copied home whose norm :meth:`sent` took and nothing changed it since (on a
        GPU a reduction of the same values in another order); else None, and norms are taken
        from then on. The Hugging Face Trainer reads every gradient's norm at every step, for
        its logs: on the host that pass runs at a few GB/s."""
        kept = self._adder.norms.get(param)
        if kept is None or kept.data_ptr != grad.data_ptr() or kept.version != grad._version:
            self.norms_wanted = True
            return None
        self.norms_served += 1
        return kept.norm.to(grad.device)

    def _accumulates(self, param: torch.Tensor) -> bool:
        """Whether the running backward accumulates into ``param.grad``: not in
        ``backward(inputs=...)`` or ``torch.autograd.grad`` over other tensors. Raises
        :class:`StormAutogradError` where the engine would hand the gradient to someone else:
        ``torch.autograd.grad`` over ``param``, or a hook registered on it with
        ``register_hook``."""
        if param._backward_hooks:
            raise StormAutogradError(
                f"storm: a hook registered with register_hook on a streamed parameter (shape "
                f"{tuple(param.shape)}) would receive None, since its gradient reaches .grad on "
                f"storm's host thread; use register_post_accumulate_grad_hook, which sees the "
                f"whole .grad")
        if _current_backward() is None:
            return True
        node = torch.autograd.graph.get_gradient_edge(param).node
        try:
            return will_engine_execute_node(node)
        except RuntimeError:
            raise StormAutogradError(
                f"storm: torch.autograd.grad cannot return the gradient of a streamed parameter "
                f"(shape {tuple(param.shape)}): it reaches .grad on storm's host thread; call "
                f"backward() (inputs= works) and read .grad") from None

    def _learned_stepper(self, param: torch.Tensor) -> ParameterStep | None:
        """The optimizer step of ``param`` when this backward is its step's last
        (:mod:`storm_compile.runtime.cycles`). Raises :class:`StormOverlapError` when ``param`` was
        stepped in an earlier backward of this step."""
        owner = self.cycles.owner(param)
        if owner is None:
            return None
        optimizer, cycle = owner
        stepped_after = cycle.stepped.get(id(param))
        if stepped_after is not None and stepped_after < self.backwards:
            raise StormOverlapError(
                f"storm: a backward brought a gradient to a streamed parameter (shape "
                f"{tuple(param.shape)}) that its optimizer already stepped during backward "
                f"{stepped_after + 1} of this step, the last one before each optimizer.step() "
                f"so far: call storm_compile.overlap_optimizer(optimizer, "
                f"backwards_per_step=...) with the real count, or enabled=False")
        if cycle.final_backward() != self.backwards:
            return None
        cycle.stepped[id(param)] = self.backwards
        return ParameterStep(optimizer, keep_grad=True)

    def grad_cleared(self) -> None:
        """A streamed parameter's ``.grad`` was set to None off the host thread and outside an
        optimizer step (``zero_grad``): the backwards counted towards the next step start
        again from zero, so a backward run without a step since (an evaluation's, an aborted
        step's) does not shift what :mod:`storm_compile.runtime.cycles` learns."""
        if not self._in_step:
            self.backwards = 0

    def read_grad(self, param: torch.Tensor) -> torch.Tensor | HeldGrad | None:
        """What a read of ``param.grad`` returns, once its pending additions are done (raising
        the first error one hit, off the host thread): the gradient, or, off the host thread
        and outside an optimizer step once a backward brought streamed gradients, the gradient
        as a :class:`~storm_compile.runtime.cycles.HeldGrad` whose writes :meth:`_grad_written`
        judges and whose 2-norm :meth:`kept_norm` gives where it can."""
        on_thread = self._adder.on_thread()
        if not on_thread:
            self._adder.settle()
            self._send_sum(param)
        grad = _TENSOR_GRAD.__get__(param)
        if grad is None or on_thread or self._in_step or not self.backwards:
            return grad
        return held(grad, functools.partial(self._grad_written, param),
                    functools.partial(self.kept_norm, param, grad))

    def _grad_written(self, param: torch.Tensor, times_one: bool) -> bool:
        """A write into ``param``'s ``.grad`` read after a backward (``times_one``: it
        multiplies by exactly one); whether to skip it, as :mod:`storm_compile.runtime.cycles`
        says. Raises :class:`StormOverlapError` for a write that changes the gradient of a
        parameter already stepped during the backward."""
        owner = self.cycles.owner(param)
        cycle = None if owner is None else owner[1]
        if cycle is not None and id(param) in cycle.stepped:
            if times_one:
                return True
            raise StormOverlapError(
                f"storm: the gradient of a streamed parameter (shape {tuple(param.shape)}) was "
                f"written (clipped, scaled) after its optimizer stepped it during the last "
                f"backward with the gradient as it was; to clip or scale gradients before "
                f"optimizer.step(), call storm_compile.overlap_optimizer(optimizer, "
                f"enabled=False)")
        if times_one and cycle is not None and cycle.backwards_per_step is not None:
            return True
        self._written_after = self.backwards
        return False

    def _step(self, stepper: ParameterStep, param: torch.Tensor) -> None:
        """Step ``param`` once no copy launched from it still reads it; unless the step keeps
        its ``.grad``, set that to None so that ``optimizer.step()`` skips it."""
        reading = self._host_reads.pop(param.data_ptr(), None)
        if reading is not None:
            reading.synchronize()
        self._stepped_ptrs.add(param.data_ptr())
        stepper(param)
        self._thread_steps[param.data_ptr()] += 1
        if not stepper.keep_grad:
            param.grad = None

    def wait_host(self) -> None:
        """At the end of the autograd engine's backward pass, or now outside one: wait for
        the additions of the backward before this one, or, when this backward steps parameters
        or added into one whose ``.grad`` does not wait for its additions (not a
        :class:`~storm_compile.weights.streaming.HostParameter`) outside :meth:`deferred`, for every
        addition and step. A backward of several graphs (graph breaks) launches them
        all before the host waits, and the steps know every gradient they wait for."""
        task = _current_backward()
        if task is None:
            self._end_of_backward()
        elif task != self._joined_task:
            self._joined_task = task
            execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._joined_task = None
        if self._stepping or (self._unguarded and not self._deferring):
            self._adder.join()
        else:
            self._adder.wait_for(self._previous_backward)
            self._previous_backward = self._adder.handed_over()
        self.backwards += self._carried
        self._carried = self._stepping = self._unguarded = False
        self._learn_counts()

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """A block whose end waits for every addition of the backwards in it, and whose
        backwards leave their own additions to the next, also for parameters whose ``.grad`` does
        not wait for them (see :func:`storm_compile.weights.streaming.gradient_accumulation`)."""
        self._deferring += 1
        try:
            yield
        finally:
            self._deferring -= 1
            self._adder.join()

    def _before_optimizer_step(self, optimizer, args, kwargs) -> None:
        """Every addition done before any step off the host thread; the gradients of the
        parameters stepped during the backward hidden from the step; the step's streamed
        parameters told to :mod:`storm_compile.runtime.cycles`, with a warning when their
        gradients were written after the last backward while it learns. A step given a closure
        runs a backward of its own after this hook (Lightning steps so), so storm cannot count
        the step's backwards, and stops stepping that optimizer's parameters during them."""
        if self._adder.on_thread():
            return
        for param in list(self._sums.keys()):
            self._send_sum(param)
        self._adder.join()
        streamed = streamed_parameters(optimizer)
        self._check_writes(streamed)
        self._in_step += 1
        self._steps_streamed = bool(streamed)
        self._hide_stepped(streamed)
        closure = args[1] if len(args) > 1 else kwargs.get("closure")  # args[0] is optimizer
        self._changing_now.append(self._may_change(optimizer, closure is not None))
        cycle = self.cycles.observe(optimizer, streamed, self.backwards)
        if cycle is not None and closure is not None:
            cycle.enabled = False
            return
        if cycle is None or self._written_after != self.backwards or not self.backwards:
            return
        if cycle.enabled and cycle.backwards_per_step is None:
            cycle.enabled = False
            if optimizer not in self._warned_writes:
                self._warned_writes.add(optimizer)
                warnings.warn(
                    f"storm: the gradients of streamed parameters are written between the last "
                    f"backward and {type(optimizer).__name__}.step() (gradient clipping, a grad "
                    f"scaler), so this optimizer steps them after the backward instead of "
                    f"during it", RuntimeWarning, stacklevel=2)

    def _check_writes(self, streamed: list[torch.Tensor]) -> None:
        """Judge, as :meth:`_grad_written` does, each of ``streamed`` whose ``.grad`` moved its
        version since storm's last addition into it: written through a view, ``detach()`` or
        anything else that the :class:`~storm_compile.runtime.cycles.HeldGrad` did not see."""
        for param in streamed:
            version = self._adder.versions.pop(param, None)
            grad = _TENSOR_GRAD.__get__(param)
            if version is not None and grad is not None and grad._version != version:
                self._grad_written(param, times_one=False)

    def _hide_stepped(self, streamed: list[torch.Tensor]) -> None:
        """Set aside the ``.grad`` of each of ``streamed`` that was stepped during the
        backward, so that the optimizer step skips it; :meth:`_after_optimizer_step` puts it
        back, for reads until ``zero_grad``."""
        for param in streamed:
            owner = self.cycles.owner(param)
            grad = _TENSOR_GRAD.__get__(param)
            if owner is not None and id(param) in owner[1].stepped and grad is not None:
                self._hidden.append((param, grad))
                _TENSOR_GRAD.__set__(param, None)

    @staticmethod
    def _may_change(optimizer: torch.optim.Optimizer, closure: bool) -> frozenset[int]:
        """The storages of the parameters ``optimizer``'s step may change: for torch's own
        optimizers, those with a gradient as it starts (each skips a parameter whose ``.grad``
        is None, weight decay included); all of its parameters when the step is given a
        ``closure`` (whose backward may give any of them one) or the optimizer is another
        library's or the user's, which may change parameters without gradients. A frozen
        weight's device copy then outlives the steps of the adapters beside it."""
        every = closure or not type(optimizer).__module__.startswith(TORCH_OPTIMIZERS)
        return frozenset(p.untyped_storage().data_ptr()
                         for group in optimizer.param_groups for p in group["params"]
                         if every or _TENSOR_GRAD.__get__(p) is not None)

    def _after_optimizer_step(self, optimizer, args, kwargs) -> None:
        if self._adder.on_thread():
            return
        self._optimizer_steps.update(self._changing_now.pop() if self._changing_now
                                     else self._may_change(optimizer, closure=True))
        self._in_step -= 1
        for param, grad in self._hidden:
            if _TENSOR_GRAD.__get__(param) is None:
                _TENSOR_GRAD.__set__(param, grad)
        self._hidden.clear()
        if self._steps_streamed:
            self.backwards = 0
            self._written_after = None
            self._adder.versions.clear()

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
