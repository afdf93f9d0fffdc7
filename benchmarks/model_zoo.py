"""A zoo of realistic architectures, in plain torch, for testing and measuring storm on the
graphs people actually train.

Each model is a small readable ``nn.Module`` of a family trained with ``torch.compile`` today,
chosen for what it puts in the captured graphs:

- ``llama``: RMSNorm, RoPE, grouped-query attention (``repeat_interleave`` of k/v heads), SwiGLU,
  untied LM head, next-token cross-entropy;
- ``gpt2``: learned positions, LayerNorm, GELU MLP, tied embeddings, and a loss behind a graph
  break (two compiled graphs per step);
- ``vit``: Conv2d patches, class token, timm's fused-QKV ``reshape/permute/unbind``, MLP head;
- ``moe``: top-2 routed experts with data-dependent token counts (graph breaks, dynamic sizes);
- ``unet``: conv encoder/decoder, GroupNorm, SiLU, concatenated skips, interpolate, MSE loss;
- ``resnet``: basic blocks with BatchNorm in train mode (running statistics are buffers);
- ``checkpointed``: transformer blocks with dropout, each under non-reentrant
  ``torch.utils.checkpoint``;
- ``dict_output``: an encoder classifier returning a Hugging Face style dict with its loss.

Two sizes: ``tiny`` (CPU, fp32: a step through AOTAutograd in well under a second; used by
``tests/test_zoo.py``) and ``bench`` (one H100, bf16: tens of ms per step, a few GiB of
activations; used by ``benchmarks/zoo_memory.py`` and ``benchmarks/training_loop.py``).
Models are built on the CPU in fp32 and then moved, so a seed gives the same weights on every
device and dtype.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

Size = Literal["tiny", "bench"]

EXAMPLE_SEED = 0
"""Seed of the example inputs a case carries (``case.inputs == case.batch(EXAMPLE_SEED)``)."""
ROPE_BASE = 10_000.0
DROPOUT = 0.1
"""GPT-2's residual dropout; in ``checkpointed`` it makes each block draw random numbers."""
EMBEDDING_STD = 0.02
"""GPT-2's and BERT's initialisation of embeddings: with N(0, 1) a tied head's logits reach
hundreds and the first loss is tens of nats instead of about ln(vocab)."""
TOP_K = 2
"""Experts each token is routed to (Mixtral's choice)."""

SIZES: dict[str, dict[Size, dict[str, Any]]] = {
    # tiny seq 64: tests/test_gpu_training.py slices it to 48, 56 and 64 tokens.
    # bench: a 0.5 B-parameter Llama (d2048, 8 layers, GQA 16/4 heads, SwiGLU 5632).
    "llama": {
        "tiny": dict(vocab=128, d_model=64, layers=2, heads=4, kv_heads=2, hidden=128,
                     seq=64, batch=2),
        "bench": dict(vocab=32_000, d_model=2048, layers=8, heads=16, kv_heads=4,
                      hidden=5632, seq=2048, batch=2),
    },
    # bench: GPT-2 small (124 M) at nanoGPT's shape, vocabulary padded to a multiple of 64.
    "gpt2": {
        "tiny": dict(vocab=128, d_model=64, layers=2, heads=4, seq=32, batch=2),
        "bench": dict(vocab=50_304, d_model=768, layers=12, heads=12, seq=1024, batch=8),
    },
    # bench: ViT-B/16 on 224x224 ImageNet images.
    "vit": {
        "tiny": dict(image=16, patch=4, d_model=64, layers=2, heads=4, classes=10, batch=4),
        "bench": dict(image=224, patch=16, d_model=768, layers=12, heads=12, classes=1000,
                      batch=64),
    },
    # bench: a Mixtral-like 8-expert model, d1024, 4 layers.
    "moe": {
        "tiny": dict(vocab=128, d_model=64, layers=1, heads=4, kv_heads=2, experts=4,
                     hidden=64, seq=32, batch=2),
        "bench": dict(vocab=32_000, d_model=1024, layers=4, heads=16, kv_heads=4, experts=8,
                      hidden=2816, seq=2048, batch=4),
    },
    # bench: a diffusion-style U-Net (channels 64..512, GroupNorm's usual 32 groups) on
    # 256x256 images; tiny: 4 groups, as 8 channels do not divide into 32.
    "unet": {
        "tiny": dict(image=16, channels=(8, 16, 32), groups=4, batch=2),
        "bench": dict(image=256, channels=(64, 128, 256, 512), groups=32, batch=16),
    },
    # tiny: 64x64 images leave 16x16 maps after the stem's two stride-2 steps.
    # bench: ResNet-18 on 224x224 ImageNet images.
    "resnet": {
        "tiny": dict(image=64, widths=(8, 16, 32), blocks=(1, 1, 1), classes=10, batch=4),
        "bench": dict(image=224, widths=(64, 128, 256, 512), blocks=(2, 2, 2, 2),
                      classes=1000, batch=256),
    },
    # bench: storm's first benchmark configuration (d2048/T2048/L8/B4).
    "checkpointed": {
        "tiny": dict(d_model=64, layers=2, heads=4, seq=32, batch=2),
        "bench": dict(d_model=2048, layers=8, heads=16, seq=2048, batch=4),
    },
    # bench: BERT-base sequence classification at 512 tokens.
    "dict_output": {
        "tiny": dict(vocab=128, d_model=64, layers=2, heads=4, classes=4, seq=32, batch=2),
        "bench": dict(vocab=30_522, d_model=768, layers=12, heads=12, classes=2, seq=512,
                      batch=32),
    },
}


@dataclasses.dataclass
class ZooCase:
    """A model, example inputs of one training step, and how its output becomes the loss."""

    model: nn.Module
    inputs: tuple
    """Example inputs of one training step: ``batch(EXAMPLE_SEED)``."""
    loss: Callable[[Any], torch.Tensor]
    """Model output -> scalar loss."""
    sample: Callable[[torch.Generator], tuple] = dataclasses.field(repr=False)
    """CPU inputs (fp32 or int64) drawn from a generator; ``batch`` moves and casts them."""
    device: torch.device
    dtype: torch.dtype

    def batch(self, seed: int) -> tuple:
        """Fresh inputs of the same kind as ``inputs``, the same for the same ``seed``."""
        generator = torch.Generator().manual_seed(seed)
        return tuple(t.to(self.device, self.dtype) if t.is_floating_point()
                     else t.to(self.device) for t in self.sample(generator))


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each position's logits against the following token (in fp32)."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


# --- llama -------------------------------------------------------------------------------------

class Rotary(nn.Module):
    """Rotary position embedding (the rotate-half form) of ``(batch, heads, seq, head_dim)``."""

    def __init__(self, head_dim: int, max_seq: int) -> None:
        super().__init__()
        inv_freq = ROPE_BASE ** (-torch.arange(0, head_dim, 2).float() / head_dim)
        angles = torch.outer(torch.arange(max_seq).float(), inv_freq).repeat(1, 2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[-2]
        first, second = x.chunk(2, dim=-1)
        rotated = torch.cat((-second, first), dim=-1)
        return x * self.cos[:seq] + rotated * self.sin[:seq]


class GroupedQueryAttention(nn.Module):
    """Causal attention with ``kv_heads`` key/value heads shared by ``heads`` query heads."""

    def __init__(self, d_model: int, heads: int, kv_heads: int, max_seq: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, d_model // heads
        self.q = nn.Linear(d_model, heads * self.head_dim, bias=False)
        self.k = nn.Linear(d_model, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(d_model, kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(heads * self.head_dim, d_model, bias=False)
        self.rotary = Rotary(self.head_dim, max_seq)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q(x).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.rotary(q), self.rotary(k)
        repeats = self.heads // self.kv_heads
        k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(batch, seq, -1))


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, hidden, bias=False)
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nn.Module):
    """Pre-norm block: RMSNorm, attention, RMSNorm, ``mlp`` (SwiGLU, or experts in ``moe``)."""

    def __init__(self, d_model: int, heads: int, kv_heads: int, max_seq: int,
                 mlp: nn.Module) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(d_model)
        self.attn = GroupedQueryAttention(d_model, heads, kv_heads, max_seq)
        self.mlp_norm = nn.RMSNorm(d_model)
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class CausalLM(nn.Module):
    """Token embedding, blocks, final RMSNorm, untied LM head; returns the next-token loss."""

    def __init__(self, vocab: int, d_model: int, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.RMSNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return next_token_loss(self.head(self.norm(x)), ids)


def _token_ids(vocab: int, batch: int, seq: int) -> Callable[[torch.Generator], tuple]:
    return lambda g: (torch.randint(0, vocab, (batch, seq), generator=g),)


def _returned_loss(out: torch.Tensor) -> torch.Tensor:
    """The loss of a model that computes it in its forward."""
    return out


def llama(vocab, d_model, layers, heads, kv_heads, hidden, seq, batch):
    blocks = [LlamaBlock(d_model, heads, kv_heads, seq, SwiGLU(d_model, hidden))
              for _ in range(layers)]
    return CausalLM(vocab, d_model, blocks), _token_ids(vocab, batch, seq), _returned_loss


# --- gpt2, vit, checkpointed, dict_output: LayerNorm transformer blocks ------------------------

class Attention(nn.Module):
    """Multi-head self-attention with a fused QKV projection, split as timm's ViT does."""

    def __init__(self, d_model: int, heads: int, causal: bool) -> None:
        super().__init__()
        self.heads, self.causal = heads, causal
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, d_model = x.shape
        qkv = self.qkv(x).reshape(batch, tokens, 3, self.heads, d_model // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(out.transpose(1, 2).reshape(batch, tokens, d_model))


class Block(nn.Module):
    """Pre-norm block: LayerNorm, attention, LayerNorm, GELU MLP (4x), residual dropout."""

    def __init__(self, d_model: int, heads: int, causal: bool, dropout: float = 0.0) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(d_model)
        self.attn = Attention(d_model, heads, causal)
        self.mlp_norm = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.attn_norm(x)))
        return x + self.drop(self.mlp(self.mlp_norm(x)))


def gpt2_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The next-token loss, behind a graph break: it stands for the logging (``.item()``,
    ``print``) real loss code does, and makes Dynamo compile the step as two graphs."""
    torch._dynamo.graph_break()
    return next_token_loss(logits, labels)


class GPT2(nn.Module):
    """GPT-2: token and learned position embeddings, causal blocks, final LayerNorm, and an LM
    head tied to the token embedding. Returns ``(loss, logits)`` as Hugging Face's does."""

    def __init__(self, vocab: int, d_model: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(seq, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads, causal=True) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        for embedding in (self.wte, self.wpe):
            nn.init.normal_(embedding.weight, std=EMBEDDING_STD)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.wte(ids) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.norm(x), self.wte.weight)
        return gpt2_loss(logits, labels), logits


def _first(out: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return out[0]


def gpt2(vocab, d_model, layers, heads, seq, batch):
    def sample(g: torch.Generator) -> tuple:
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        return ids, ids.clone()

    return GPT2(vocab, d_model, layers, heads, seq), sample, _first


class ViT(nn.Module):
    """Vision transformer: Conv2d patch embedding, class token, learned positions,
    bidirectional blocks, final LayerNorm, MLP head on the class token, cross-entropy."""

    def __init__(self, image: int, patch: int, d_model: int, layers: int, heads: int,
                 classes: int) -> None:
        super().__init__()
        self.patches = nn.Conv2d(3, d_model, kernel_size=patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, d_model))
        self.pos = nn.Parameter(0.02 * torch.randn(1, (image // patch) ** 2 + 1, d_model))
        self.blocks = nn.ModuleList(Block(d_model, heads, causal=False) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Sequential(nn.Linear(d_model, d_model), nn.Tanh(),
                                  nn.Linear(d_model, classes))

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.patches(images).flatten(2).transpose(1, 2)
        x = torch.cat((self.cls.expand(x.shape[0], -1, -1), x), dim=1) + self.pos
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.norm(x)[:, 0]), labels)


def _images_and_labels(batch: int, image: int, classes: int
                       ) -> Callable[[torch.Generator], tuple]:
    return lambda g: (torch.randn(batch, 3, image, image, generator=g),
                      torch.randint(0, classes, (batch,), generator=g))


def vit(image, patch, d_model, layers, heads, classes, batch):
    return (ViT(image, patch, d_model, layers, heads, classes),
            _images_and_labels(batch, image, classes), _returned_loss)


class Checkpointed(nn.Module):
    """Causal blocks with dropout, each run under non-reentrant activation checkpointing, on
    ``(batch, seq, d_model)`` residual-stream inputs."""

    def __init__(self, d_model: int, layers: int, heads: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d_model, heads, causal=True, dropout=DROPOUT)
                                    for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return x


def _mean_square(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def checkpointed(d_model, layers, heads, seq, batch):
    return (Checkpointed(d_model, layers, heads),
            lambda g: (torch.randn(batch, seq, d_model, generator=g),), _mean_square)


class EncoderClassifier(nn.Module):
    """BERT-style sequence classifier returning ``{"logits", "hidden", "loss"}`` as Hugging
    Face models do: the loss is computed inside, from the labels given with the ids."""

    def __init__(self, vocab: int, d_model: int, layers: int, heads: int, classes: int,
                 seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads, causal=False) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.classifier = nn.Linear(d_model, classes)
        for embedding in (self.embed, self.pos):
            nn.init.normal_(embedding.weight, std=EMBEDDING_STD)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.embed(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        hidden = self.norm(x)
        logits = self.classifier(hidden[:, 0])
        return {"logits": logits, "hidden": hidden, "loss": F.cross_entropy(logits, labels)}


def _loss_entry(out: dict[str, torch.Tensor]) -> torch.Tensor:
    return out["loss"]


def dict_output(vocab, d_model, layers, heads, classes, seq, batch):
    def sample(g: torch.Generator) -> tuple:
        return (torch.randint(0, vocab, (batch, seq), generator=g),
                torch.randint(0, classes, (batch,), generator=g))

    return EncoderClassifier(vocab, d_model, layers, heads, classes, seq), sample, _loss_entry


# --- moe ---------------------------------------------------------------------------------------

class MixtureOfExperts(nn.Module):
    """Top-2 routed SwiGLU experts: each expert runs on the tokens routed to it (a data-dependent
    count), weighted by the softmax of the two chosen router logits, summed with ``index_add_``."""

    def __init__(self, d_model: int, hidden: int, experts: int) -> None:
        super().__init__()
        self.router = nn.Linear(d_model, experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(d_model, hidden) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        scores, chosen = torch.topk(self.router(tokens), TOP_K, dim=-1)
        weights = scores.softmax(dim=-1)
        out = torch.zeros_like(tokens)
        for index, expert in enumerate(self.experts):
            token, slot = (chosen == index).nonzero(as_tuple=True)
            out.index_add_(0, token, expert(tokens[token]) * weights[token, slot, None])
        return out.view_as(x)


def moe(vocab, d_model, layers, heads, kv_heads, experts, hidden, seq, batch):
    blocks = [LlamaBlock(d_model, heads, kv_heads, seq,
                         MixtureOfExperts(d_model, hidden, experts)) for _ in range(layers)]
    return CausalLM(vocab, d_model, blocks), _token_ids(vocab, batch, seq), _returned_loss


# --- unet, resnet: convolutional nets ----------------------------------------------------------

class ConvBlock(nn.Module):
    """(GroupNorm, SiLU, 3x3 conv) twice."""

    def __init__(self, cin: int, cout: int, groups: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.GroupNorm(groups, cin), nn.SiLU(), nn.Conv2d(cin, cout, 3, padding=1),
            nn.GroupNorm(groups, cout), nn.SiLU(), nn.Conv2d(cout, cout, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class UNet(nn.Module):
    """Denoising U-Net: per level a conv block then a stride-2 conv down; back up by nearest
    interpolation, concatenating the level's skip; predicts the noise (MSE loss)."""

    def __init__(self, channels: tuple[int, ...], groups: int) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels[0], 3, padding=1)
        self.encoders = nn.ModuleList(ConvBlock(c, c, groups) for c in channels[:-1])
        self.downs = nn.ModuleList(nn.Conv2d(c, wider, 3, stride=2, padding=1)
                                   for c, wider in zip(channels, channels[1:]))
        self.middle = ConvBlock(channels[-1], channels[-1], groups)
        self.decoders = nn.ModuleList(ConvBlock(c + wider, c, groups)
                                      for c, wider in zip(channels, channels[1:]))
        self.out = nn.Sequential(nn.GroupNorm(groups, channels[0]), nn.SiLU(),
                                 nn.Conv2d(channels[0], 3, 3, padding=1))

    def forward(self, noisy: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        x = self.stem(noisy)
        skips = []
        for encoder, down in zip(self.encoders, self.downs):
            x = encoder(x)
            skips.append(x)
            x = down(x)
        x = self.middle(x)
        for decoder, skip in zip(reversed(self.decoders), reversed(skips)):
            x = F.interpolate(x, scale_factor=2)
            x = decoder(torch.cat((x, skip), dim=1))
        return F.mse_loss(self.out(x), noise)


def unet(image, channels, groups, batch):
    def sample(g: torch.Generator) -> tuple:
        clean = torch.randn(batch, 3, image, image, generator=g)
        noise = torch.randn(batch, 3, image, image, generator=g)
        return clean + noise, noise

    return UNet(channels, groups), sample, _returned_loss


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 conv-BN, ReLU, identity or 1x1 conv-BN shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    """ImageNet-style ResNet: 7x7 stride-2 stem, max pool, stages of basic blocks (each stage
    after the first halves the map), global average pool, linear classifier."""

    def __init__(self, widths: tuple[int, ...], blocks: tuple[int, ...], classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 7, stride=2, padding=3, bias=False),
                                  nn.BatchNorm2d(widths[0]), nn.ReLU(),
                                  nn.MaxPool2d(3, stride=2, padding=1))
        stages, cin = [], widths[0]
        for stage, (width, count) in enumerate(zip(widths, blocks)):
            for block in range(count):
                stride = 2 if stage > 0 and block == 0 else 1
                stages.append(BasicBlock(cin, width, stride))
                cin = width
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(widths[-1], classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        features = self.stages(self.stem(images)).mean(dim=(2, 3))
        return F.cross_entropy(self.fc(features), labels)


def resnet(image, widths, blocks, classes, batch):
    return (ResNet(widths, blocks, classes), _images_and_labels(batch, image, classes),
            _returned_loss)


BUILDERS = {"llama": llama, "gpt2": gpt2, "vit": vit, "moe": moe, "unet": unet,
            "resnet": resnet, "checkpointed": checkpointed, "dict_output": dict_output}
"""Each takes its model's ``SIZES`` entry and returns ``(model, sample, loss)``: the fp32 CPU
model, the sampler of :attr:`ZooCase.sample` and :attr:`ZooCase.loss`."""
ZOO_NAMES: tuple[str, ...] = tuple(BUILDERS)


def build(name: str, size: Size = "tiny", device: torch.device | str = "cpu",
          dtype: torch.dtype = torch.float32) -> ZooCase:
    """Zoo model ``name`` at ``size``, in train mode, with parameters (and floating buffers and
    inputs) in ``dtype`` on ``device``; its weights follow ``torch.manual_seed``."""
    if name not in BUILDERS:
        raise ValueError(f"unknown zoo model {name!r}; known: {', '.join(ZOO_NAMES)}")
    if size not in ("tiny", "bench"):
        raise ValueError(f"unknown zoo size {size!r}; known: tiny, bench")
    model, sample, loss = BUILDERS[name](**SIZES[name][size])
    device = torch.device(device)
    case = ZooCase(model=model.to(device, dtype).train(), inputs=(), loss=loss, sample=sample,
                   device=device, dtype=dtype)
    case.inputs = case.batch(EXAMPLE_SEED)
    return case
