"""The storm pipeline, in the order it runs: capture → annotate costs → plan → insert
transfers → verify → agree across ranks → compile.

Capture and compile belong to AOTAutograd and the inner compiler; storm's part sits between
them, in :func:`storm_partition`, which AOTAutograd calls with the joint graph.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
import warnings
from collections.abc import Callable

from torch import fx

from storm_compile.graphs import JointGraph, PassContext, PassRecord, StormGraphs
from storm_compile.passes import (
    annotate_costs,
    insert_transfers,
    place_transfers,
    plan_memory,
    plan_offload,
    plan_weights,
    rematerialize,
    verify_graphs,
)
from storm_compile.passes.rematerialize import RecomputeRejectedError
from storm_compile.passes.verify import StormVerificationError
from storm_compile.plan import Action
from storm_compile.ranks import check_ranks_agree
from storm_compile.streaming import refetch_in_backward, sum_gradients_on_device

log = logging.getLogger("storm_compile")

Pass = Callable[[StormGraphs, PassContext], StormGraphs]

PLAN: tuple[Pass, ...] = (
    annotate_costs,      # bytes and predicted compute time of every node
    plan_offload,        # which saved storages may leave the device
    plan_memory,         # keep, offload or recompute each of them (decisions only)
)


def _size(graphs: StormGraphs) -> tuple[int, int]:
    return len(graphs.forward.graph.nodes), len(graphs.backward.graph.nodes)


def _plan_summary(graphs: StormGraphs) -> str:
    if graphs.storages is None:
        return ""
    actions = collections.Counter(d.action.value for _, d in graphs.storages)
    placed = sum(d.placement is not None for _, d in graphs.storages)
    counts = [f"{action} {count}" for action, count in sorted(actions.items())]
    return ", ".join(counts + ([f"placed {placed}"] if placed else []))


def _changes(before: StormGraphs, after: StormGraphs, sizes: tuple[int, int]) -> str:
    """What a pass changed, in a few words: a new split, nodes added to either graph, the
    storage plan's decisions."""
    if after.forward is not before.forward:
        return "split again"
    changes = [f"{graph} {now - then:+d} nodes"
               for graph, then, now in zip(("forward", "backward"), sizes, _size(after))
               if now != then]
    plan = _plan_summary(after)
    if plan != _plan_summary(before):
        changes.append(f"plan: {plan}")
    return "; ".join(changes)


def _run(storm_pass: Pass, graphs: StormGraphs, ctx: PassContext) -> StormGraphs:
    """Run one pass, verify the graphs it leaves (a failure names the pass) and append its
    :class:`PassRecord` to them."""
    start, sizes = time.perf_counter(), _size(graphs)
    after = storm_pass(graphs, ctx)
    seconds = time.perf_counter() - start
    log.debug("storm: pass %s took %.3f s", storm_pass.__name__, seconds)
    try:
        verify_graphs(after)
    except Exception as error:
        raise StormVerificationError(
            f"storm pass {storm_pass.__name__!r} left invalid graphs: {error}") from error
    record = PassRecord(storm_pass.__name__, seconds, _changes(graphs, after, sizes))
    return dataclasses.replace(after, records=(*graphs.records, record))


def run_passes(graphs: StormGraphs, ctx: PassContext) -> StormGraphs:
    """Plan, realise recomputation, plan the new split's offloads, choose the resident weights,
    place and insert transfers."""
    first_split = graphs.plan is None
    for storm_pass in PLAN:
        graphs = _run(storm_pass, graphs, ctx)
    if first_split and graphs.plan.recompute:
        try:
            graphs = _run(rematerialize, graphs, ctx)    # split again with recompute tags
        except RecomputeRejectedError as error:
            warnings.warn(f"storm: the partitioner could not recompute what storm planned "
                          f"({error}); this graph uses storm's best plan without "
                          f"recomputation instead", RuntimeWarning, stacklevel=2)
            ctx = dataclasses.replace(
                ctx, config=dataclasses.replace(ctx.config, recompute=False))
            graphs = dataclasses.replace(graphs, plan=None)
        for storm_pass in PLAN:                      # offloads of the new split, same target
            graphs = _run(storm_pass, graphs, ctx)
    graphs = _run(plan_weights, graphs, ctx)         # streamed weights kept on the device
    graphs = _run(place_transfers, graphs, ctx)      # where each copy and wait goes
    graphs = _run(insert_transfers, graphs, ctx)     # rewrite both graphs from the decisions
    if not graphs.storages.with_action(Action.OFFLOAD) and not graphs.plan.recompute:
        reasons = sorted({d.reason for _, d in graphs.storages})
        log.debug("storm: nothing to offload or recompute (%s); graphs run unchanged",
                  "; ".join(reasons) or "nothing is saved for the backward")
    return graphs


def storm_partition(joint: fx.GraphModule, joint_inputs, *, ctx: PassContext,
                    observer: Callable[[StormGraphs], None] | None = None,
                    **partition_kwargs) -> tuple[fx.GraphModule, fx.GraphModule]:
    ctx = dataclasses.replace(ctx, graph=ctx.step.next_graph())
    # 1. capture: AOTAutograd traced the joint graph; split it the way torch.compile does,
    #    with streamed weights fetched again in the backward instead of saved, and a tied
    #    weight's gradients summed on the device.
    refetch_in_backward(joint)
    sum_gradients_on_device(joint)
    joint_graph = JointGraph(joint, joint_inputs, partition_kwargs)
    start = time.perf_counter()
    forward, backward = joint_graph.split()
    split = PassRecord("split", time.perf_counter() - start, "split")
    log.debug("storm: pass split took %.3f s", split.seconds)
    graphs = StormGraphs(forward, backward, partition_kwargs["num_fwd_outputs"], joint=joint_graph,
                         records=(split,))
    # 2-5. annotate costs, plan, (re-split to recompute), place, insert transfers; verified.
    graphs = run_passes(graphs, ctx)
    # 6. agree: every rank of a process group made this same plan.
    check_ranks_agree(graphs)
    if observer is not None:
        observer(graphs)
    # 7. compile: AOTAutograd hands both graphs to the inner compiler.
    return graphs.forward, graphs.backward
