"""Built-in models, and loading of user models given as ``path/to/file.py:factory``.

``llama`` is a Llama-style decoder (GQA, RoPE, SwiGLU, RMSNorm) with named presets of real shapes
(:data:`LLAMA_PRESETS`: 1b, 3b, 8b, 70b, and a tiny one for tests), returning its training
loss. :func:`add_lora` freezes a model and puts low-rank adapters beside every linear layer
(LoRA), the fine-tuning that frozen host formats (:mod:`storm_compile.weights.quantize`) serve.

``gpt`` is the stack the benchmarks measure: pre-norm transformer blocks with ``nn.RMSNorm``, a
fused QKV projection, causal ``scaled_dot_product_attention``, an output projection and a
SwiGLU MLP.
Its input and output are ``(batch, seq, d_model)`` residual-stream tensors, so the figures
measure the blocks alone (no embedding, final norm or vocabulary projection).

The shapes they are built from are defined in :mod:`storm_compile.cli.shapes`, which imports no
torch, for the command line's help; they are importable from here too.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from storm_compile.cli.shapes import (  # noqa: F401  (re-exported, as they were defined here)
    BUILTIN_MODELS,
    FFN_MULTIPLE,
    FLOAT_DTYPES,
    LLAMA_PRESETS,
    GPTShape,
    LlamaShape,
    ModelSpecError,
    swiglu_hidden,
)


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


def build_gpt(shape: GPTShape, device: torch.device | str = "cpu"
              ) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    dtype = getattr(torch, shape.dtype)
    hidden = shape.hidden or swiglu_hidden(shape.d_model)
    model = GPT(shape.d_model, shape.layers, shape.heads, hidden, device=device, dtype=dtype)
    x = torch.randn(shape.batch, shape.seq, shape.d_model, device=device, dtype=dtype,
                    requires_grad=True)
    return model, (x,)


ROPE_THETA = 500_000.0
"""Rotary embedding base of Llama 3."""
NORM_EPS = 1e-5
INIT_STD = 0.02
"""Standard deviation of every weight matrix and the embedding at initialisation (Llama's):
with PyTorch's default embedding init (std 1) tied to the output projection, the first loss is
in the thousands instead of near ln(vocab)."""


def rotary(seq: int, head: int, device: torch.device | str | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine and sine of the rotary angles, ``(seq, head // 2)`` each, in float32."""
    frequencies = ROPE_THETA ** -(torch.arange(0, head, 2, device=device,
                                               dtype=torch.float32) / head)
    angles = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), frequencies)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of ``x``'s last dimension (``(batch, heads, seq, head)``) by the angles."""
    even, odd = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class LlamaBlock(nn.Module):
    def __init__(self, shape: LlamaShape, **factory) -> None:
        super().__init__()
        self.heads, self.kv_heads = shape.heads, shape.kv_heads
        head = shape.d_model // shape.heads
        self.attn_norm = nn.RMSNorm(shape.d_model, eps=NORM_EPS, **factory)
        self.q = nn.Linear(shape.d_model, shape.heads * head, bias=False, **factory)
        self.k = nn.Linear(shape.d_model, shape.kv_heads * head, bias=False, **factory)
        self.v = nn.Linear(shape.d_model, shape.kv_heads * head, bias=False, **factory)
        self.o = nn.Linear(shape.heads * head, shape.d_model, bias=False, **factory)
        self.mlp_norm = nn.RMSNorm(shape.d_model, eps=NORM_EPS, **factory)
        self.gate = nn.Linear(shape.d_model, shape.hidden, bias=False, **factory)
        self.up = nn.Linear(shape.d_model, shape.hidden, bias=False, **factory)
        self.down = nn.Linear(shape.hidden, shape.d_model, bias=False, **factory)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        h = self.attn_norm(x)
        q = self.q(h).view(batch, seq, self.heads, -1).transpose(1, 2)
        k = self.k(h).view(batch, seq, self.kv_heads, -1).transpose(1, 2)
        v = self.v(h).view(batch, seq, self.kv_heads, -1).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(attn.transpose(1, 2).reshape(batch, seq, -1))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    """Llama-style decoder; ``forward(tokens, targets)`` returns the mean next-token
    cross-entropy, ``forward(tokens)`` the logits."""

    def __init__(self, shape: LlamaShape, **factory) -> None:
        super().__init__()
        self.head_dim = shape.d_model // shape.heads
        self.embed = nn.Embedding(shape.vocab, shape.d_model, **factory)
        self.blocks = nn.ModuleList(LlamaBlock(shape, **factory) for _ in range(shape.layers))
        self.norm = nn.RMSNorm(shape.d_model, eps=NORM_EPS, **factory)
        self.lm_head = nn.Linear(shape.d_model, shape.vocab, bias=False, **factory)
        if shape.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=INIT_STD)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None
                ) -> torch.Tensor:
        cos, sin = rotary(tokens.shape[1], self.head_dim, tokens.device)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def build_llama(shape: LlamaShape, device: torch.device | str = "cpu"
                ) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The model and an example batch ``(tokens, targets)`` of random token ids."""
    model = Llama(shape, device=device, dtype=getattr(torch, shape.dtype))
    tokens = torch.randint(shape.vocab, (shape.batch, shape.seq + 1), device=device)
    return model, (tokens[:, :-1], tokens[:, 1:])


class LoRALinear(nn.Module):
    """A frozen linear layer with a trainable low-rank update beside it: ``base(x) + x A^T B^T``
    (A: rank × in, B: out × rank). Both factors start random (not B = 0 as in training
    recipes), so every adapter's gradient is non-zero from the first step."""

    def __init__(self, base: nn.Linear, rank: int) -> None:
        super().__init__()
        self.base = base
        factory = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.a = nn.Parameter(torch.randn(rank, base.in_features, **factory) / base.in_features)
        self.b = nn.Parameter(torch.randn(base.out_features, rank, **factory) / rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.a.t() @ self.b.t()


def add_lora(model: nn.Module, rank: int) -> nn.Module:
    """Freeze ``model`` and replace each of its ``nn.Linear`` layers by a :class:`LoRALinear`
    of ``rank``, in place; returns ``model``."""
    model.requires_grad_(False)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, LoRALinear(child, rank))
    return model


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
