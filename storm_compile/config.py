"""The one configuration record of a storm backend, validated where the backend is built.

Passes receive a resolved :class:`StormConfig` through their context and never read
globals or environment variables.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any, Literal, get_args

from storm_compile.cost.profiles import DEFAULT_PROFILE
from storm_compile.fx.vocabulary import GIB, KIB, MIB, TIB

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
OffloadFormat = Literal[None, "fp8"]
CostMode = Literal["roofline", "measured"]
InductorMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]

DEFAULT_MAX_OVERHEAD = 0.02
"""``memory_budget="auto"`` saves as much activation memory as a predicted step-time overhead of
this fraction allows: within run-to-run noise of a training step, so "free" in practice."""

PEAK_MARGIN = 0.02
"""Fraction of a byte ``memory_budget`` that storm's plans leave free of their predicted device
peak. On the zoo's byte budgets (H100), the caching allocator held up to 1.5 % more at the step's
peak than the simulator predicted (cuBLAS and cuDNN workspaces, the allocator's rounding; see
benchmarks/RESULTS.md, "Byte budgets on the step's peak"), so a plan predicted at the budget ran
over it."""

BUDGET_SWEEP = (0.75, 0.5, 0.25, 0.06)
"""Fractions of the no-storm activation memory the ``storm-budget-*`` presets ask for: the
issue's three targets (-25 %, -50 %, full activation checkpointing's ~6 %) and a midpoint."""

PRESETS: dict[str, dict[str, object]] = {
    "storm": {},
    "storm-measured": {"cost": "measured"},
    "storm-all": {"offload": "all"},
    "storm-all-fp8": {"offload": "all", "offload_format": "fp8"},
    "storm-auto": {"memory_budget": "auto"},
    **{f"storm-budget-{fraction}": {"memory_budget": fraction} for fraction in BUDGET_SWEEP},
    "storm-budget-0.5-fp8": {"memory_budget": 0.5, "offload_format": "fp8"},
    "storm-measured-budget-0.5": {"cost": "measured", "memory_budget": 0.5},
}
"""Named option sets the backend offers; the benchmark harness measures each one."""

CPU_PLANNING: dict[str, object] = {"transfer_cpu_tensors": True}
"""Options that run storm's whole pipeline on CPU tensors: saved storages are planned and the
transfers placed, inserted and verified as for a GPU (the ops become plain copies). The CLI
(tracing on the CPU to plan for a GPU), the tests and the benchmarks' CPU runs all start from it
and add, on top, what only they need (such as ``min_offload_bytes=0`` for tiny models)."""

_SIZE_UNITS = {"": 1, "b": 1, "kib": KIB, "mib": MIB, "gib": GIB, "tib": TIB,
               "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


class StormOptionError(ValueError):
    """An option given to ``storm(...)`` is unknown, of the wrong type or out of range."""


BUDGET_FORMS = (
    "None (no budget)",
    "'auto'",
    "a number without a unit (0.5, 1, '0.5', '1'): a fraction in (0, 1] of the activation "
    "memory without storm, 1 meaning all of it",
    "a size with its unit ('12GiB', '512 MB', '0B'): bytes",
    "a Python int greater than 1: bytes (a string needs a unit)",
)


def _budget_error(value: object, problem: str) -> StormOptionError:
    return StormOptionError(f"storm option 'memory_budget': cannot use {value!r}: {problem}. "
                            f"Accepted forms: {'; '.join(BUDGET_FORMS)}")


def _fraction(number: float, value: object) -> float:
    """``number``, read from ``value`` without a unit, as a fraction in (0, 1]."""
    if not math.isfinite(number):
        raise _budget_error(value, "not a finite number")
    if not 0.0 < number <= 1.0:
        raise _budget_error(value, "a number without a unit is a fraction, which must be in "
                                  "(0, 1]")
    return float(number)


@dataclasses.dataclass(frozen=True)
class MemoryBudget:
    """``memory_budget`` read once (:meth:`parse`): no cap, ``"auto"``, a fraction of the
    activation memory without storm, or bytes. At most one of :attr:`auto`, :attr:`fraction`
    and :attr:`nbytes` is set; planning code reads these fields, never the user's value."""

    auto: bool = False
    fraction: float | None = None
    """In (0, 1]: of the activation memory the graphs hold without storm."""
    nbytes: int | None = None
    """Bytes of the device the step may hold (activations, and streamed weights kept there)."""
    margin: float = PEAK_MARGIN
    """Fraction of :attr:`nbytes` a plan leaves free of its predicted peak (:attr:`planned`):
    :data:`PEAK_MARGIN` for a user's budget, 0 for bytes already planned."""

    def __post_init__(self) -> None:
        if self.auto + (self.fraction is not None) + (self.nbytes is not None) > 1:
            raise StormOptionError(f"storm option 'memory_budget': {self!r} sets more than one "
                                   f"form")
        if not 0 <= self.margin < 1:
            raise StormOptionError(f"storm option 'memory_budget': {self!r} needs a margin in "
                                   f"[0, 1)")

    @property
    def planned(self) -> "MemoryBudget":
        """The budget storm plans against: a byte budget less its :attr:`margin`, any other
        form as it is (idempotent)."""
        if self.nbytes is None or not self.margin:
            return self
        return MemoryBudget(nbytes=int(self.nbytes * (1 - self.margin)), margin=0.0)

    @property
    def given(self) -> bool:
        """Whether there is a budget at all (else storm offloads only what hides)."""
        return self.auto or self.fraction is not None or self.nbytes is not None

    def __str__(self) -> str:
        if self.auto:
            return "auto"
        if self.fraction is not None:
            return f"{self.fraction:g}"
        return "none" if self.nbytes is None else f"{self.nbytes}B"

    @classmethod
    def parse(cls, value: object) -> "MemoryBudget":
        """Read ``memory_budget`` as :data:`BUDGET_FORMS` lists them; the CLI passes
        ``--memory-budget`` as typed, so a string means the same in Python and on the command
        line. A :class:`MemoryBudget` is taken as it is."""
        if isinstance(value, cls):
            return value
        if value is None:
            return cls()
        if value == "auto":
            return cls(auto=True)
        if isinstance(value, bool):
            raise _budget_error(value, "a bool is not a budget")
        if isinstance(value, int):
            return cls(nbytes=value) if value > 1 else cls(fraction=_fraction(value, value))
        if isinstance(value, float):
            return cls(fraction=_fraction(value, value))
        if not isinstance(value, str):
            raise _budget_error(value, f"a {type(value).__name__} is not a budget")
        match = _SIZE_RE.match(value)
        if match and match.group(2):
            try:
                return cls(nbytes=parse_bytes(value, "memory_budget"))
            except StormOptionError:
                raise _budget_error(value, f"unknown size unit {match.group(2)!r} (size units: "
                                           f"{', '.join(u for u in _SIZE_UNITS if u)})") from None
        try:
            number = float(value)
        except ValueError:
            raise _budget_error(value, "not a number, a size or 'auto'") from None
        if number > 1 and math.isfinite(number):
            raise _budget_error(value, "a number without a unit is a fraction in (0, 1]: give "
                                       "bytes with a unit, such as '2048B' or '12GiB'")
        return cls(fraction=_fraction(number, value))


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


LOCAL_RANKS_ENV = "LOCAL_WORLD_SIZE"
"""Processes on this machine, as ``torchrun`` sets it for each of them."""


def local_ranks() -> int:
    """How many processes of the job share this machine's RAM: ``LOCAL_WORLD_SIZE`` under
    torchrun, else 1. Raises :class:`StormOptionError` when the variable is set but is not a
    positive integer."""
    text = os.environ.get(LOCAL_RANKS_ENV)
    if text is None:
        return 1
    if not text.strip().isdigit() or int(text) < 1:
        raise StormOptionError(f"storm option 'host_memory_limit': its default shares the host "
                               f"among {LOCAL_RANKS_ENV} processes, which is {text!r}, not a "
                               f"positive integer; set host_memory_limit explicitly")
    return int(text)


@dataclasses.dataclass(frozen=True)
class StormConfig:
    """Options of the storm backend. Build it with :meth:`from_options` to validate user input."""

    inner: InnerCompiler = "inductor"
    """Compiler for the rewritten forward and backward graphs: ``"inductor"`` (what
    ``torch.compile`` uses) or ``"eager"`` (run the FX graphs as they are, for debugging)."""

    mode: InductorMode = "default"
    """Inductor's mode, as ``torch.compile(model, mode=...)`` names it (``torch.compile(model,
    backend="storm", mode=...)`` sets it). The CUDA graph modes (``"reduce-overhead"``,
    ``"max-autotune"``) refuse a graph that holds storm's copies: their pinned host buffers
    are taken from a pool at each step, which a replayed graph would not do."""

    min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES
    """Saved activations smaller than this stay on the GPU."""

    offload: OffloadMode = "hidden"
    """``"hidden"``: offload only the storages whose copies the cost model predicts to hide
    under compute, both ways. ``"all"``: every storage that can leave the device does: offloaded,
    or recomputed in the backward where that is predicted cheaper than waiting for the link."""

    offload_format: OffloadFormat = None
    """How offloaded activations are held on the host. None: as they are (exact). ``"fp8"``:
    lossy; a bf16, fp16 or fp32 activation is copied as fp8 values with one power-of-two scale
    (half a bf16's link bytes, a quarter of a float32's) and rebuilt in its dtype in the
    backward, about 2-3 % off each value (:mod:`storm_compile.fx.fp8`); never the default."""

    memory_budget: MemoryBudget = MemoryBudget()
    """Cap on activation memory (device memory held for the backward at the end of the forward,
    per compiled graph). A number without a unit is a fraction in (0, 1] of the activation memory
    without storm: ``0.5`` and ``"0.5"`` are half, ``1``, ``1.0`` and ``"1"`` all of it. A string
    with a unit (``"12GiB"``, ``"512 MB"``) is bytes, and so is a Python int greater than 1
    (``12 * 2**30``); a unitless string greater than 1 (``"2048"``) is rejected, so a string
    reads the same here and on the command line. ``"auto"``: the most memory saved at a predicted
    step-time overhead within ``max_overhead``. The planner keeps, offloads or recomputes each
    saved activation to meet it at the least predicted step time. None: no cap, offload what
    hides. Bools, 0, negatives, NaN and infinities are rejected. :meth:`from_options` reads the
    value once into a :class:`MemoryBudget`."""

    max_overhead: float = DEFAULT_MAX_OVERHEAD
    """Predicted step-time overhead ``memory_budget="auto"`` may spend, as a fraction."""

    recompute: bool = True
    """Let the planner rebuild activations in the backward where that is predicted cheaper
    than a copy that cannot hide. False: offloads only."""

    profile: str = DEFAULT_PROFILE
    """Device profile for the cost model: a built-in name (``h100``, ``h200``, ``a100-pcie``,
    ``rtx4090``, ``cpu-test``), a path to a profile JSON (``storm calibrate`` writes one), or
    ``"auto"``: a calibration of the present GPU, measured once and cached on disk
    (``cpu-test`` without CUDA)."""

    cost: CostMode = "roofline"
    """``"roofline"``: price nodes from FLOPs and bytes. ``"measured"``: time each distinct
    non-fusible op (matmuls, attention) once on the GPU at compile time; needs CUDA."""

    prefetch_window_bytes: int = DEFAULT_PREFETCH_WINDOW_BYTES
    """Device memory that prefetched, not yet used tensors (activations and streamed weights) may
    hold (strings like "2GiB")."""

    host_memory_limit: int = 0
    """Cap on pinned host memory held by the pool, in bytes (strings like ``"64GiB"`` accepted).
    0 means half of physical RAM, shared equally among the processes on the machine
    (``LOCAL_WORLD_SIZE`` under torchrun). A step's planned offloads hold at most this much:
    past it the planner recomputes or keeps (``plan_memory``). An offload the host still cannot
    pin at run time keeps its tensor on the GPU and warns once."""

    transfer_cpu_tensors: bool = False
    """Also plan and insert transfers for activations of CPU models, where the ops become plain
    copies. Lets the whole pipeline run and be tested on a machine without a GPU."""

    def __post_init__(self) -> None:
        if not isinstance(self.memory_budget, MemoryBudget):
            raise StormOptionError(f"storm option 'memory_budget': StormConfig holds a "
                                   f"MemoryBudget; build the config with from_options to read "
                                   f"{self.memory_budget!r}")

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
            options["memory_budget"] = MemoryBudget.parse(options["memory_budget"])
        config = cls(**options)
        config._validate()
        if config.host_memory_limit == 0:
            config = dataclasses.replace(config, host_memory_limit=int(
                physical_memory_bytes() * HOST_MEMORY_FRACTION / local_ranks()))
        return config

    def _validate(self) -> None:
        for name, kind in (("inner", InnerCompiler), ("offload", OffloadMode),
                           ("cost", CostMode), ("mode", InductorMode),
                           ("offload_format", OffloadFormat)):
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
                or not 0 <= self.max_overhead < math.inf:
            raise StormOptionError(f"storm option 'max_overhead': expected a finite fraction >= 0 "
                                   f"(0.02 is 2 %), got {self.max_overhead!r}")
        if self.inner == "eager" and self.mode != "default":
            raise StormOptionError(f"storm options inner='eager' and mode={self.mode!r} "
                                   f"conflict: the mode is Inductor's; give one")
        if self.memory_budget.given and self.offload == "all":
            raise StormOptionError("storm options 'memory_budget' and offload='all' conflict: "
                                   "'all' moves every activation off the device; give one")
        for name in ("transfer_cpu_tensors", "recompute"):
            if not isinstance(getattr(self, name), bool):
                raise StormOptionError(f"storm option {name!r}: expected a bool, "
                                       f"got {type(getattr(self, name)).__name__}")
