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

DEFAULT_MAX_OVERHEAD = 0.02
"""``memory_budget="auto"`` saves as much activation memory as a predicted step-time overhead of
this fraction allows: within run-to-run noise of a training step, so "free" in practice."""

BUDGET_SWEEP = (0.75, 0.5, 0.25, 0.06)
"""Fractions of the no-storm activation memory the ``storm-budget-*`` presets ask for: the
issue's three targets (-25 %, -50 %, full activation checkpointing's ~6 %) and a midpoint."""

PRESETS: dict[str, dict[str, object]] = {
    "storm": {},
    "storm-measured": {"cost": "measured"},
    "storm-all": {"offload": "all"},
    "storm-auto": {"memory_budget": "auto"},
    **{f"storm-budget-{fraction}": {"memory_budget": fraction} for fraction in BUDGET_SWEEP},
}
"""Named option sets the backend offers; the benchmark harness measures each one."""

_SIZE_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": MIB, "gib": GIB, "tib": 1 << 40,
               "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


class StormOptionError(ValueError):
    """An option given to ``storm(...)`` is unknown, of the wrong type or out of range."""


BUDGET_FORMS = ("an int of bytes", "a size string such as '12GiB' or '512 MB'",
                "a fraction in (0, 1] of the activation memory without storm, such as 0.5",
                "'auto'")


def parse_budget(value: object) -> int | float | str | None:
    """Read ``memory_budget``: None, bytes (int or size string), a fraction, or ``"auto"``."""
    if value is None or value == "auto":
        return value
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise StormOptionError(f"storm option 'memory_budget': a fraction must be in (0, 1], "
                                   f"got {value}; accepted forms: {'; '.join(BUDGET_FORMS)}")
        return value
    if isinstance(value, (int, str)) and not isinstance(value, bool):
        try:
            nbytes = parse_bytes(value, "memory_budget")
        except StormOptionError:
            raise StormOptionError(f"storm option 'memory_budget': cannot read {value!r}; "
                                   f"accepted forms: {'; '.join(BUDGET_FORMS)}; size units: "
                                   f"{', '.join(u for u in _SIZE_UNITS if u)}") from None
        if nbytes < 0:
            raise StormOptionError(f"storm option 'memory_budget': must be >= 0, got {nbytes}")
        return nbytes
    raise StormOptionError(f"storm option 'memory_budget': got {type(value).__name__} "
                           f"{value!r}; accepted forms: {'; '.join(BUDGET_FORMS)}")


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
    under compute, both ways. ``"all"``: every storage that can leave the device does: offloaded,
    or recomputed in the backward where that is predicted cheaper than waiting for the link."""

    memory_budget: int | float | str | None = None
    """Cap on activation memory (device memory held for the backward at the end of the forward,
    per compiled graph): bytes (``"12GiB"`` accepted), a fraction in (0, 1] of the activation
    memory without storm, or ``"auto"`` (the most memory saved at a predicted step-time overhead
    within ``max_overhead``). The planner keeps, offloads or recomputes each saved activation to
    meet it at the least predicted step time. None: no cap, offload what hides."""

    max_overhead: float = DEFAULT_MAX_OVERHEAD
    """Predicted step-time overhead ``memory_budget="auto"`` may spend, as a fraction."""

    recompute: bool = True
    """Let the planner rebuild activations in the backward (through the partitioner's recompute
    tags) where that is predicted cheaper than a copy that cannot hide. False: offloads only."""

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
        if "memory_budget" in options:
            options["memory_budget"] = parse_budget(options["memory_budget"])
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
        if isinstance(self.max_overhead, bool) or not isinstance(self.max_overhead, (int, float)) \
                or self.max_overhead < 0:
            raise StormOptionError(f"storm option 'max_overhead': expected a fraction >= 0, "
                                   f"got {self.max_overhead!r}")
        if self.memory_budget is not None and self.offload == "all":
            raise StormOptionError("storm options 'memory_budget' and offload='all' conflict: "
                                   "'all' moves every activation off the device; give one")
        for name in ("transfer_cpu_tensors", "recompute"):
            if not isinstance(getattr(self, name), bool):
                raise StormOptionError(f"storm option {name!r}: expected a bool, "
                                       f"got {type(getattr(self, name)).__name__}")
