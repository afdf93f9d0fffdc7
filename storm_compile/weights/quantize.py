"""Frozen weights held in host memory in 8 or 4 bits, and turned back into their dtype on the
device.

A frozen weight streamed from host memory crosses the link in the forward and again in the
backward and sends no gradient home, so its bytes set the speed of a fine-tuning step that
trains adapters over it. :func:`quantize` packs a weight into one flat ``uint8`` host tensor
(one copy per read, whatever the format) and :func:`dequantize` rebuilds it with plain torch ops,
which Inductor fuses into one kernel after the copy:

* ``"int8"``: one signed byte per element and one float32 scale per output channel (row): the
  row's largest magnitude over 127.
* ``"nf4"``: 4 bits per element, two to a byte, indexing the 16 values of the NF4 code book
  (quantiles of a normal distribution, as QLoRA defines them), in blocks of
  :data:`NF4_BLOCK` elements of the flattened weight, each with a float32 scale: the block's
  largest magnitude.

The packed layout is ``[codes | padding to 4 bytes | float32 scales]``. The gradient reaching
the rebuilt weight flows on to nothing (the weight is frozen); its input and any adapter beside
it get the same gradients as through the rebuilt weight used directly.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from storm_compile.fx.torch_private import FakeTensor

HostFormat = Literal["int8", "nf4"]
FORMATS: tuple[str, ...] = ("int8", "nf4")

NF4_BLOCK = 64
"""Elements per NF4 block: QLoRA's block size; a float32 scale per block adds 0.5 bit per
element."""

NF4_CODE = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
            -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
            0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
            0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)
"""The NF4 code book (QLoRA, Dettmers et al. 2023): 16 values in [-1, 1] with an exact 0."""

INT8_LEVELS = 127
"""Largest int8 code: symmetric absmax scaling uses -127..127."""

SCALE_ALIGN = 4
"""Byte alignment of the float32 scales after the codes, so the device reads them as a view."""

_SCALE_DTYPE = torch.float32
_TINY = torch.finfo(torch.float32).tiny
"""Floor of a scale, so an all-zero row or block divides by no zero."""


class StormQuantizeError(ValueError):
    """A weight that cannot be held in the asked host format."""


@dataclasses.dataclass(frozen=True)
class Packed:
    """How a weight was packed: enough to rebuild it from the flat bytes."""

    format: HostFormat
    shape: tuple[int, ...]
    dtype: torch.dtype
    """The weight's dtype, which :func:`dequantize` returns."""

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    @property
    def code_bytes(self) -> int:
        return self.numel if self.format == "int8" else self.numel // 2

    @property
    def scales(self) -> int:
        return self.shape[0] if self.format == "int8" else self.numel // NF4_BLOCK

    @property
    def scale_offset(self) -> int:
        return -(-self.code_bytes // SCALE_ALIGN) * SCALE_ALIGN

    @property
    def nbytes(self) -> int:
        """Bytes of the packed host tensor (what crosses the link)."""
        return self.scale_offset + self.scales * _SCALE_DTYPE.itemsize


def check(format: str, shape: tuple[int, ...], name: str) -> None:
    """Raise :class:`StormQuantizeError` when a weight of ``shape`` cannot be held in
    ``format``."""
    if format not in FORMATS:
        raise StormQuantizeError(f"{name}: unknown host format {format!r}; known: "
                                 f"{', '.join(FORMATS)}")
    if len(shape) < 2:
        raise StormQuantizeError(f"{name}: {format} holds weight matrices (2 or more "
                                 f"dimensions), not a tensor of shape {tuple(shape)}")
    count = 1
    for size in shape:
        count *= size
    if format == "nf4" and count % NF4_BLOCK:
        raise StormQuantizeError(f"{name}: nf4 packs blocks of {NF4_BLOCK} elements; "
                                 f"{tuple(shape)} has {count}")


def quantize(weight: torch.Tensor, format: HostFormat) -> tuple[torch.Tensor, Packed]:
    """``weight`` packed in ``format`` as a flat ``uint8`` tensor on its device, and its
    :class:`Packed` description. Works a row block at a time, so a large weight needs little
    more than its packed size besides itself."""
    check(format, tuple(weight.shape), "quantize")
    packed = Packed(format, tuple(weight.shape), weight.dtype)
    out = torch.empty(packed.nbytes, dtype=torch.uint8, device=weight.device)
    if weight.is_meta or isinstance(weight, FakeTensor):
        return out, packed          # no values to pack: a model planned, never run
    scales = out[packed.scale_offset:].view(_SCALE_DTYPE)
    flat = weight.detach().reshape(packed.shape[0], -1)
    if format == "int8":
        codes = out[:packed.code_bytes].view(torch.int8).view(flat.shape)
        for rows in _row_blocks(flat.shape[0]):
            part = flat[rows].float()
            scale = (part.abs().amax(1) / INT8_LEVELS).clamp_min(_TINY)
            codes[rows] = torch.round(part / scale[:, None]).clamp(
                -INT8_LEVELS, INT8_LEVELS).to(torch.int8)
            scales[rows] = scale
        return out, packed
    blocks = flat.reshape(-1, NF4_BLOCK)
    code = torch.tensor(NF4_CODE, device=weight.device)
    pairs = out[:packed.code_bytes].view(-1, NF4_BLOCK // 2)
    for rows in _row_blocks(blocks.shape[0]):
        part = blocks[rows].float()
        scale = part.abs().amax(1).clamp_min(_TINY)
        index = (part[..., None] / scale[:, None, None] - code).abs().argmin(-1).to(torch.uint8)
        pairs[rows] = (index[:, 0::2] << 4) | index[:, 1::2]
        scales[rows] = scale
    return out, packed


QUANTIZE_ROWS = 4096
"""Rows (or NF4 blocks) quantized at a time: bounds the float32 temporaries (an NF4 block row
compares against all 16 code values) to a few MiB whatever the weight's size."""


def _row_blocks(count: int) -> list[slice]:
    return [slice(start, min(start + QUANTIZE_ROWS, count))
            for start in range(0, count, QUANTIZE_ROWS)]


def dequantize(data: torch.Tensor, packed: Packed) -> torch.Tensor:
    """The weight ``data`` (from :func:`quantize`) holds, in ``packed.dtype`` on ``data``'s
    device: plain torch ops, traced into the graph for Inductor to fuse."""
    scales = data[packed.scale_offset:packed.nbytes].view(_SCALE_DTYPE)
    codes = data[:packed.code_bytes]
    if packed.format == "int8":
        rows = codes.view(torch.int8).view(packed.shape[0], -1)
        return (rows.float() * scales[:, None]).to(packed.dtype).view(packed.shape)
    pairs = codes.view(-1, NF4_BLOCK // 2)
    index = torch.stack([pairs >> 4, pairs & 0xF], dim=-1).view(-1, NF4_BLOCK).long()
    code = torch.tensor(NF4_CODE, device=data.device)
    return (code[index] * scales[:, None]).to(packed.dtype).view(packed.shape)

