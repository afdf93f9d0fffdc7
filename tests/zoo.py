"""Small models the tests compile, each returning ``(model, inputs, loss_fn)``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from storm_compile.cli.models import GPTShape, build_gpt


def _sum_loss(out):
    return out.float().pow(2).mean()


def mlp():
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 16))
    return model, (torch.randn(16, 32),), _sum_loss


def gpt():
    model, inputs = build_gpt(GPTShape(d_model=64, layers=2, heads=4, seq=32, batch=2,
                                       dtype="float32"))
    return model, inputs, _sum_loss


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x):
        return self.conv2(F.relu(self.bn(self.conv1(x))))


def conv_bn():
    return ConvBN().train(), (torch.randn(4, 3, 12, 12),), _sum_loss


class DropoutNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(64, 8)

    def forward(self, x):
        return self.fc2(self.drop(F.relu(self.fc1(x))))


def dropout():
    return DropoutNet().train(), (torch.randn(16, 32),), _sum_loss


class TiedEmbedding(nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mix(self.embed(ids))))


def tied_embedding():
    return TiedEmbedding(), (torch.randint(0, 50, (4, 12)),), _sum_loss


class MultiOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 64)
        self.fc3 = nn.Linear(64, 64)

    def forward(self, x):
        h = torch.sigmoid(self.fc1(x))
        y = self.fc3(F.gelu(self.fc2(h)))
        return y, y[:, :8], h.t()


def multi_output():
    def loss(outs):
        y, y_view, h_t = outs
        return y.pow(2).mean() + y_view.sum() + (h_t * 0.5).sum()

    return MultiOutput(), (torch.randn(16, 32),), loss


class Routed(nn.Module):
    """A mixture-of-experts block: a router picks 2 of 4 expert MLPs per token (``topk``) and
    the block sums their outputs weighted by the router's probabilities, as Mixtral- and
    Qwen-MoE-style blocks do (every expert runs on every token here, so shapes stay static)."""

    def __init__(self, dim: int = 32, experts: int = 4, hidden: int = 64, k: int = 2) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
            for _ in range(experts))
        self.k = k

    def forward(self, x):
        weights, chosen = self.router(torch.tanh(x)).softmax(-1).topk(self.k, dim=-1)
        out = x
        for index, expert in enumerate(self.experts):
            gate = (weights * (chosen == index)).sum(-1, keepdim=True)
            out = out + gate * expert(x)
        return out


def routed():
    return Routed(), (torch.randn(4, 16, 32),), _sum_loss


ZOO = {
    "mlp": mlp,
    "gpt": gpt,
    "conv_bn": conv_bn,
    "dropout": dropout,
    "tied_embedding": tied_embedding,
    "multi_output": multi_output,
    "routed": routed,
}
