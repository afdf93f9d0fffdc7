"""Measure the present GPU into a :class:`DeviceProfile`, and cache it on disk.

``storm calibrate`` runs :func:`calibrate`; ``profile="auto"`` (the backend's and the CLI's
default, resolved by :func:`profile_for`) reads the cached calibration of the present GPU,
measuring it on first use.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from storm_compile.config import StormOptionError
from storm_compile.cost.profiles import PROFILES, DeviceProfile, resolve_profile
from storm_compile.fx.vocabulary import MS
from storm_compile.runtime import ops
from storm_compile.runtime.ranks import from_rank_zero

COPY_BYTES = 256 << 20
"""Large enough for a copy to run at full link rate (64 MiB already does on the H100)."""
SMALL_COPY_BYTES = 64 << 10
"""Small enough that a copy's time is almost all fixed latency."""
MATMUL_SIZE = 8192
FP32_MATMUL_SIZE = 4096
MATMUL_BURST_S = 0.25
"""How long the timed matrix products run back to back. A training step's products follow each
other for hundreds of milliseconds, and the GPU's clock under that load is lower than in one
product after an idle pause: through a step of the 70B shape's layers on an H200 the largest
products ran at 703-736 TFLOP/s, where ten single 8192-square products timed 793."""
DEVICE_COPY_BYTES = 1 << 30
LAUNCH_PROBES = 200
TRANSFER_PROBES = 50
TRANSFER_PROBE_BYTES = 4 << 20
"""A typical small activation; the host time of the transfer ops does not depend on size."""
REPEATS = 10
BURST_REPEATS = 3
HOST_PROBE_BYTES = 256 << 20
"""A layer's weights are tens to hundreds of MiB: this is past the host's caches, so the host
rates are its memory's, as they are for a model's gradients and optimizer state."""
HOST_REPEATS = 5
HOST_PROBE_DTYPE = torch.bfloat16
"""The dtype the host rates are timed in: streamed models keep bf16 parameters, gradients and
AdamW state (fp32 masters would double the host memory), and the host's fused AdamW runs
slower per byte in bf16 than in fp32 (on the H100 machine 12-13 GB/s against 18.9 GB/s)."""
CALIBRATION_VERSION = 4
"""Part of the cache's file name: a calibration cached before what it measures changed (the
host rates' dtype, version 2; the host rates timed with the link busy, version 3; matrix rates
sustained over a burst, version 4) is measured again."""
log = logging.getLogger("storm_compile")

FALLBACK_PROFILE = "cpu-test"
"""Profile of ``"auto"`` without CUDA where the graphs run on the CPU (the backend, with
``transfer_cpu_tensors``): only CPU graphs are planned there."""


def _median_seconds(work: Callable[[], None], repeats: int = REPEATS) -> float:
    work()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / MS)
    return statistics.median(times)


def sustained_flops(size: int, dtype: torch.dtype, device: str = "cuda",
                    timer: Callable[..., float] = _median_seconds) -> float:
    """FLOP/s of ``size``-square products in ``dtype`` run back to back for
    :data:`MATMUL_BURST_S` (as many as one product, timed alone, takes to fill it), timed by
    ``timer`` after one untimed burst that brings the GPU to its loaded clock."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    count = max(1, math.ceil(MATMUL_BURST_S / timer(lambda: a @ a)))

    def burst() -> None:
        for _ in range(count):
            a @ a

    return 2 * size**3 * count / timer(burst, BURST_REPEATS)


def calibrate(name: str | None = None) -> DeviceProfile:
    """Measure link, latency, matmul rates, memory bandwidth and launch time of the current GPU,
    and the host's rates of gradient additions and AdamW steps (:func:`host_rates`)."""
    if not torch.cuda.is_available():
        raise RuntimeError("calibration needs a CUDA device")
    host = torch.empty(COPY_BYTES, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    h2d = COPY_BYTES / _median_seconds(lambda: device.copy_(host, non_blocking=True))
    d2h = COPY_BYTES / _median_seconds(lambda: host.copy_(device, non_blocking=True))

    host_back = torch.empty_like(host, pin_memory=True)
    device_back = torch.empty_like(device)
    up, down = torch.cuda.Stream(), torch.cuda.Stream()

    def both_ways() -> None:
        current = torch.cuda.current_stream()
        up.wait_stream(current)
        down.wait_stream(current)
        with torch.cuda.stream(up):
            device.copy_(host, non_blocking=True)
        with torch.cuda.stream(down):
            host_back.copy_(device_back, non_blocking=True)
        current.wait_stream(up)
        current.wait_stream(down)

    duplex = 2 * COPY_BYTES / _median_seconds(both_ways)
    small_host = host[:SMALL_COPY_BYTES]
    small_device = device[:SMALL_COPY_BYTES]
    small = _median_seconds(lambda: small_device.copy_(small_host, non_blocking=True))
    latency = max(0.0, small - SMALL_COPY_BYTES / h2d)

    matmul = sustained_flops(MATMUL_SIZE, torch.bfloat16)
    fp32 = sustained_flops(FP32_MATMUL_SIZE, torch.float32)
    src = torch.empty(DEVICE_COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    memory = 2 * DEVICE_COPY_BYTES / _median_seconds(lambda: dst.copy_(src))
    one = torch.zeros(1, device="cuda")

    def launches() -> None:
        for _ in range(LAUNCH_PROBES):
            one.add_(1)

    launch = _median_seconds(launches) / LAUNCH_PROBES
    return DeviceProfile(
        name=name or torch.cuda.get_device_name(), matmul_flops=matmul, fp32_flops=fp32,
        memory_bandwidth=memory, launch_s=launch, h2d_bandwidth=h2d, d2h_bandwidth=d2h,
        duplex_bandwidth=duplex, copy_latency_s=latency, transfer_host_s=_transfer_host_seconds(),
        **host_rates())


def seconds_on_a_thread(work: Callable[[], None], repeats: int) -> float:
    """Median wall seconds of ``work`` run on a thread of its own, as storm's host thread runs
    its additions and steps (after one untimed run)."""
    times: list[float] = []

    def run() -> None:
        work()
        for _ in range(repeats):
            start = time.perf_counter()
            work()
            times.append(time.perf_counter() - start)

    thread = threading.Thread(target=run, name="storm-calibrate-host")
    thread.start()
    thread.join()
    if len(times) != repeats:
        raise RuntimeError("calibrating the host: the timed work failed on its thread")
    return statistics.median(times)


@contextlib.contextmanager
def _link_busy(nbytes: int = COPY_BYTES) -> Iterator[None]:
    """Keep both lanes of the host link copying between pinned host memory and the GPU, on a
    thread of their own, until the block ends: a streamed step's host additions and optimizer
    steps run while its weights come in and its gradients go home, and the copies' DMA reads
    and writes the same host memory they do. Without CUDA, nothing."""
    if not torch.cuda.is_available():
        yield
        return
    buffers = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    on_device = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
    lanes = [torch.cuda.Stream(), torch.cuda.Stream()]
    done = threading.Event()

    def copy() -> None:
        while not done.is_set():
            with torch.cuda.stream(lanes[0]):
                on_device[0].copy_(buffers[0], non_blocking=True)
            with torch.cuda.stream(lanes[1]):
                buffers[1].copy_(on_device[1], non_blocking=True)
            for lane in lanes:
                lane.synchronize()

    thread = threading.Thread(target=copy, name="storm-calibrate-link")
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def host_rates(nbytes: int = HOST_PROBE_BYTES, repeats: int = HOST_REPEATS
               ) -> dict[str, float]:
    """The host's ``host_add_bandwidth`` and ``host_adamw_bandwidth`` (profile fields), timed
    on a thread as storm's host thread works, in :data:`HOST_PROBE_DTYPE`, with both lanes of
    the link copying (:func:`_link_busy`) where CUDA is present: a gradient copy of ``nbytes``
    (pinned where CUDA is present) added into ``.grad``, and one fused AdamW step of a parameter
    of ``nbytes``."""
    elements = nbytes // HOST_PROBE_DTYPE.itemsize
    pin = torch.cuda.is_available()
    param = torch.nn.Parameter(torch.zeros(elements, dtype=HOST_PROBE_DTYPE, pin_memory=pin))
    param.grad = torch.zeros_like(param)
    arrived = torch.ones(elements, dtype=HOST_PROBE_DTYPE, pin_memory=pin)
    optimizer = torch.optim.AdamW([param], fused=True)
    with _link_busy():
        add = seconds_on_a_thread(lambda: param.grad.add_(arrived), repeats)
        adamw = seconds_on_a_thread(optimizer.step, repeats)
    size = elements * HOST_PROBE_DTYPE.itemsize
    return {"host_add_bandwidth": size / add, "host_adamw_bandwidth": size / adamw}


def _transfer_host_seconds() -> float:
    """Host wall time of storm's six ops moving one storage out and back, from Python, as the
    compiled graphs call them; the GPU work they queue is not waited for until the end."""
    x = torch.empty(TRANSFER_PROBE_BYTES, dtype=torch.uint8, device="cuda")
    limit = 4 * TRANSFER_PROBE_BYTES

    def move() -> None:
        host = ops.wait_event(ops.record_event(ops.offload(x, limit)), x)
        ops.wait_event(ops.record_event(ops.prefetch(host, x.device)), host)

    move()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        for _ in range(TRANSFER_PROBES):
            move()
        times.append((time.perf_counter() - start) / TRANSFER_PROBES)
        torch.cuda.synchronize()
    return statistics.median(times)


def cache_path(cache_dir: Path | None = None) -> Path:
    """Where the calibration of the present GPU is kept."""
    base = cache_dir or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    slug = re.sub(r"[^A-Za-z0-9]+", "-", torch.cuda.get_device_name()).strip("-").lower()
    name = f"{slug}-torch{torch.__version__}-v{CALIBRATION_VERSION}.json"
    return Path(base) / "storm_compile" / name


def auto_profile(without_cuda: str = FALLBACK_PROFILE) -> DeviceProfile:
    """The cached calibration of the present GPU, measured now if there is none (in a process
    group of several ranks, rank 0's, shared with the others); the built-in profile
    ``without_cuda`` when there is no CUDA device."""
    if not torch.cuda.is_available():
        return PROFILES[without_cuda]
    return DeviceProfile.from_text(from_rank_zero("profile", lambda: _local_profile().to_text()),
                                   "rank 0's calibration")


def _local_profile() -> DeviceProfile:
    path = cache_path()
    if path.is_file():
        try:
            return DeviceProfile.from_json(path)
        except ValueError as error:
            log.warning("storm: re-measuring the GPU: cached calibration unusable (%s)", error)
    profile = calibrate()
    path.parent.mkdir(parents=True, exist_ok=True)
    profile.to_json(path)
    return profile


def profile_for(spec: str, without_cuda: str = FALLBACK_PROFILE) -> DeviceProfile:
    """Resolve the ``profile`` option, for the backend and the CLI alike: a built-in name, a
    JSON path, or ``"auto"`` (:func:`auto_profile`, ``without_cuda`` naming the built-in profile
    to use when there is no CUDA device). Raises :class:`StormOptionError` naming the option."""
    if spec == "auto":
        return auto_profile(without_cuda)
    try:
        return resolve_profile(spec)
    except ValueError as error:
        raise StormOptionError(f"storm option 'profile': {error}") from error
