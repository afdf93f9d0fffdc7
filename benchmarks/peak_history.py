"""Where a recorded step's device peak lies: the caching allocator's history of one step, and
the blocks live at its peak grouped by the lines that allocated them (the generated kernel or
the model line, with its source text). ``benchmarks.trainer`` and ``benchmarks.zoo_memory``
record it with ``--peak-history``."""

from __future__ import annotations

import collections
import contextlib
import linecache
from collections.abc import Iterator
from pathlib import Path

import torch

from storm_compile.fx.vocabulary import GIB

HISTORY_ENTRIES = 1_000_000
"""Allocator events recorded for ``--peak-history``: one step of a 1B model makes some 10^4."""
TORCH_FRAMES = ("/torch/", "<frozen ")
"""Frames :func:`owner` passes over: torch's own code says less of who allocated a block than
the generated kernel or the model line that called it."""
OWNER_FRAMES = 2
OWNER_TEXT = 90
"""Characters of a frame's source line :func:`owner` keeps (a buffer's allocation with its
shape fits)."""
OWNER_ROWS = 12


def owner(frames: list[dict]) -> str:
    """Who allocated a block: the first two Python frames outside torch (generated Inductor
    code, storm, transformers, the Trainer), each with its source line where it can be read."""
    kept = [f for f in frames if f["filename"].endswith(".py")
            and not any(part in f["filename"] for part in TORCH_FRAMES)]
    return " < ".join(f"{Path(f['filename']).name}:{f['line']} {f['name']}"
                      f" `{linecache.getline(f['filename'], f['line']).strip()[:OWNER_TEXT]}`"
                      for f in kept[:OWNER_FRAMES]) or "torch"


def peak_owners(trace: list[dict], before: int) -> dict:
    """Where a recorded step's device peak lies, from the allocator's ``trace`` of it (the
    events of ``torch.cuda.memory._snapshot()["device_traces"]``) and the bytes allocated when
    it began: the bytes allocated at the peak, the frames of the allocation that reached it, and
    the blocks live there grouped by :func:`owner` (largest first, :data:`OWNER_ROWS` of them;
    what was allocated before the step and is still live there is one row)."""
    current = peak = before
    peak_index = -1
    for index, entry in enumerate(trace):
        if entry["action"] == "alloc":
            current += entry["size"]
            if current > peak:
                peak, peak_index = current, index
        elif entry["action"] == "free_completed":
            current -= entry["size"]
    live: dict[int, dict] = {}
    for entry in trace[:peak_index + 1]:
        if entry["action"] == "alloc":
            live[entry["addr"]] = entry
        elif entry["action"] == "free_completed":
            live.pop(entry["addr"], None)
    groups: dict[str, int] = collections.Counter()
    for entry in live.values():
        groups[owner(entry["frames"])] += entry["size"]
    groups["allocated before the step, still live"] = peak - sum(groups.values())
    return {"peak_gib": peak / GIB, "before_gib": before / GIB,
            "reached_by": owner(trace[peak_index]["frames"]) if peak_index >= 0 else "",
            "owners": [{"gib": size / GIB, "owner": name}
                       for name, size in groups.most_common(OWNER_ROWS)]}


@contextlib.contextmanager
def recorded(into: dict) -> Iterator[None]:
    """Record the allocator's history of the block's CUDA work and put :func:`peak_owners` of it
    into ``into`` (synchronised at both ends)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES, stacks="python")
    try:
        yield
        torch.cuda.synchronize()
        trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
        into.update(peak_owners(trace, before))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
