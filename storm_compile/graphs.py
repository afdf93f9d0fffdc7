"""The records passes exchange: the partitioned graphs, the pass context, per-node annotations."""

from __future__ import annotations

import dataclasses
import operator
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import fx
from torch._functorch.partitioners import min_cut_rematerialization_partition

from storm_compile.config import StormConfig
from storm_compile.ops import TRANSFER_OPS

if TYPE_CHECKING:
    from storm_compile.cost_model import CostModel
    from storm_compile.simulate import Prediction

DECISION_KEY = "storm_decision"
"""``node.meta`` key of the :class:`OffloadDecision` the planner writes on forward nodes."""

COST_KEY = "storm_cost"
"""``node.meta`` key of the :class:`NodeCost` written by ``annotate_costs``."""


@dataclasses.dataclass(frozen=True)
class JointGraph:
    """AOTAutograd's joint forward-backward graph and what its partitioner was called with."""

    module: fx.GraphModule
    inputs: Any
    partition_kwargs: dict[str, Any]

    def split(self) -> tuple[fx.GraphModule, fx.GraphModule]:
        """Partition as ``torch.compile`` does (min-cut), honouring recompute tags on nodes."""
        return min_cut_rematerialization_partition(self.module, self.inputs,
                                                   **self.partition_kwargs)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """What ``plan_memory`` aimed at for the whole step, kept across a re-split."""

    baseline: "Prediction"
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


@dataclasses.dataclass(frozen=True)
class StormGraphs:
    """A forward and backward graph pair as AOTAutograd's partitioner produced it.

    The forward returns ``num_fwd_outputs`` user-visible values (outputs, mutated inputs) followed
    by the values saved for the backward; the backward takes each saved value as a placeholder of
    the same name. ``joint`` lets a pass split again; ``plan`` is set by ``plan_memory``.
    """

    forward: fx.GraphModule
    backward: fx.GraphModule
    num_fwd_outputs: int
    joint: JointGraph | None = None
    plan: MemoryPlan | None = None


@dataclasses.dataclass(frozen=True)
class PassContext:
    config: StormConfig
    cost: "CostModel"


@dataclasses.dataclass(frozen=True)
class NodeCost:
    output_bytes: int
    """Bytes of the node's tensor outputs (0 for non-tensor values)."""

    is_compute: bool
    """Whether the node launches work on the compute stream (not a view, getitem or transfer)."""

    compute_s: float
    """Predicted seconds on the compute stream (0 unless ``is_compute``)."""


@dataclasses.dataclass(frozen=True)
class OffloadDecision:
    """What the planner decided for one saved value: stay on the device, cross the link, or be
    rebuilt in the backward by the partitioner. The unit of transfer is a storage: a saved
    view travels as the tensor that owns its storage (``storage``) and is rebuilt from it by
    replaying its view ops in the backward, so views sharing a storage cross the link once."""

    action: Literal["keep", "offload", "recompute"]
    reason: str
    storage: str
    """Name of the forward node owning the saved value's storage."""
    storage_bytes: int
    """Bytes of that storage: what the transfer moves and the device memory it frees."""
    offload_after: str | None = None
    """Forward node after which the D2H copy is issued (set by the scheduler)."""
    wait_after: str | None = None
    """Forward node after which the compute stream waits on the D2H copy (set by the scheduler)."""
    prefetch_after: str | None = None
    """Backward node after which the prefetch is issued; None: right after the graph inputs."""


def output_node(gm: fx.GraphModule) -> fx.Node:
    return next(iter(gm.graph.find_nodes(op="output")))


def saved_values(graphs: StormGraphs) -> list[fx.Node]:
    """Forward nodes returned for the backward, in output order."""
    outputs = output_node(graphs.forward).args[0]
    return [n for n in outputs[graphs.num_fwd_outputs:] if isinstance(n, fx.Node)]


def model_outputs(graphs: StormGraphs) -> list[fx.Node]:
    outputs = output_node(graphs.forward).args[0]
    return [n for n in outputs[:graphs.num_fwd_outputs] if isinstance(n, fx.Node)]


def backward_placeholder(graphs: StormGraphs, saved: fx.Node) -> fx.Node:
    """The backward input that receives the saved forward value ``saved``."""
    for node in graphs.backward.graph.find_nodes(op="placeholder"):
        if node.name == saved.name:
            return node
    raise RuntimeError(f"storm: saved forward value {saved.name!r} has no backward placeholder "
                       f"of the same name; the partitioner's naming contract changed")


def is_transfer(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in TRANSFER_OPS


UNANNOTATED_VIEWS = (torch.ops.aten._unsafe_view.default,)
"""Ops whose output shares its input's storage although their schema declares a fresh tensor."""


def is_view(node: fx.Node) -> bool:
    """Whether the node's output shares storage with its first input: view ops, items of a
    view op's list output, ``_unsafe_view``, and storm's ``record_event``/``wait_event``."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        source = node.args[0]
        return isinstance(source, fx.Node) and is_view(source)
    if node.target in UNANNOTATED_VIEWS:
        return True
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(r.alias_info is not None and not r.alias_info.is_write
                                      for r in schema.returns)


def view_chain(node: fx.Node) -> list[fx.Node]:
    """The view nodes from the storage owner (exclusive) down to ``node`` (inclusive), in order."""
    chain = []
    while is_view(node):
        chain.append(node)
        node = node.args[0]
    return chain[::-1]


def view_closure(node: fx.Node, order: dict[fx.Node, int]) -> tuple[list[fx.Node], list[fx.Node]]:
    """The views of ``node`` reached through views only, and the non-view users of ``node`` and
    of those views (the nodes that read its data), both sorted by ``order`` (the graph's node
    positions)."""
    views, readers, frontier = [], set(), [node]
    while frontier:
        current = frontier.pop()
        for user in current.users:
            if is_view(user) and user.args and user.args[0] is current:
                views.append(user)
                frontier.append(user)
            else:
                readers.add(user)
    return sorted(views, key=order.__getitem__), sorted(readers, key=order.__getitem__)


def first_backward_read(graphs: StormGraphs, saved: list[fx.Node],
                        order: dict[fx.Node, int]) -> fx.Node:
    """The first backward node (by ``order``) that reads the data of any forward value in
    ``saved``: views of the backward inputs do not count, the nodes reading through them do."""
    return min((r for m in saved for r in view_closure(backward_placeholder(graphs, m), order)[1]),
               key=order.__getitem__)


def alias_root(node: fx.Node) -> fx.Node:
    """The node that owns the storage ``node`` reads (``node`` itself unless it is a view)."""
    chain = view_chain(node)
    return chain[0].args[0] if chain else node


def is_dense(value: torch.Tensor) -> bool:
    """Whether the tensor's elements fill its storage span exactly, in some dimension order."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(value.shape, value.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True
