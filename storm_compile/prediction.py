"""What the simulator predicts for a graph pair: the step, its memory, and each node's and
copy's place on the timeline."""

from __future__ import annotations

import dataclasses

from storm_compile.vocabulary import Lane


@dataclasses.dataclass(frozen=True)
class NodeTiming:
    graph: str
    node: str
    lane: Lane
    start_s: float
    end_s: float
    memory_after: int
    """Device bytes live after the node, above forward inputs (weights and inputs)."""


@dataclasses.dataclass(frozen=True)
class CopyTiming:
    graph: str
    node: str
    lane: Lane
    start_s: float
    end_s: float
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Prediction:
    step_s: float
    forward_s: float
    exposed_transfer_s: float
    """Time the compute lane spent waiting on copies."""
    activation_bytes: int
    """Device bytes held at the end of the forward, above weights and inputs."""
    peak_bytes: int
    offloaded_bytes: int
    timings: tuple[NodeTiming, ...]
    copies: tuple[CopyTiming, ...]
