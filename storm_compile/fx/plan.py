"""The plan the passes hand each other: every storage saved for the backward, and what is done
with it.

``plan_offload`` builds a :class:`StoragePlan` once per split: one :class:`Storage` per storage
saved for the backward (its owner, the saved values sharing it, its bytes, its first backward
read) with its :class:`Eligibility`, and a :class:`Decision` for each. ``plan_memory`` decides
every movable storage (:class:`Action`, with the :class:`Figures` behind the choice);
``place_transfers`` gives each offload its :class:`Placement`; ``insert_transfers`` rewrites
the graphs from it and the report reads it. Each pass returns a new plan; records are frozen.
A decision's ``reason`` is prose made from its fields, for people; code reads the fields.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterator

from torch import fx

from storm_compile.fx.prediction import Prediction
from storm_compile.fx.vocabulary import US, Lane


class Action(enum.Enum):
    """What happens to a storage saved for the backward."""

    KEEP = "keep"
    """It stays on the device from the forward to its last backward read."""
    OFFLOAD = "offload"
    """It crosses the link to pinned host memory in the forward and back before its first
    backward read."""
    RECOMPUTE = "recompute"
    """The partitioner rebuilds it in the backward from the values that stay saved."""

    def __str__(self) -> str:
        return self.value


class Rule(enum.Enum):
    """Why a storage must stay on the device, whatever the budget (the checks
    ``plan_offload`` makes, in order); ``{}`` is filled with the rule's ``detail``."""

    NOT_TENSOR = "not a tensor"
    HIGHER_ORDER_OUTPUT = ("an output of a higher-order op (such as the RNG state of a "
                           "checkpointed region)")
    GRAPH_INPUT = "storage of a graph input (parameter, buffer or user input)"
    TRANSFERRED = "already produced by a storm transfer"
    VISIBLE_OUTPUT = "storage shared with a user-visible output"
    EMPTY = "empty tensor"
    NOT_ON_CUDA = "on {}, not a CUDA device"
    NOT_DENSE = "storage owner not dense in memory"
    BELOW_MIN_BYTES = "smaller than min_offload_bytes ({})"
    NOT_READ = "not read by the backward"
    VIEW_DEPENDS = "a saved view of it depends on other values"


@dataclasses.dataclass(frozen=True)
class Eligibility:
    """Whether a storage may leave the device: ``rule`` is None when it may."""

    rule: Rule | None = None
    detail: object = None
    """The rule's parameter (the device type, ``min_offload_bytes``)."""

    @property
    def movable(self) -> bool:
        return self.rule is None

    def __str__(self) -> str:
        return "can be offloaded" if self.rule is None else self.rule.value.format(self.detail)


MOVABLE = Eligibility()


@dataclasses.dataclass(frozen=True)
class Storage:
    """A storage saved for the backward: the unit that stays, moves or is rebuilt. Saved values
    sharing one storage (a tensor and its views, q/k/v split from one projection) are decided
    together: the device memory is freed only when none of them is held."""

    root: fx.Node
    """The forward node owning the storage (its producer)."""
    members: tuple[fx.Node, ...]
    """The saved forward values living in it (``root`` and/or views of it), in output order."""
    nbytes: int
    """The device memory it frees."""
    link_bytes: int
    """What each of its copies moves: ``nbytes``, or its packed fp8 bytes
    (:func:`~storm_compile.fx.fp8.link_bytes`), and the pinned host memory it holds."""
    first_read: fx.Node | None
    """The first backward node reading its data (views of it do not count); None when the
    backward does not read it."""
    eligibility: Eligibility

    @property
    def name(self) -> str:
        return self.root.name


@dataclasses.dataclass(frozen=True)
class Figures:
    """The predicted costs a storage's action was chosen by."""

    offload_s: float
    """Step time an offload adds: host time, plus the D2H copy when it cannot hide."""
    recompute_s: float | None
    """Backward compute its recomputation adds; None when it cannot be recomputed."""
    no_recompute: str
    """Why it cannot be recomputed (``""`` when it can)."""
    hides: bool
    """Whether both its copies are predicted to hide beside every other candidate's."""
    host_full: bool = False
    """Pinned host memory (``host_memory_limit``) had no room left for its copy when the plan
    reached it: it can only be recomputed."""

    @property
    def cheaper(self) -> Action:
        """The cheaper way to remove the storage from the device (recomputation when the host
        is full)."""
        rebuild = self.recompute_s is not None and (self.host_full
                                                    or self.recompute_s < self.offload_s)
        return Action.RECOMPUTE if rebuild else Action.OFFLOAD

    @property
    def cost_s(self) -> float:
        return self.recompute_s if self.cheaper is Action.RECOMPUTE else self.offload_s


class Held(enum.Enum):
    """Why a movable storage stays (it was not chosen)."""

    HOST_TIME = "its host time would pass max_overhead"
    """No budget: offloads may spend only part of ``max_overhead``."""
    COST = "its cost would pass max_overhead"
    """``"auto"``: removing it would cost more than ``max_overhead`` allows."""
    BUDGET_MET = "the budget is met without it"
    HOST_MEMORY = "host_memory_limit has no room left for its copy, and it cannot be recomputed"


@dataclasses.dataclass(frozen=True)
class Unplaced:
    """Why a storage's copies cannot hide on the link beside the others."""

    lane: Lane
    read: fx.Node | None
    """The first backward read the H2D copy would be late for (None for a D2H copy)."""
    late_s: float
    """How far past its deadline the copy would end (the forward's last compute node for D2H,
    its first read for H2D); 0 when the prefetch window is the reason."""
    window_bytes: int | None = None
    """The prefetch window that is full before ``read`` (None: lateness is the reason)."""

    def __str__(self) -> str:
        if self.lane is Lane.D2H:
            return (f"D2H copy would end {self.late_s * US:.0f} µs after the forward's last "
                    f"compute node")
        if self.window_bytes is None:
            return (f"H2D copy would end {self.late_s * US:.0f} µs after its first backward "
                    f"read ({self.read.name})")
        return (f"prefetch window ({self.window_bytes} bytes) full before its first backward "
                f"read ({self.read.name})")


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where an offloaded storage's copies and waits go, and their predicted slack."""

    offload_after: fx.Node
    """Forward node after which the D2H copy is issued."""
    wait_after: fx.Node
    """Forward node after which the compute stream waits on the D2H copy."""
    prefetch_after: fx.Node | None
    """Backward node after which the prefetch is issued; None: right after the graph inputs."""
    d2h_slack_s: float
    h2d_slack_s: float
    """Predicted time between each copy's end and its deadline (positive: hidden)."""


@dataclasses.dataclass(frozen=True)
class Decision:
    """What is done with one storage, and why."""

    action: Action
    eligibility: Eligibility
    figures: Figures | None = None
    """Set by ``plan_memory`` on every movable storage."""
    held: Held | Unplaced | None = None
    """Why a movable storage stays."""
    placement: Placement | None = None
    """Set by ``place_transfers`` on every offload."""

    @property
    def reason(self) -> str:
        """The decision in words, from its fields."""
        if not self.eligibility.movable or self.figures is None:
            return str(self.eligibility)
        f = self.figures
        if self.action is Action.KEEP:
            return self.held.value if isinstance(self.held, Held) else str(self.held)
        if self.action is Action.RECOMPUTE and f.host_full:
            return (f"rebuilt in {f.recompute_s * US:.0f} µs: host_memory_limit has no room "
                    f"left for an offload")
        if self.action is Action.RECOMPUTE:
            return (f"rebuilt in {f.recompute_s * US:.0f} µs, below an offload's "
                    f"{f.offload_s * US:.0f} µs")
        copy = "copies predicted to hide" if f.hides else "link-bound copy"
        alternative = (f"not recomputed: {f.no_recompute}" if f.recompute_s is None
                       else f"recompute would take {f.recompute_s * US:.0f} µs")
        reason = f"{copy}, {f.offload_s * US:.0f} µs added; {alternative}"
        if self.placement is not None:
            reason += (f"; D2H slack {self.placement.d2h_slack_s * US:+.0f} µs, H2D slack "
                       f"{self.placement.h2d_slack_s * US:+.0f} µs")
        return reason


@dataclasses.dataclass(frozen=True)
class WeightFetch:
    """A streamed weight's copy to the device in one graph (a ``storm.fetch_weight`` node), and
    where ``place_transfers`` put it on the H2D lane."""

    node: fx.Node
    """The ``storm.fetch_weight`` node; its first argument is the host weight, a graph input."""
    nbytes: int
    first_read: fx.Node
    """The first node of its graph reading the device copy (views of it do not count)."""
    issue_after: fx.Node | None = None
    """Node after which the copy is issued; None: right after the graph inputs."""
    slack_s: float = 0.0
    """Predicted time between the copy's end and its first read (positive: hidden)."""


@dataclasses.dataclass(frozen=True)
class GradSend:
    """A streamed weight's gradient sent home from the backward (a ``storm.grad_to_host``
    node), and where ``place_transfers`` put its copy on the D2H lane."""

    node: fx.Node
    """The ``storm.grad_to_host`` node; its first argument is the gradient on the device."""
    nbytes: int
    issue_after: fx.Node
    """Node after which the copy is issued (the gradient's producer or a later node)."""
    wait_after: fx.Node
    """Node after which the compute stream waits for the copy, releasing the gradient."""
    slack_s: float
    """Predicted time between the copy's end and that wait (positive: hidden)."""


@dataclasses.dataclass(frozen=True)
class ResidentWeight:
    """A streamed weight the planner keeps on the device: both graphs read it through
    ``storm.resident_weight``, which copies it to the device again only when it changed."""

    name: str
    """The host weight's graph input, named the same in both graphs."""
    nbytes: int
    summed: bool = False
    """Its gradients are summed on the device across a step's backwards and sent home once,
    by the last (``storm.send_grad`` with the weight): the plan leaves room there for the sum,
    ``nbytes`` more."""

    @property
    def device_bytes(self) -> int:
        """What it holds on the device across the step: the weight, and its gradients' sum."""
        return self.nbytes * (2 if self.summed else 1)


@dataclasses.dataclass(frozen=True)
class StoragePlan:
    """Every storage saved for the backward by one split, in the order of the saved values,
    and the decision for each (keyed by the storage's root); and, once placed, every streamed
    weight's fetch in either graph, on the same H2D lane as the storages' prefetches, every
    streamed weight's gradient sent home on the backward's D2H lane, and the streamed weights
    kept on the device instead of fetched."""

    storages: tuple[Storage, ...]
    decisions: dict[fx.Node, Decision]
    fetches: tuple[WeightFetch, ...] = ()
    sends: tuple[GradSend, ...] = ()
    resident: tuple[ResidentWeight, ...] = ()

    def __iter__(self) -> Iterator[tuple[Storage, Decision]]:
        return ((s, self.decisions[s.root]) for s in self.storages)

    def movable(self) -> tuple[Storage, ...]:
        return tuple(s for s in self.storages if s.eligibility.movable)

    def with_action(self, action: Action) -> tuple[Storage, ...]:
        return tuple(s for s, d in self if d.action is action)

    def decided(self, decisions: dict[fx.Node, Decision]) -> StoragePlan:
        """This plan with the decisions of some storages replaced."""
        return dataclasses.replace(self, decisions={**self.decisions, **decisions})


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """What ``plan_memory`` aimed at for the whole step, kept across ``rematerialize``."""

    baseline: Prediction
    """The step as the partitioner first split it, without storm."""
    target_bytes: int | None
    """Activation memory the plan must reach; None when there is no budget."""
    minimum_bytes: int
    """The least activation memory the first split allows: what nothing can move."""
    recompute: tuple[str, ...]
    """Forward nodes (storage owners and their saved views) tagged for recomputation."""
    recompute_bytes: int
    recompute_s: float
    """Predicted compute the recomputation adds to the backward."""
    recomputed: tuple[tuple[Storage, Decision], ...] = ()
    """The first split's storages chosen for recomputation: the later split no longer saves
    them, and the report still shows them."""
