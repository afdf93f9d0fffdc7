"""Offloaded activations held in fp8 on the host (``offload_format="fp8"``): a lossy lever.

A storage compresses when it is a contiguous bf16, fp16 or fp32 tensor of static shape that
packing makes smaller. Its copies move a packed uint8 tensor: one byte holding the
exponent of its power-of-two scale (the least power of two that brings the tensor's largest
magnitude within :data:`FP8_MAX`), offset by :data:`EXPONENT_BIAS`, then the tensor over the scale
in ``float8_e4m3fn`` (1 byte per element: half a bf16's link bytes, a quarter of a float32's).
The backward rebuilds the tensor in its dtype from the packed bytes. A power of two scales
exactly, and every step is pointwise, so Inductor fuses the packing into one kernel and the
rebuilding into its reader. Its relative error is fp8's: 3 mantissa bits, about 2-3 % of a
value; a tensor holding an infinity or a NaN comes back as NaNs.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
"""The largest fp8 value: the scale brings a tensor's largest magnitude within it."""
SCALE_DTYPE = torch.float32
"""The dtype the packing divides in and the rebuilding multiplies in."""
SCALE_BYTES = 1
"""Bytes of the scale's exponent at the front of a packed tensor."""
EXPONENT_BIAS = 127
"""Added to the scale's exponent, which is clamped to [-127, 127], so that it is stored as a
byte in [0, 254]."""
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
