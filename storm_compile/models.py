"""Built-in models, and loading of user models given as ``path/to/file.py:factory``.

``gpt`` is the stack the benchmarks measure: pre-norm transformer blocks with ``nn.RMSNorm``, a
fused QKV projection, causal ``scaled_dot_product_attention``, an output projection and a
SwiGLU MLP.
Its input and output are ``(batch, seq, d_model)`` residual-stream tensors, so the figures
measure the blocks alone (no embedding, final norm or vocabulary projection).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

FFN_MULTIPLE = 256
"""SwiGLU hidden sizes are rounded up to a multiple of this, as Llama does, for matmul tiling."""


def swiglu_hidden(d_model: int) -> int:
    """8/3·d rounded up to FFN_MULTIPLE: ≈2.7×d, the MLP width of the benchmarked stack."""
    return FFN_MULTIPLE * math.ceil(8 * d_model / 3 / FFN_MULTIPLE)


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int, hidden: int, **factory) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm = nn.RMSNorm(d_model, **factory)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False, **factory)
        self.out = nn.Linear(d_model, d_model, bias=False, **factory)
        self.mlp_norm = nn.RMSNorm(d_model, **factory)
        self.gate_up = nn.Linear(d_model, 2 * hidden, bias=False, **factory)
        self.down = nn.Linear(hidden, d_model, bias=False, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split(d_model, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attn.transpose(1, 2).reshape(batch, seq, d_model))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class GPT(nn.Module):
    def __init__(self, d_model: int, layers: int, heads: int, hidden: int, **factory) -> None:
        """``factory``: ``device`` and ``dtype`` for the parameters, as torch.nn layers take."""
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by heads ({heads})")
        self.blocks = nn.ModuleList(Block(d_model, heads, hidden, **factory)
                                    for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@dataclasses.dataclass(frozen=True)
class GPTShape:
    d_model: int = 512
    layers: int = 2
    heads: int = 8
    seq: int = 512
    batch: int = 2
    hidden: int | None = None
    """SwiGLU width; None means :func:`swiglu_hidden` of ``d_model``."""
    dtype: str = "float32"


def build_gpt(shape: GPTShape, device: torch.device | str = "cpu"
              ) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    dtype = getattr(torch, shape.dtype)
    hidden = shape.hidden or swiglu_hidden(shape.d_model)
    model = GPT(shape.d_model, shape.layers, shape.heads, hidden, device=device, dtype=dtype)
    x = torch.randn(shape.batch, shape.seq, shape.d_model, device=device, dtype=dtype,
                    requires_grad=True)
    return model, (x,)


BUILTIN_MODELS = ("gpt",)


class ModelSpecError(ValueError):
    """A model given on the command line cannot be built."""


def load_factory(spec: str) -> tuple[nn.Module, tuple[Any, ...]]:
    """Build ``(model, example_inputs)`` from ``path/to/file.py:factory``."""
    path_text, sep, name = spec.rpartition(":")
    if not sep or not name or not path_text.endswith(".py"):
        raise ModelSpecError(f"model {spec!r}: expected one of {', '.join(BUILTIN_MODELS)} "
                             f"or path/to/file.py:factory")
    path = Path(path_text)
    if not path.is_file():
        raise ModelSpecError(f"model {spec!r}: no such file {str(path)!r}")
    module_spec = importlib.util.spec_from_file_location(f"storm_user_model_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as error:
        raise ModelSpecError(f"model {spec!r}: importing {str(path)!r} failed: "
                             f"{type(error).__name__}: {error}") from error
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ModelSpecError(f"model {spec!r}: {str(path)!r} has no callable {name!r}")
    try:
        result = factory()
    except Exception as error:
        raise ModelSpecError(f"model {spec!r}: {name}() raised {type(error).__name__}: "
                             f"{error}") from error
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module)
            and isinstance(result[1], (tuple, list))):
        raise ModelSpecError(f"model {spec!r}: {name}() must return (torch.nn.Module, "
                             f"tuple of example inputs), got {type(result).__name__}")
    return result[0], tuple(result[1])
