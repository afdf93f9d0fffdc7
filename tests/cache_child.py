"""One process of tests/test_cache.py: compile the tiny Llama under storm for each variant
named on the command line (a fresh dynamo each time), run its forwards and one backward, and
print, per variant, one JSON line:
the caches' counters, the step ledger's shares, and the loss and gradients' sums."""

from __future__ import annotations

import json
import sys

import torch
import torch._dynamo
from torch._dynamo.utils import counters

from storm_compile import storm
from storm_compile.cli.models import LLAMA_PRESETS, build_llama
from storm_compile.config import CPU_PLANNING
from storm_compile.weights.streaming import stream_parameters

RESIDENT_BYTES = 4096
"""Streams the tiny Llama's matrices (8 KiB and up), keeps its norm weights (256 B)."""

BASE = {**CPU_PLANNING, "min_offload_bytes": 0, "profile": "cpu-test"}
VARIANTS = {
    "default": ({**BASE}, False),
    "fraction": ({**BASE, "memory_budget": 0.5}, False),
    "streamed": ({**BASE, "memory_budget": "1MiB"}, True),
    "changed": ({**BASE, "min_offload_bytes": 1}, False),
    "siamese": ({**BASE, "memory_budget": "1300KB"}, False),
}
"""Options and whether the model streams its weights."""
FORWARDS = {"siamese": 2}
"""Forwards before the one backward (1 where not named): the tiny Llama peaks at 1243 KB
without storm, 667 KB of it activations, so its second run does not fit 1300 KB beside the
first and is compiled again, at its minimum."""

COUNTERS = ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass",
            "fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")


def run(variant: str) -> dict:
    options, streamed = VARIANTS[variant]
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model, batch = build_llama(LLAMA_PRESETS["tiny"])
    if streamed:
        stream_parameters(model, "cpu", resident_bytes=RESIDENT_BYTES)
    backend = storm(**options)
    compiled = torch.compile(model, backend=backend)
    loss = sum(compiled(*batch) for _ in range(FORWARDS.get(variant, 1)))
    loss.backward()
    found = {name: counters[group][name] for group in ("aot_autograd", "inductor")
             for name in COUNTERS if name in counters[group]}
    return {"variant": variant, **found,
            "shares": repr(sorted(backend.step._shares.items())),
            "loss": loss.item(),
            "grads": [p.grad.double().sum().item() for p in model.parameters()
                      if p.grad is not None]}


if __name__ == "__main__":
    for name in sys.argv[1:]:
        print(json.dumps(run(name)), flush=True)
