"""Overlap figures from a Chrome trace written by ``torch.profiler``.

Reads GPU kernel and memcpy events, groups them by stream, and reports: the compute stream's busy
fraction of the step, total D2H and H2D copy time, the fraction of copy time during which a
compute kernel was running, and where the compute stream sat idle between its kernels: waiting
on a copy home, on a copy to the device (the gap ends as such a copy on another stream ends),
or on neither (the host: launches, the host thread, the optimizer). With shapes recorded, the
GPU time of each matrix product, by its operands' shapes (:func:`matmul_kernels`), to set beside
what a plan priced for the same shapes.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import torch

US_PER_MS = 1e3
KERNEL_CATEGORY = "kernel"
MEMCPY_CATEGORY = "gpu_memcpy"
RESUME_US = 50.0
"""A gap on the compute stream is put down to a copy on another stream when the copy ends at
most this long from the compute stream's next start: a stream waiting on an event starts its
next kernel within some 5–40 µs of the copy's end in the H100 traces storm's runs wrote."""


MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
"""The CPU ops of a trace whose kernels :func:`matmul_kernels` attributes to their shapes."""
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
"""Trace categories of the host calls that launch kernels; a launch and its kernel share a
``correlation`` id."""


GAPS_REPORTED = 10
"""Idle gaps of the compute stream an analysis names: a handful shows whether a step waits at
a few places (a copy, the optimizer) or a little everywhere (launches)."""


@dataclasses.dataclass(frozen=True)
class Gap:
    """An idle gap of the compute stream and the work on either side of it."""

    us: float
    before: str
    after: str


@dataclasses.dataclass(frozen=True)
class Overlap:
    step_us: float
    compute_busy_fraction: float
    d2h_us: float
    h2d_us: float
    copy_overlap_fraction: float
    compute_stream: int
    copy_streams: tuple[int, ...]
    h2d_us_by_stream: dict[int, float]
    """Copy time to the device by the stream it ran on: storm's prefetches and weights' fetches
    share one stream (a fold's loads have their own)."""
    d2h_us_by_stream: dict[int, float]
    """Copy time home by stream."""
    idle_us: float
    """Compute stream idle between its first and last kernel."""
    idle_on_d2h_us: float
    """Of which in gaps that end as a copy home ends."""
    idle_on_h2d_us: float
    """Of which in gaps that end as a copy to the device ends."""
    kernel_us: float
    """GPU time of every kernel, on every stream."""
    compute_copy_us: float
    """GPU time of copies made on the compute stream itself, which no compute hides."""
    gaps: tuple[Gap, ...]
    """The compute stream's :data:`GAPS_REPORTED` longest idle gaps, longest first."""


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def _covered(interval: tuple[float, float], union: list[tuple[float, float]]) -> float:
    start, end = interval
    return sum(max(0.0, min(end, e) - max(start, s)) for s, e in union)


def _stream(event: dict) -> int:
    return int(event.get("args", {}).get("stream", event.get("tid", -1)))


def analyse(trace_path: str | Path) -> Overlap:
    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") == KERNEL_CATEGORY and "dur" in e]
    copies = [e for e in events if e.get("cat") == MEMCPY_CATEGORY and "dur" in e]
    if not kernels:
        raise ValueError(f"{trace_path}: no GPU kernel events; was the step profiled on CUDA?")
    busy_by_stream: dict[int, float] = {}
    for kernel in kernels:
        busy_by_stream[_stream(kernel)] = busy_by_stream.get(_stream(kernel), 0.0) + kernel["dur"]
    compute_stream = max(busy_by_stream, key=busy_by_stream.__getitem__)
    compute = _union([(k["ts"], k["ts"] + k["dur"]) for k in kernels + copies
                      if _stream(k) == compute_stream])
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in kernels + copies]
    step_us = max(end for _, end in spans) - min(start for start, _ in spans)
    d2h = [c for c in copies if "DtoH" in c["name"]]
    h2d = [c for c in copies if "HtoD" in c["name"]]
    copy_total = sum(c["dur"] for c in d2h + h2d)
    overlapped = sum(_covered((c["ts"], c["ts"] + c["dur"]), compute) for c in d2h + h2d)
    idle = _idle(compute, [c for c in d2h + h2d if _stream(c) != compute_stream])
    return Overlap(
        step_us=step_us,
        compute_busy_fraction=sum(e - s for s, e in compute) / step_us,
        d2h_us=sum(c["dur"] for c in d2h),
        h2d_us=sum(c["dur"] for c in h2d),
        copy_overlap_fraction=overlapped / copy_total if copy_total else 0.0,
        compute_stream=compute_stream,
        copy_streams=tuple(sorted({_stream(c) for c in d2h + h2d})),
        h2d_us_by_stream=_by_stream(h2d), d2h_us_by_stream=_by_stream(d2h),
        idle_us=sum(idle.values()), idle_on_d2h_us=idle["DtoH"], idle_on_h2d_us=idle["HtoD"],
        kernel_us=sum(k["dur"] for k in kernels),
        compute_copy_us=sum(c["dur"] for c in copies if _stream(c) == compute_stream),
        gaps=_gaps([e for e in kernels + copies if _stream(e) == compute_stream]),
    )


def _by_stream(copies: list[dict]) -> dict[int, float]:
    """GPU time of ``copies`` by stream."""
    spent: dict[int, float] = collections.defaultdict(float)
    for copy in copies:
        spent[_stream(copy)] += copy["dur"]
    return dict(sorted(spent.items()))


def _gaps(work: list[dict]) -> tuple[Gap, ...]:
    """The :data:`GAPS_REPORTED` longest gaps between ``work`` (one stream's events), each
    with the name of the event that ended last before it and of the one that ends it."""
    gaps, last = [], None
    for event in sorted(work, key=lambda e: e["ts"]):
        if last is not None and event["ts"] > last["ts"] + last["dur"]:
            gaps.append(Gap(event["ts"] - last["ts"] - last["dur"], last["name"], event["name"]))
        if last is None or event["ts"] + event["dur"] > last["ts"] + last["dur"]:
            last = event
    return tuple(sorted(gaps, key=lambda g: -g.us)[:GAPS_REPORTED])


def _idle(compute: list[tuple[float, float]], copies: list[dict]) -> dict[str, float]:
    """Idle time between the compute intervals, by the direction of the copy each gap waited on
    (``DtoH``, ``HtoD``; ``other`` when none ends within :data:`RESUME_US` of the gap's end)."""
    idle = {"DtoH": 0.0, "HtoD": 0.0, "other": 0.0}
    for (_, gap_start), (gap_end, _) in zip(compute, compute[1:]):
        ending = [c for c in copies if abs(c["ts"] + c["dur"] - gap_end) <= RESUME_US]
        last = min(ending, key=lambda c: abs(c["ts"] + c["dur"] - gap_end), default=None)
        direction = "other" if last is None else ("DtoH" if "DtoH" in last["name"] else "HtoD")
        idle[direction] += gap_end - gap_start
    return idle


@dataclasses.dataclass(frozen=True)
class MatmulKernels:
    """The GPU time of one matrix-product op's calls with one set of operand shapes."""

    op: str
    """The op's packet, as storm's graphs name it (``mm``, ``addmm``...)."""
    shapes: str
    """Its first two operands' shapes, as ``[[m, k], [k, n]]``."""
    calls: int
    kernel_us: float


def matmul_key(op: str, shapes) -> tuple[str, str]:
    """How :func:`matmul_kernels` and a plan's prices name a product: the op's packet
    (``aten::mm`` and ``aten.mm.default`` are both ``mm``) and its first two operands' shapes."""
    packet = op.removeprefix("aten::").removeprefix("aten.").split(".")[0]
    return packet, json.dumps([list(s) for s in shapes[:2]])


MATMUL_PACKETS = frozenset(matmul_key(op, ())[0] for op in MATMUL_OPS)
""":data:`MATMUL_OPS` as :func:`matmul_key` names them."""


def matmul_kernels(trace_path: str | Path) -> list[MatmulKernels]:
    """The kernels each matrix-product op (:data:`MATMUL_OPS`) launched, summed by the op and
    its operands' shapes, most GPU time first: a kernel is its launch's (same ``correlation``),
    and a launch belongs to the op running on its host thread when it was made; a call may
    launch several (cuBLAS splits a product with a short output across its inner dimension,
    then sums the parts). Needs a trace recorded with ``record_shapes``."""
    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    kernel_us: dict[int, float] = collections.defaultdict(float)
    for event in events:
        if event.get("cat") == KERNEL_CATEGORY and "dur" in event:
            kernel_us[event["args"].get("correlation")] += event["dur"]
    ops: dict[tuple, list[dict]] = collections.defaultdict(list)
    for event in events:
        if event.get("cat") == "cpu_op" and event.get("name") in MATMUL_OPS:
            ops[event.get("pid"), event.get("tid")].append(event)
    for found in ops.values():
        found.sort(key=lambda e: e["ts"])
    starts = {thread: [op["ts"] for op in found] for thread, found in ops.items()}
    calls: dict[tuple[str, str], dict[int, float]] = collections.defaultdict(
        lambda: collections.defaultdict(float))
    for event in events:
        if event.get("cat") not in LAUNCH_CATEGORIES:
            continue
        thread = event.get("pid"), event.get("tid")
        index = bisect.bisect_right(starts.get(thread, []), event["ts"]) - 1
        if index < 0:
            continue
        op = ops[thread][index]
        correlation = event.get("args", {}).get("correlation")
        if op["ts"] + op["dur"] < event["ts"] or correlation not in kernel_us:
            continue
        key = matmul_key(op["name"], op["args"].get("Input Dims", []))
        calls[key][id(op)] += kernel_us[correlation]
    found = [MatmulKernels(op, shapes, len(times), sum(times.values()))
             for (op, shapes), times in calls.items()]
    return sorted(found, key=lambda m: -m.kernel_us)


def profiled(step: Callable[[], object], cuda: bool, trace: Path) -> dict:
    """Run ``step`` once under ``torch.profiler`` and write its Chrome trace to ``trace``; the
    figures a benchmark row gets: the trace's path, and on CUDA (:func:`analyse`) the compute
    stream's busy fraction, D2H and H2D copy time (in all and by stream), the fraction of copy
    time hidden, and the compute stream's idle time, split by the copy it waited on, in
    milliseconds, and the GPU time of every kernel, of the copies on the compute stream and of
    the matrix products', those by their shapes (:func:`matmul_kernels`), and the compute
    stream's longest idle gaps."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    prof.export_chrome_trace(str(trace))
    figures: dict = {"trace": str(trace)}
    if cuda:
        overlap = analyse(trace)
        figures.update(compute_busy_fraction=overlap.compute_busy_fraction,
                       d2h_ms=overlap.d2h_us / US_PER_MS, h2d_ms=overlap.h2d_us / US_PER_MS,
                       h2d_ms_by_stream={stream: us / US_PER_MS for stream, us
                                         in overlap.h2d_us_by_stream.items()},
                       d2h_ms_by_stream={stream: us / US_PER_MS for stream, us
                                         in overlap.d2h_us_by_stream.items()},
                       copy_overlap_fraction=overlap.copy_overlap_fraction,
                       idle_ms=overlap.idle_us / US_PER_MS,
                       idle_on_d2h_ms=overlap.idle_on_d2h_us / US_PER_MS,
                       idle_on_h2d_ms=overlap.idle_on_h2d_us / US_PER_MS,
                       kernel_ms=overlap.kernel_us / US_PER_MS,
                       compute_copy_ms=overlap.compute_copy_us / US_PER_MS,
                       gaps=[dataclasses.asdict(g) for g in overlap.gaps])
        matmuls = matmul_kernels(trace)
        figures.update(matmul_kernel_ms=sum(m.kernel_us for m in matmuls) / US_PER_MS,
                       matmul_kernels=[dataclasses.asdict(m) for m in matmuls])
    return figures
