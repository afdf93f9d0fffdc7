"""Large host buffers on transparent huge pages, which the kernel maps and CUDA pins faster.

A buffer of :func:`host_buffer` is an anonymous mapping advised ``MADV_HUGEPAGE``, its pages
written on :data:`MAPPING_THREADS` threads (zeroes: the first write maps them), and, when asked,
pinned with ``cudaHostRegister``. Mapped 2 MiB at a time instead of 4 KiB, 4 GiB of 256 MiB
buffers pinned at 11.8-12.8 GB/s on the H100 host, against 7.3 GB/s through torch's pinned
allocator on as many threads (``python -m benchmarks.pinning``), with copies to and from the
device as fast. The returned tensor owns its mapping: when the last tensor viewing it is freed,
the mapping is unpinned (after the devices finish what they queued, as a copy into it may still
run) and unmapped.
"""

from __future__ import annotations

import logging
import mmap
import threading

import torch

log = logging.getLogger("storm_compile")

HUGE_PAGE_BYTES = 2 << 20
"""The size of a transparent huge page on x86-64: a buffer smaller than one gains nothing from
the advice, and :func:`host_buffer` leaves it to torch's allocators."""

MAPPING_THREADS = 8
"""Threads that write a new buffer's pages: the kernel zeroes each page it maps, and one thread
zeroes memory at a fraction of the host's bandwidth (the streaming benchmark's host table: a copy
runs at 4.8 GB/s on one thread, 23.9 GB/s on eight)."""


class _Mapping(mmap.mmap):
    """An anonymous mapping that unpins itself before it is unmapped."""

    pinned_at = 0
    """The address ``cudaHostRegister`` pinned (0: not pinned)."""

    def __del__(self) -> None:
        if not self.pinned_at:
            return
        try:
            for device in range(torch.cuda.device_count()):
                torch.cuda.synchronize(device)
            torch.cuda.cudart().cudaHostUnregister(self.pinned_at)
        except Exception as error:   # interpreter shutdown: CUDA may be gone before this runs
            log.debug("unpinning a host buffer failed: %s", error)


def _map_pages(buffer: torch.Tensor) -> None:
    """Write zeroes over ``buffer`` in :data:`MAPPING_THREADS` slices, one thread each."""
    step = -(-buffer.numel() // MAPPING_THREADS)
    threads = [threading.Thread(target=buffer[start:start + step].zero_)
               for start in range(0, buffer.numel(), step)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def host_buffer(nbytes: int, pinned: bool) -> torch.Tensor | None:
    """A zeroed uint8 CPU tensor of ``nbytes`` on transparent huge pages, its pages mapped,
    pinned when ``pinned``; None where it would gain nothing or cannot be made (smaller than
    :data:`HUGE_PAGE_BYTES`, no huge-page advice on this system, or CUDA refused to pin it):
    the caller allocates through torch instead."""
    if nbytes < HUGE_PAGE_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    mapping = _Mapping(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    buffer = torch.frombuffer(mapping, dtype=torch.uint8)
    _map_pages(buffer)
    if pinned:
        error = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 0)
        if int(error) != 0:
            log.debug("cudaHostRegister of %d bytes failed: %s", nbytes, error)
            return None
        mapping.pinned_at = buffer.data_ptr()
    return buffer


def pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` copied into pinned host memory, contiguous: into a :func:`host_buffer` where
    it is large enough, else through torch (``pin_memory``)."""
    buffer = host_buffer(tensor.numel() * tensor.element_size(), pinned=True)
    if buffer is None:
        return tensor.contiguous().pin_memory()
    return buffer.view(tensor.dtype).view(tensor.shape).copy_(tensor)
