"""Device profiles: the rates of one GPU and its host link that the cost model prices with,
built in for the GPUs storm was measured or specified on, or read from a JSON file that
``storm calibrate`` writes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """Rates of one GPU and its host link. Bandwidths in bytes/s, times in seconds."""

    name: str
    matmul_flops: float
    """bf16/fp16 dense matrix FLOP/s reached by large matmuls."""
    fp32_flops: float
    """fp32 FLOP/s (TF32 off, PyTorch's default)."""
    memory_bandwidth: float
    """Device memory bytes/s, counting bytes read plus bytes written."""
    launch_s: float
    """Smallest time a kernel takes, launch included."""
    h2d_bandwidth: float
    d2h_bandwidth: float
    duplex_bandwidth: float
    """Total bytes/s over both directions when copies run both ways at once."""
    copy_latency_s: float
    """Fixed cost of one copy, paid before its bytes move."""
    transfer_host_s: float
    """Host time of storm's six ops moving one storage out and back (offload, record, wait;
    prefetch, record, wait): step time whenever the step is host-bound."""
    host_add_bandwidth: float
    """Gradient bytes per second that storm's host thread adds into streamed parameters'
    ``.grad`` (an ``add_`` of the pinned copy into a host tensor of its dtype)."""
    host_adamw_bandwidth: float
    """Parameter bytes per second that ``torch.optim.AdamW(fused=True)`` steps on the host,
    one parameter at a time as :class:`~storm_compile.weights.streaming.OverlappedOptimizer`
    does."""

    @classmethod
    def from_json(cls, path: str | Path) -> "DeviceProfile":
        try:
            text = Path(path).read_text()
        except OSError as error:
            raise ValueError(f"device profile {str(path)!r}: cannot read: {error}") from error
        return cls.from_text(text, str(path))

    @classmethod
    def from_text(cls, text: str, source: str) -> "DeviceProfile":
        """A profile from its JSON text; ``source`` names it in errors."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"device profile {source!r}: cannot read: {error}") from error
        if not isinstance(data, dict):
            raise ValueError(f"device profile {source!r}: expected a JSON object")
        values = {}
        for field in dataclasses.fields(cls):
            if field.name not in data:
                raise ValueError(f"device profile {source!r}: missing field {field.name!r} "
                                 f"(written by an older storm? run `storm calibrate` again)")
            value = data[field.name]
            if field.name == "name":
                values["name"] = str(value)
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0 <= value < float("inf"):
                raise ValueError(f"device profile {source!r}: field {field.name!r} must be a "
                                 f"finite, non-negative number, got {value!r}")
            values[field.name] = float(value)
        for name in ("matmul_flops", "fp32_flops", "memory_bandwidth", "h2d_bandwidth",
                     "d2h_bandwidth", "duplex_bandwidth", "host_add_bandwidth",
                     "host_adamw_bandwidth"):
            if values[name] == 0:
                raise ValueError(f"device profile {source!r}: field {name!r} must be > 0")
        return cls(**values)

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(self.to_text())

    def to_text(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)


TRANSFER_HOST_S = 178e-6
"""Host time per storage moved (six op calls from Python), as ``storm calibrate`` measured it on
the H100 machine (136 µs on the lent H200's host); every built-in profile uses it, since it is
the host CPU's figure, not the GPU's: calibrate yours."""

HOST_ADAMW_BANDWIDTH = 9.18e9
"""Bytes of bf16 parameters per second fused AdamW steps on the H100 machine's host (16 cores),
as ``storm calibrate``'s routine measured it there (``benchmarks.streaming``'s in-process
calibration, 9.18 GB/s): on a thread, with both lanes of the link copying, since a streamed
step's optimizer runs while weights come in and gradients go home and the copies' DMA shares
the host's memory (with the link idle an earlier calibration there gave 13.3 GB/s). A figure
of the host, not of the GPU: calibrate yours."""

HOST_ADD_BANDWIDTH = 15.9e9
"""Bytes of bf16 gradients per second the H100 machine's host adds into ``.grad``, measured by
the same calibration with both link lanes copying (15.87 GB/s; 38.7 GB/s with the link idle,
in the earlier calibration). A figure of the host: calibrate yours."""

HOST_RATES = {"host_add_bandwidth": HOST_ADD_BANDWIDTH,
              "host_adamw_bandwidth": HOST_ADAMW_BANDWIDTH}
"""The host rates of every built-in GPU profile: the host CPU's, not the GPU's."""

PROFILES: dict[str, DeviceProfile] = {
    # Measured on our H100 80GB HBM3 (torch 2.11, cu130): pinned copies 55.2 GB/s each way,
    # 89 GB/s both ways at once, bf16 matmul 767 TFLOP/s; `storm calibrate` there gave fp32
    # 51 TFLOP/s, 2.97 TB/s device copies (read+write), 7.6 µs per small kernel and 15.8 µs
    # of fixed latency per host copy.
    "h100": DeviceProfile("h100", matmul_flops=767e12, fp32_flops=51e12,
                          memory_bandwidth=2.97e12, launch_s=7.6e-6, h2d_bandwidth=55.2e9,
                          d2h_bandwidth=55.2e9, duplex_bandwidth=89e9, copy_latency_s=15.8e-6,
                          transfer_host_s=TRANSFER_HOST_S, **HOST_RATES),
    # H200: bf16 and memory rates as seen on this workplace's H200 (790 TFLOP/s, 4.3 TB/s
    # read+write); the host link is the same PCIe Gen5 as the H100's.
    "h200": DeviceProfile("h200", matmul_flops=790e12, fp32_flops=55e12,
                          memory_bandwidth=4.3e12, launch_s=4e-6, h2d_bandwidth=55.2e9,
                          d2h_bandwidth=55.2e9, duplex_bandwidth=89e9, copy_latency_s=20e-6,
                          transfer_host_s=TRANSFER_HOST_S, **HOST_RATES),
    # Datasheet-derived, at about 80 % of peak: A100 PCIe 312 TFLOP/s bf16, 1.9 TB/s, Gen4 x16.
    "a100-pcie": DeviceProfile("a100-pcie", matmul_flops=250e12, fp32_flops=19.5e12,
                               memory_bandwidth=1.5e12, launch_s=5e-6, h2d_bandwidth=25e9,
                               d2h_bandwidth=25e9, duplex_bandwidth=40e9, copy_latency_s=10e-6,
                               transfer_host_s=TRANSFER_HOST_S, **HOST_RATES),
    # Datasheet-derived, at about 80 % of peak: RTX 4090 165 TFLOP/s bf16 (fp32 accumulate),
    # 1.0 TB/s, Gen4 x16.
    "rtx4090": DeviceProfile("rtx4090", matmul_flops=130e12, fp32_flops=66e12,
                             memory_bandwidth=0.8e12, launch_s=5e-6, h2d_bandwidth=25e9,
                             d2h_bandwidth=25e9, duplex_bandwidth=40e9, copy_latency_s=10e-6,
                             transfer_host_s=TRANSFER_HOST_S, **HOST_RATES),
    # Round numbers for tests: schedules printed with it are exact and never change.
    "cpu-test": DeviceProfile("cpu-test", matmul_flops=1e12, fp32_flops=1e12,
                              memory_bandwidth=1e11, launch_s=1e-6, h2d_bandwidth=1e10,
                              d2h_bandwidth=1e10, duplex_bandwidth=1.5e10, copy_latency_s=1e-5,
                              transfer_host_s=0.0, host_add_bandwidth=1e10,
                              host_adamw_bandwidth=5e9),
}

DEFAULT_PROFILE = "auto"
"""Device profile of the backend and of the CLI alike, resolved by
:func:`storm_compile.cost.calibrate.profile_for`. Defined here, with the profiles, rather than in
:mod:`storm_compile.config`, which imports torch: the CLI's help names it without loading
torch."""

GPU_PLANNING_PROFILE = "h100"
"""Profile of ``"auto"`` without CUDA where the graphs are planned for a GPU that is absent (the
CLI traces on the CPU): the GPU the project's anchors were measured on. Defined here rather than
in :mod:`storm_compile.cost.calibrate`, which imports torch, for the same reason."""


def resolve_profile(spec: str | DeviceProfile) -> DeviceProfile:
    """A built-in profile by name, or one read from a JSON file path."""
    if isinstance(spec, DeviceProfile):
        return spec
    if spec in PROFILES:
        return PROFILES[spec]
    if spec.endswith(".json") or Path(spec).is_file():
        return DeviceProfile.from_json(spec)
    raise ValueError(f"unknown device profile {spec!r}; built-in profiles: "
                     f"{', '.join(PROFILES)}, or a path to a profile JSON")
