"""The shapes of the built-in models, their presets and dtypes, and the names of the built-in
models: plain records that import no torch, so the command line's parser names them in its help
and ``storm --help`` prints without loading torch. :mod:`storm_compile.cli.models` builds the models
from them.
"""

from __future__ import annotations

import dataclasses
import math

FFN_MULTIPLE = 256
"""SwiGLU hidden sizes are rounded up to a multiple of this, as Llama does, for matmul tiling."""


def swiglu_hidden(d_model: int) -> int:
    """8/3·d rounded up to FFN_MULTIPLE: ≈2.7×d, the MLP width of the benchmarked stack."""
    return FFN_MULTIPLE * math.ceil(8 * d_model / 3 / FFN_MULTIPLE)


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
    # Llama 3.1 70B.
    "70b": LlamaShape(d_model=8192, layers=80, hidden=28672, heads=64, kv_heads=8,
                      vocab=128256),
    # A few MiB, for tests and CPU runs.
    "tiny": LlamaShape(d_model=64, layers=2, hidden=176, heads=4, kv_heads=2, vocab=256,
                       seq=32, batch=2, dtype="float32"),
}

BUILTIN_MODELS = ("gpt", "llama")
"""The models storm builds itself; any other model is given as ``path/to/file.py:factory``."""
