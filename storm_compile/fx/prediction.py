"""What the simulator predicts for a graph pair: the step, its memory, and each node's and
copy's place on the timeline."""

from __future__ import annotations

import dataclasses

from storm_compile.fx.vocabulary import Lane


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
class HostTiming:
    """One piece of work of storm's host thread: a gradient added into its parameter's
    ``.grad`` (``node`` is its ``storm.accumulate_grad``) or, with an overlapped optimizer, a
    parameter stepped (``node`` is the parameter's graph input)."""

    graph: str
    node: str
    work: str
    """``add`` or ``step``."""
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
    host_wait_s: float
    """Time the end of the backward waited for the host thread after its copies were done."""
    timings: tuple[NodeTiming, ...]
    copies: tuple[CopyTiming, ...]
    host: tuple[HostTiming, ...]


@dataclasses.dataclass(frozen=True)
class StepPrediction:
    """One optimizer step: ``micro_batches`` forward and backward passes of a graph pair and
    AdamW (fused, on the host) over the weights it streams."""

    micro_batches: int
    overlapped: bool
    """Whether the optimizer steps the weights during the last backward
    (:class:`~storm_compile.weights.streaming.OverlappedOptimizer`)."""
    accumulating: bool
    """Whether the micro-batches run in
    :func:`~storm_compile.weights.streaming.gradient_accumulation`: a backward does not wait for the
    host thread's additions, which run during the next micro-batch (whose backward waits for
    them)."""
    first_micro_batch_s: float
    """The first forward and backward, whose gradients become the weights' ``.grad`` without
    an addition (with one micro-batch, also the last), and the copies to the device of the
    trained weights kept there, which the optimizer changed."""
    micro_batch_s: float
    """A forward and backward whose gradients the host adds (accumulating: the host's
    additions when they take longer than the forward and backward)."""
    last_micro_batch_s: float
    """The last forward and backward; overlapped, its backward also steps the weights."""
    optimizer_s: float
    """Host time of ``optimizer.step()`` after the last backward (0 overlapped)."""
    exposed_transfer_s: float
    """Time one micro-batch's compute waits on copies."""
    first_host_wait_s: float
    """Time the end of the first micro-batch waits for the host thread (0 accumulating, with
    more than one micro-batch)."""
    host_wait_s: float
    """Time the end of each micro-batch between the first and the last waits for the host
    thread (0 accumulating)."""
    last_host_wait_s: float
    """Time the end of the last micro-batch waits for the host thread: its additions, and
    overlapped, the steps."""

    @property
    def host_s(self) -> float:
        """Time the step waits for the host: every micro-batch's additions, the steps the last
        backward waits for (overlapped) and the optimizer after it."""
        if self.micro_batches == 1:
            return self.first_host_wait_s + self.optimizer_s
        return (self.first_host_wait_s + (self.micro_batches - 2) * self.host_wait_s
                + self.last_host_wait_s + self.optimizer_s)

    @property
    def step_s(self) -> float:
        if self.micro_batches == 1:
            return self.first_micro_batch_s + self.optimizer_s
        return (self.first_micro_batch_s + (self.micro_batches - 2) * self.micro_batch_s
                + self.last_micro_batch_s + self.optimizer_s)
