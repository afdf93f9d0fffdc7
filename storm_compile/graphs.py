"""The records passes exchange: the partitioned graphs, the pass context, per-node annotations."""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
from torch import fx

from storm_compile.config import StormConfig
from storm_compile.ops import TRANSFER_OPS

DECISION_KEY = "storm_decision"
"""``node.meta`` key of the :class:`OffloadDecision` the planner writes on forward nodes."""

COST_KEY = "storm_cost"
"""``node.meta`` key of the :class:`NodeCost` written by ``annotate_costs``."""


@dataclasses.dataclass(frozen=True)
class StormGraphs:
    """A forward and backward graph pair as AOTAutograd's partitioner produced it.

    The forward returns ``num_fwd_outputs`` user-visible values (outputs, mutated inputs) followed
    by the values saved for the backward; the backward takes each saved value as a placeholder of
    the same name.
    """

    forward: fx.GraphModule
    backward: fx.GraphModule
    num_fwd_outputs: int


@dataclasses.dataclass(frozen=True)
class PassContext:
    config: StormConfig


@dataclasses.dataclass(frozen=True)
class NodeCost:
    output_bytes: int
    """Bytes of the node's tensor outputs (0 for non-tensor values)."""

    is_compute: bool
    """Whether the node launches work on the compute stream (not a view, getitem or transfer)."""


@dataclasses.dataclass(frozen=True)
class OffloadDecision:
    action: Literal["keep", "offload"]
    reason: str
    nbytes: int


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


def is_view(node: fx.Node) -> bool:
    """Whether the node's output aliases one of its inputs (view ops, ``record/wait_event``)."""
    target = node.target
    schema = getattr(target, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def alias_root(node: fx.Node) -> fx.Node:
    """Follow view ops back to the node that owns the storage."""
    while is_view(node) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def is_dense(value: torch.Tensor) -> bool:
    """Whether the tensor's elements fill its storage span exactly, in some dimension order."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(value.shape, value.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True
