"""What a compile served from torch's caches must still do: a graph's plan record.

AOTAutograd's cache (and, under it, Inductor's FX graph cache) gives a later process the
compiled forward and backward of a graph without calling storm's partitioner: the rewritten
graphs are the plan, so they need nothing more to run. Planning did two things besides: it
recorded the graph's :class:`~storm_compile.planner.step_budget.GraphShare` in the step's ledger
(the graphs compiled after it plan against it, and a byte budget counts it at run time), and it may
have warned. A :class:`PlanRecord` keeps both in a small JSON file beside torch's cache entries,
under :data:`RECORD_DIR` of Inductor's cache directory, and the backend replays it on a hit.

The record's key is :func:`record_key`: the partitioner's cache key (storm's sources, options,
profile, rank and the ledger the graph was planned against) with the traced graph's code and
its inputs' metadata, all that AOTAutograd's key hashes and that a plan can depend on. The
backend offers AOTAutograd a cache key only when the record exists (else the partitioner's
``uuid`` is None and the graph is planned and compiled anew), so a hit always has its record.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import fx

from storm_compile.planner.step_budget import GraphShare

RECORD_DIR = "storm-plans"
"""Sub-directory of Inductor's cache directory holding plan records."""


@dataclasses.dataclass(frozen=True)
class PlanRecord:
    """What planning a graph did besides rewriting it."""

    share: GraphShare | None
    """The graph's share of the step (its activation memory and predicted time as planned);
    None when planning recorded none."""
    warnings: tuple[str, ...] = ()
    """storm's warnings planning the graph raised (``RuntimeWarning``), in order."""


def _input_facts(value: Any) -> tuple:
    """What of one traced graph input a plan can depend on (not its values)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), tuple(value.stride()), str(value.dtype),
                value.device.type, value.requires_grad, isinstance(value, torch.nn.Parameter))
    return (type(value).__name__, repr(value))


def record_key(partitioner_key: str, gm: fx.GraphModule, example_inputs: list[Any]) -> str:
    """The key of ``gm``'s plan record under a partitioner key."""
    facts = (partitioner_key, gm.code, tuple(_input_facts(v) for v in example_inputs))
    return hashlib.sha256(repr(facts).encode()).hexdigest()


def record_dir() -> Path:
    """Where plan records live: beside torch's caches, so clearing those clears these."""
    from storm_compile.fx.torch_private import inductor_cache_dir
    return Path(inductor_cache_dir()) / RECORD_DIR


def load(key: str) -> PlanRecord | None:
    """The plan record stored under ``key``; None when there is none or it cannot be read."""
    try:
        data = json.loads((record_dir() / f"{key}.json").read_text())
        share = None if data["share"] is None else GraphShare(**data["share"])
        return PlanRecord(share, tuple(data["warnings"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store(key: str, record: PlanRecord) -> None:
    """Write ``record`` under ``key`` atomically (a concurrent reader sees all of it or
    nothing)."""
    directory = record_dir()
    directory.mkdir(parents=True, exist_ok=True)
    text = json.dumps(dataclasses.asdict(record))
    with tempfile.NamedTemporaryFile("w", dir=directory, suffix=".tmp", delete=False) as file:
        file.write(text)
    os.replace(file.name, directory / f"{key}.json")
