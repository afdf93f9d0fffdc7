"""The one configuration record of a storm backend, validated where the backend is built.

Passes receive a resolved :class:`StormConfig` through their context and never read
globals or environment variables.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Literal, get_args

MIB = 1 << 20
GIB = 1 << 30

DEFAULT_MIN_OFFLOAD_BYTES = 1 * MIB
"""Smaller activations stay on the GPU. A copy pays about 25 µs of fixed latency on the H100
(a 64 KiB copy takes 25 µs, a 4 MiB one 90 µs), so below ~1 MiB the link time spent per byte
freed is several times the bandwidth cost, and the bytes saved are negligible."""

DEFAULT_PREFETCH_WINDOW_BYTES = 1 * GIB
"""Prefetched tensors not yet used may hold this much device memory. On the H100 the link
moves 1 GiB in ~20 ms, more look-ahead than one transformer block's backward needs."""

HOST_MEMORY_FRACTION = 0.5
"""Default cap on pinned host memory, as a fraction of physical RAM: pinned pages cannot be
swapped, and the data loader and the rest of the process need the other half."""

InnerCompiler = Literal["inductor", "eager"]
OffloadMode = Literal["hidden", "all"]
CostMode = Literal["roofline", "measured"]

PRESETS: dict[str, dict[str, object]] = {
    "storm": {},
    "storm-measured": {"cost": "measured"},
    "storm-all": {"offload": "all"},
}
"""Named option sets the backend offers; the benchmark harness measures each one."""

_SIZE_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": MIB, "gib": GIB, "tib": 1 << 40,
               "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


class StormOptionError(ValueError):
    """An option given to ``storm(...)`` is unknown, of the wrong type or out of range."""


def parse_bytes(value: int | str, option: str) -> int:
    """Read a byte count given as an int or a string such as ``"12GiB"``, ``"512 MB"``."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise StormOptionError(f"storm option {option!r}: expected bytes as an int or a string "
                               f"like '12GiB', got {type(value).__name__} {value!r}")
    if isinstance(value, int):
        return value
    match = _SIZE_RE.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise StormOptionError(f"storm option {option!r}: cannot read {value!r} as a size; "
                               f"accepted forms: an int of bytes, or a number followed by one "
                               f"of {', '.join(u for u in _SIZE_UNITS if u)} "
                               f"(case-insensitive)")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclasses.dataclass(frozen=True)
class StormConfig:
    """Options of the storm backend. Build it with :meth:`from_options` to validate user input."""

    inner: InnerCompiler = "inductor"
    """Compiler for the rewritten forward and backward graphs: ``"inductor"`` (what
    ``torch.compile`` uses) or ``"eager"`` (run the FX graphs as they are, for debugging)."""

    min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES
    """Saved activations smaller than this stay on the GPU."""

    offload: OffloadMode = "hidden"
    """``"hidden"``: offload only the storages whose copies the cost model predicts to hide
    under compute, both ways. ``"all"``: every storage that can be offloaded, even when the
    compute stream has to wait for the link."""

    profile: str = "auto"
    """Device profile for the cost model: a built-in name (``h100``, ``h200``, ``a100-pcie``,
    ``rtx4090``, ``cpu-test``), a path to a profile JSON (``storm calibrate`` writes one), or
    ``"auto"``: a calibration of the present GPU, measured once and cached on disk
    (``cpu-test`` without CUDA)."""

    cost: CostMode = "roofline"
    """``"roofline"``: price nodes from FLOPs and bytes. ``"measured"``: time each distinct
    non-fusible op (matmuls, attention) once on the GPU at compile time; needs CUDA."""

    prefetch_window_bytes: int = DEFAULT_PREFETCH_WINDOW_BYTES
    """Device memory that prefetched, not yet used tensors may hold (strings like "2GiB")."""

    host_memory_limit: int = 0
    """Cap on pinned host memory held by the pool, in bytes (strings like ``"64GiB"`` accepted).
    0 means half of physical RAM. An offload that would pass the cap keeps its tensor on the GPU
    and warns once."""

    transfer_cpu_tensors: bool = False
    """Also plan and insert transfers for activations of CPU models, where the ops become plain
    copies. Lets the whole pipeline run and be tested on a machine without a GPU."""

    @classmethod
    def from_options(cls, **options: Any) -> "StormConfig":
        """Validate user options; raise ``StormOptionError`` (a ``ValueError``) naming the
        option and what is allowed."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - set(fields))
        if unknown:
            raise StormOptionError(f"unknown storm option(s) {', '.join(map(repr, unknown))}; "
                             f"known options: {', '.join(sorted(fields))}")
        for name in ("host_memory_limit", "prefetch_window_bytes", "min_offload_bytes"):
            if name in options:
                options[name] = parse_bytes(options[name], name)
        config = cls(**options)
        config._validate()
        if config.host_memory_limit == 0:
            config = dataclasses.replace(
                config, host_memory_limit=int(physical_memory_bytes() * HOST_MEMORY_FRACTION))
        return config

    def _validate(self) -> None:
        for name, kind in (("inner", InnerCompiler), ("offload", OffloadMode),
                           ("cost", CostMode)):
            allowed = get_args(kind)
            if getattr(self, name) not in allowed:
                raise StormOptionError(f"storm option {name!r}: expected one of {allowed}, "
                                       f"got {getattr(self, name)!r}")
        if not isinstance(self.profile, str):
            raise StormOptionError(f"storm option 'profile': expected a profile name or path, "
                                   f"got {type(self.profile).__name__}")
        for name in ("min_offload_bytes", "prefetch_window_bytes", "host_memory_limit"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise StormOptionError(f"storm option {name!r}: expected an int, "
                                       f"got {type(value).__name__} {value!r}")
            if value < 0:
                raise StormOptionError(f"storm option {name!r}: must be >= 0, got {value}")
        if not isinstance(self.transfer_cpu_tensors, bool):
            raise StormOptionError(f"storm option 'transfer_cpu_tensors': expected a bool, "
                                   f"got {type(self.transfer_cpu_tensors).__name__}")
