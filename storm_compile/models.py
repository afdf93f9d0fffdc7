"""Built-in models, and loading of user models given as ``path/to/file.py:factory``.

``llama`` is a Llama-style decoder (GQA, RoPE, SwiGLU, RMSNorm) with named presets of real shapes
(:data:`LLAMA_PRESETS`: 1b, 3b, 8b, and a tiny one for tests), returning its training loss.

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


class ModelSpecError(ValueError):
    """A model given on the command line, or a gpt shape, cannot be built or traced."""


FLOAT_DTYPES = ("float32", "bfloat16", "float16", "float64")
"""Parameter and activation dtypes of the built-in gpt: training needs floating point."""


@dataclasses.dataclass(frozen=True)
class GPTShape:
    """Shape of the built-in gpt. The defaults are the first benchmark configuration
    (d2048/T2048/L8/B4, bf16), so ``storm schedule gpt`` shows what storm's defaults do there:
    without a budget, offloads may spend 1 % of the predicted step (half of ``max_overhead``) and
    each storage moved costs 178 µs of host time on the h100 profile, so its ~35 ms step moves
    a storage where four of these layers (~18 ms) would move none."""

    d_model: int = 2048
    layers: int = 8
    heads: int = 16
    seq: int = 2048
    batch: int = 4
    hidden: int | None = None
    """SwiGLU width; None means :func:`swiglu_hidden` of ``d_model``."""
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        sizes = ("d_model", "layers", "heads", "seq", "batch",
                 *(("hidden",) if self.hidden is not None else ()))
        for name in sizes:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ModelSpecError(f"gpt {name} must be a positive int, got {value!r}")
        if self.d_model % self.heads:
            raise ModelSpecError(f"gpt d_model ({self.d_model}) must be divisible by heads "
                                 f"({self.heads})")
        if self.dtype not in FLOAT_DTYPES:
            raise ModelSpecError(f"gpt dtype must be one of {', '.join(FLOAT_DTYPES)}, "
                                 f"got {self.dtype!r}")


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


@dataclasses.dataclass(frozen=True)
class LlamaShape:
    """Shape of the built-in Llama-style model: a token embedding, blocks of grouped-query
    attention with rotary positions and a SwiGLU MLP behind RMSNorms, a final norm and the
    vocabulary projection; ``seq`` and ``batch`` size the example batch."""

    d_model: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    vocab: int
    tie_embeddings: bool = False
    seq: int = 2048
    batch: int = 1
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for name in ("d_model", "layers", "hidden", "heads", "kv_heads", "vocab", "seq",
                     "batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ModelSpecError(f"llama {name} must be a positive int, got {value!r}")
        if self.d_model % self.heads or self.heads % self.kv_heads \
                or (self.d_model // self.heads) % 2:
            raise ModelSpecError(f"llama d_model ({self.d_model}) must split into heads "
                                 f"({self.heads}) of even width, in groups of kv_heads "
                                 f"({self.kv_heads})")
        if self.dtype not in FLOAT_DTYPES:
            raise ModelSpecError(f"llama dtype must be one of {', '.join(FLOAT_DTYPES)}, "
                                 f"got {self.dtype!r}")

    @property
    def parameters(self) -> int:
        """Parameter count (weights of every Linear, embedding and norm)."""
        head = self.d_model // self.heads
        attention = self.d_model * head * (2 * self.heads + 2 * self.kv_heads)
        block = attention + 3 * self.d_model * self.hidden + 2 * self.d_model
        vocab = self.vocab * self.d_model * (1 if self.tie_embeddings else 2)
        return self.layers * block + vocab + self.d_model


LLAMA_PRESETS: dict[str, LlamaShape] = {
    # Llama 3.2 1B.
    "1b": LlamaShape(d_model=2048, layers=16, hidden=8192, heads=32, kv_heads=8, vocab=128256,
                     tie_embeddings=True),
    # Llama 3.2 3B.
    "3b": LlamaShape(d_model=3072, layers=28, hidden=8192, heads=24, kv_heads=8, vocab=128256,
                     tie_embeddings=True),
    # Llama 3.1 8B.
    "8b": LlamaShape(d_model=4096, layers=32, hidden=14336, heads=32, kv_heads=8,
                     vocab=128256),
    # A few MiB, for tests and CPU runs.
    "tiny": LlamaShape(d_model=64, layers=2, hidden=176, heads=4, kv_heads=2, vocab=256,
                       seq=32, batch=2, dtype="float32"),
}


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


BUILTIN_MODELS = ("gpt", "llama")


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
