"""The graph pair the passes work on, their context, and per-node cost annotations."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from torch import fx

from storm_compile.config import MemoryBudget, StormConfig
from storm_compile.cost.cost_model import CostModel
from storm_compile.fx.plan import Decision, MemoryPlan, StoragePlan, Unplaced
from storm_compile.fx.torch_private import (
    LazyGraphModule,
    min_cut_rematerialization_partition,
    use_lazy_graph_module,
)
from storm_compile.fx.vocabulary import view_closure
from storm_compile.planner.step_budget import GraphShare, StepView

COST_KEY = "storm_cost"
"""``node.meta`` key of the :class:`NodeCost` written by ``annotate_costs``."""


@dataclasses.dataclass(frozen=True)
class JointGraph:
    """AOTAutograd's joint forward-backward graph and what its partitioner was called with."""

    module: fx.GraphModule
    inputs: Any
    partition_kwargs: dict[str, Any]
    _split: list[tuple[fx.GraphModule, fx.GraphModule]] = dataclasses.field(
        default_factory=list, init=False, repr=False, compare=False)
    """The partitioner's split, once made."""

    def split(self) -> tuple[fx.GraphModule, fx.GraphModule]:
        """Partition as ``torch.compile`` does (min-cut), honouring the recompute tags the
        capture and the joint-graph passes left on nodes.

        A large graph's split takes seconds and the joint graph does not change after it, so
        the partitioner runs once; each call returns copies the passes may rewrite (their
        nodes' ``meta`` dicts copied, the values in them shared). The copies generate their
        Python code on first use (:func:`_copy_module`).

        Assumes: nothing rewrites the joint graph or its tags after the first call
        (``rematerialize`` rebuilds values on the split itself)."""
        if not self._split:
            with use_lazy_graph_module(True):
                self._split.append(min_cut_rematerialization_partition(
                    self.module, self.inputs, **self.partition_kwargs))
        forward, backward = self._split[0]
        return _copy_module(forward), _copy_module(backward)


def lazy_module(module: fx.GraphModule) -> fx.GraphModule:
    """``module`` as a lazy graph module on the same graph, with its ``meta``: its Python code
    is generated only when it is called or its ``code`` read. A joint graph is rewritten by
    storm's streaming passes and again by each partition (each recompiles it), and never run,
    so that code (half a CPU second for the streamed 28-layer Llama's) need never be made.
    AOTAutograd already hands over a lazy module (returned as it is) under dynamo's default
    config and :func:`~storm_compile.cli.commands.plan_model`; other callers of AOTAutograd may
    not. The graph now belongs to the returned module."""
    lazy = LazyGraphModule.from_graphmodule(module)
    if lazy is not module:
        lazy.meta.update(module.meta)
    return lazy


def _copy_module(module: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``module`` with its own graph, as a lazy graph module: its Python code is
    generated when it is first called or its ``code`` read (``recompile`` only marks it stale),
    so a split a re-plan discards, or rewrites and discards, never pays for code generation,
    which takes about as long as copying a large graph."""
    copied = LazyGraphModule(module, copy.deepcopy(module.graph), module.__class__.__name__)
    copied.meta.update(module.meta)
    return copied


@dataclasses.dataclass(frozen=True)
class PassRecord:
    """What one pass run did to a pair of graphs: the pipeline appends one per run."""

    name: str
    seconds: float
    changed: str
    """What the pass changed, in a few words (``""`` when nothing)."""
    code: tuple[tuple[str, str], ...] = ()
    """With ``PassContext.stages``: the Python code of each graph the pass left, as (graph,
    code) pairs (``joint``, or ``forward`` and ``backward``); empty otherwise."""


@dataclasses.dataclass(frozen=True)
class StormGraphs:
    """A forward and backward graph pair as AOTAutograd's partitioner produced it.

    The forward returns ``num_fwd_outputs`` user-visible values (outputs, mutated inputs) followed
    by the values saved for the backward; the backward takes each saved value as an input
    (:func:`backward_inputs` maps them). ``joint`` lets a re-plan start from a fresh copy of its
    split.
    """

    forward: fx.GraphModule
    backward: fx.GraphModule
    num_fwd_outputs: int
    joint: JointGraph | None = None
    storages: StoragePlan | None = None
    """Every storage the forward saves for the backward and its decision (``plan_offload``
    builds it for each split; later passes return it revised)."""
    plan: MemoryPlan | None = None
    """What the memory planner aimed at; set by ``plan_memory`` on the first split."""
    records: tuple[PassRecord, ...] = ()
    """One record per pass run on these graphs (and on the split they replaced), in order."""
    share: GraphShare | None = None
    """This graph's part of the step as its plan holds it: set by ``plan_memory``, its resident
    weights' bytes by ``plan_weights``; the pipeline records it in the step's ledger."""


def copy_decided(graphs: StormGraphs) -> StormGraphs:
    """A copy of a pair whose storages are decided but not yet placed, which passes may rewrite
    leaving ``graphs`` as it was: both modules copied (:func:`_copy_module`, which keeps every
    node's name, ``meta`` entries and order) and the storage plan's nodes those of the copies.

    Assumes: ``plan_offload`` ran on ``graphs`` and ``place_transfers`` has not (no
    placement, fetch or send, which would name nodes of their own; resident weights are named
    by their inputs' names); raises ``ValueError`` otherwise. ``graphs.plan`` is shared: its
    nodes are the first split's, which no pass rewrites."""
    plan = graphs.storages
    if plan is None or plan.fetches or plan.sends or any(
            d.placement is not None for d in plan.decisions.values()):
        raise ValueError("copy_decided: copy graphs whose storages are decided and not yet "
                         "placed")
    forward, backward = _copy_module(graphs.forward), _copy_module(graphs.backward)
    fw = {n.name: n for n in forward.graph.nodes}
    bw = {n.name: n for n in backward.graph.nodes}
    storages = tuple(dataclasses.replace(
        s, root=fw[s.root.name], members=tuple(fw[m.name] for m in s.members),
        first_read=None if s.first_read is None else bw[s.first_read.name])
        for s in plan.storages)
    decisions = {fw[root.name]: _decision_on(decision, bw)
                 for root, decision in plan.decisions.items()}
    return dataclasses.replace(graphs, forward=forward, backward=backward,
                               storages=dataclasses.replace(plan, storages=storages,
                                                            decisions=decisions))


def _decision_on(decision: Decision, backward: dict[str, fx.Node]) -> Decision:
    """``decision`` naming the backward node in ``backward`` of the same name as the read its
    copy would be late for (the only node an unplaced decision names)."""
    held = decision.held
    if not isinstance(held, Unplaced) or held.read is None:
        return decision
    return dataclasses.replace(decision, held=dataclasses.replace(held,
                                                                  read=backward[held.read.name]))


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the planner plans a graph against where it differs from the user's options, which
    are never rewritten: to fit a graph's device peak under a byte budget, or to trade
    activations for weights kept on the device, the planner's search
    (:func:`storm_compile.compiler.pipeline.plan_within_budget`) plans with a lower byte budget and
    a smaller prefetch window; where the planned recomputation cannot be rebuilt, the graph is
    planned without. None: the user's option."""

    budget_bytes: int | None = None
    prefetch_window_bytes: int | None = None
    recompute: bool | None = None
    link_bound: frozenset[str] = frozenset()
    """Storages (their roots' forward node names) whose copies a realised plan of the graph
    could not hide: where recomputation is decided, ``plan_memory`` prices offloading one with
    both its copies, the forward's and the backward's, against rebuilding it; the realised
    split prices its offloads as placed."""
    peak_error: bool = True
    """Whether a byte budget's device peak that no plan fits is an error (a graph's first
    plan), or the plan is kept with a warning (a run the step's ledger planned again, in the
    step that first showed it: from the next step on, the ledger plans for every run)."""


@dataclasses.dataclass(frozen=True)
class PassContext:
    config: StormConfig
    cost: CostModel
    others: StepView = StepView()
    """What the step's other graphs planned (budgets are the step's), frozen: the passes read
    it; the pipeline records what they return in the step's ledger."""
    resident_room: int = 0
    """Device bytes ``plan_weights`` may fill with streamed weights kept there: what a byte
    budget left above the predicted device peak of the graph's plan without them (0: none)."""
    stages: bool = False
    """Keep the graph code each pass leaves in its :class:`PassRecord` (``storm schedule
    --stages``). Off in the backend: a large graph's code takes about half a CPU second to
    generate, and nothing else reads it."""
    limits: Limits = Limits()
    """Where the planner plans against other numbers than the user's options (``config``)."""

    @property
    def memory_budget(self) -> MemoryBudget:
        """The budget this graph is planned against: the search's bytes, else the user's as
        storm plans it (:attr:`MemoryBudget.planned`: a byte budget less its margin)."""
        chosen = self.limits.budget_bytes
        return (self.config.memory_budget.planned if chosen is None
                else MemoryBudget(nbytes=chosen, margin=0.0))

    @property
    def prefetch_window_bytes(self) -> int:
        chosen = self.limits.prefetch_window_bytes
        return self.config.prefetch_window_bytes if chosen is None else chosen

    @property
    def recompute(self) -> bool:
        chosen = self.limits.recompute
        return self.config.recompute if chosen is None else chosen


@dataclasses.dataclass(frozen=True)
class NodeCost:
    output_bytes: int
    """Bytes of the node's tensor outputs (0 for non-tensor values)."""

    is_compute: bool
    """Whether the node launches work on the compute stream (not a view, getitem or transfer)."""

    compute_s: float
    """Predicted seconds on the compute stream (0 unless ``is_compute``)."""


def output_node(gm: fx.GraphModule) -> fx.Node:
    return next(iter(gm.graph.find_nodes(op="output")))


def saved_values(graphs: StormGraphs) -> list[fx.Node]:
    """Forward nodes returned for the backward, in output order."""
    outputs = output_node(graphs.forward).args[0]
    return [n for n in outputs[graphs.num_fwd_outputs:] if isinstance(n, fx.Node)]


def model_outputs(graphs: StormGraphs) -> list[fx.Node]:
    outputs = output_node(graphs.forward).args[0]
    return [n for n in outputs[:graphs.num_fwd_outputs] if isinstance(n, fx.Node)]


def is_symbolic(node: fx.Node) -> bool:
    """Whether ``node``'s value is a symbolic size (``SymInt``, ``SymFloat``, ``SymBool``)."""
    return isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool))


def backward_inputs(graphs: StormGraphs) -> dict[fx.Node, fx.Node]:
    """Each saved forward value, mapped to the backward input that receives it.

    The partitioner's contract (``_extract_fwd_bwd_modules``): the forward returns its outputs,
    then the saved tensors, then the saved symbolic sizes; the backward takes the saved
    symbolic sizes first, then the saved tensors, then the tangents. Positions, not names, tie
    them (functionalised RNG states, for one, are renamed in the backward)."""
    saved_all = saved_values(graphs)
    ordered = [n for n in saved_all if is_symbolic(n)] + \
        [n for n in saved_all if not is_symbolic(n)]
    inputs = list(graphs.backward.graph.find_nodes(op="placeholder"))
    if len(inputs) < len(ordered) or any(
            is_symbolic(i) != is_symbolic(s) for s, i in zip(ordered, inputs)):
        raise RuntimeError("storm: the backward's inputs do not match the forward's saved "
                           "values; the partitioner's input order changed")
    return dict(zip(ordered, inputs))


def first_backward_read(inputs: dict[fx.Node, fx.Node], saved: list[fx.Node],
                        order: dict[fx.Node, int]) -> fx.Node:
    """The first backward node (by ``order``) that reads the data of any forward value in
    ``saved``, given the :func:`backward_inputs` that receive them: views of the backward
    inputs do not count, the nodes reading through them do."""
    return min((r for m in saved for r in view_closure(inputs[m], order)[1]),
               key=order.__getitem__)
