"""Host buffers on transparent huge pages (storm_compile.runtime.host_memory)."""

from __future__ import annotations

import gc

import pytest
import torch

from storm_compile.fx.vocabulary import MIB
from storm_compile.runtime import host_memory
from storm_compile.runtime.host_memory import HUGE_PAGE_BYTES, host_buffer, pinned_copy
from storm_compile.runtime.streams import PinnedPool, _zeros_like

BYTES = 3 * HUGE_PAGE_BYTES + 12345
"""Not a whole number of huge pages nor of threads' slices: the last slice is shorter."""


def test_a_host_buffer_is_zeroed_writable_and_unpinned_when_not_asked_to_pin():
    buffer = host_buffer(BYTES, pinned=False)
    assert buffer is not None and buffer.dtype == torch.uint8 and buffer.numel() == BYTES
    assert not buffer.is_pinned() and int(buffer.count_nonzero()) == 0
    buffer[-1] = 7
    assert int(buffer[-1]) == 7


def test_a_buffer_smaller_than_a_huge_page_is_left_to_torch():
    assert host_buffer(HUGE_PAGE_BYTES - 1, pinned=False) is None


def test_the_mapping_lives_while_any_view_of_the_buffer_does(monkeypatch):
    released = []
    monkeypatch.setattr(host_memory._Mapping, "__del__", lambda self: released.append(self))
    buffer = host_buffer(BYTES, pinned=False)
    view = buffer[MIB:2 * MIB].view(torch.float32)
    view.fill_(1.0)
    del buffer
    gc.collect()
    assert not released and float(view.sum()) == MIB / 4
    del view
    gc.collect()
    assert len(released) == 1


def test_a_gradient_buffer_is_zeros_shaped_like_its_parameter_small_or_large():
    for shape in [(3, 5), (1024, 1024)]:
        param = torch.nn.Parameter(torch.randn(shape, dtype=torch.bfloat16))
        zeros = _zeros_like(param)
        assert zeros.shape == param.shape and zeros.dtype == param.dtype
        assert zeros.is_contiguous() and int(zeros.count_nonzero()) == 0


@pytest.mark.gpu
def test_a_pinned_host_buffer_copies_both_ways_and_is_unpinned_when_freed():
    buffer = host_buffer(BYTES, pinned=True)
    assert buffer is not None and buffer.is_pinned()
    source = torch.randint(0, 255, (BYTES,), dtype=torch.uint8, device="cuda")
    buffer.copy_(source, non_blocking=True)
    back = torch.empty_like(source).copy_(buffer, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, source)
    address = buffer.data_ptr()
    pool = PinnedPool()
    pooled = pool.acquire(BYTES, limit=1 << 30)
    assert pooled is not None and pooled.is_pinned()
    del buffer
    gc.collect()
    again = torch.cuda.cudart().cudaHostUnregister(address)
    assert int(again) != 0, "the freed buffer was still registered"


@pytest.mark.gpu
def test_a_pinned_copy_holds_the_tensors_values_contiguous_large_or_small():
    for tensor in [torch.randn(2048, 1024, dtype=torch.bfloat16).t(), torch.randn(3, 5)]:
        copy = pinned_copy(tensor)
        assert copy.is_pinned() and copy.is_contiguous() and torch.equal(copy, tensor)
