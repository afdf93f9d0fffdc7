"""What held the device's memory when an allocation failed: the live blocks at that moment,
grouped by the line that allocated them.

:func:`record_until_oom` turns on the allocator's history (Python frames only) and attaches an
out-of-memory observer that writes :func:`summary` of the allocator's snapshot to a file at
the failing allocation, before the exception unwinds and frees what the failing frames held.
A line of Inductor's generated code (``buf12 = empty_strided_cuda(...)``) names the buffer, and
its file the compiled graph.
"""

from __future__ import annotations

import collections
import linecache
from pathlib import Path

import torch

from storm_compile.fx.vocabulary import GIB, MIB

HISTORY_ENTRIES = 200_000
"""Allocation events the allocator keeps: a 70B step allocates some 50 000 blocks."""
SITES_REPORTED = 40
BLOCKS_REPORTED = 20
LIBRARY_PATH = "/site-packages/torch/"
"""Frames in torch itself are skipped: a block's site is the frames outside it (the model,
storm, Inductor's generated code, which lives in its cache directory)."""
SITE_FRAMES = 2
"""Frames outside torch a site names, innermost first: storm's eager op and the line of the
compiled graph that called it."""


def _site(frames: list[dict]) -> str:
    outside = [f for f in frames if LIBRARY_PATH not in f.get("filename", "")
               and not f.get("filename", "").startswith("<")][:SITE_FRAMES]
    if not outside:
        return "(no frame outside torch)"
    return " <- ".join(
        f"{f['filename']}:{f.get('line')} {f.get('name')}: "
        f"{linecache.getline(f['filename'], f.get('line', 0)).strip()}" for f in outside)


def summary(snapshot: dict, failed_bytes: int) -> str:
    """The live blocks of an allocator ``snapshot`` (``torch.cuda.memory._snapshot()``) as text:
    bytes reserved, allocated and free inside segments; the sites holding the most bytes; the
    largest blocks with their sites; ``failed_bytes`` is the allocation that failed."""
    reserved = sum(s["total_size"] for s in snapshot["segments"])
    live = [b for s in snapshot["segments"] for b in s["blocks"]
            if b["state"] == "active_allocated"]
    held = sum(b["size"] for b in live)
    by_site: dict[str, list[int]] = collections.defaultdict(list)
    for block in live:
        by_site[_site(block.get("frames", []))].append(block["size"])
    lines = [f"failed allocation: {failed_bytes / MIB:.1f} MiB",
             f"reserved {reserved / GIB:.3f} GiB in {len(snapshot['segments'])} segments; "
             f"live {held / GIB:.3f} GiB in {len(live)} blocks; free inside segments "
             f"{(reserved - held) / GIB:.3f} GiB", "", "sites holding the most bytes:"]
    for site, sizes in sorted(by_site.items(), key=lambda item: -sum(item[1]))[:SITES_REPORTED]:
        lines.append(f"{sum(sizes) / MIB:10.1f} MiB {len(sizes):6d} blocks  {site}")
    lines += ["", "largest live blocks:"]
    for block in sorted(live, key=lambda b: -b["size"])[:BLOCKS_REPORTED]:
        lines.append(f"{block['size'] / MIB:10.1f} MiB  {_site(block.get('frames', []))}")
    return "\n".join(lines) + "\n"


def record_until_oom(path: Path) -> None:
    """Record the allocator's history and write :func:`summary` to ``path`` at the first
    allocation that fails (later ones leave it as written)."""
    torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES, stacks="python")

    def observe(device: int, failed: int, allocated: int, free: int) -> None:
        if not path.exists():
            path.write_text(summary(torch.cuda.memory._snapshot(), failed))

    torch._C._cuda_attach_out_of_memory_observer(observe)
