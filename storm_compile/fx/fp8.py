"""Offloaded activations held in fp8 on the host (``offload_format="fp8"``): a lossy lever.

A storage compresses when it is a contiguous bf16, fp16 or fp32 tensor of static shape that
packing makes smaller (not a scalar). Its
copies move a packed uint8 tensor: the float32 scale (the tensor's largest magnitude over
:data:`FP8_MAX`, so that it maps to fp8's largest value) in the first :data:`SCALE_BYTES` bytes,
then the tensor divided by the scale in ``float8_e4m3fn`` (1 byte per element: half a bf16's link
bytes, a quarter of a float32's). The backward rebuilds the tensor in its dtype from the
packed bytes. Its relative error is fp8's: 3 mantissa bits, about 2-3 % of a value.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
"""The largest fp8 value: the scale maps a tensor's largest magnitude to it."""
SCALE_DTYPE = torch.float32
SCALE_BYTES = 4
"""Bytes of the float32 scale at the front of a packed tensor: the fp8 values after it start at
an offset any dtype view accepts."""
MIN_SCALE = torch.finfo(SCALE_DTYPE).tiny
"""The scale of an all-zero tensor (zero would divide by zero)."""
COMPRESSIBLE = (torch.bfloat16, torch.float16, torch.float32)


def compresses(value: object, offload_format: str | None) -> bool:
    """Whether an offloaded storage whose tensor is ``value`` is held in fp8 under
    ``offload_format``."""
    return (offload_format == "fp8" and isinstance(value, torch.Tensor)
            and value.dtype in COMPRESSIBLE
            and all(type(s) is int for s in (*value.shape, *value.stride()))
            and value.is_contiguous()
            and value.numel() * (value.element_size() - 1) > SCALE_BYTES)


def link_bytes(value: torch.Tensor, nbytes: int, offload_format: str | None) -> int:
    """Bytes an offload of a storage of ``nbytes`` (its tensor ``value``) moves each way."""
    return SCALE_BYTES + value.numel() if compresses(value, offload_format) else nbytes
