"""The storm pipeline, in the order it runs: capture → annotate costs → plan → insert
transfers → verify → compile.

Capture and compile belong to AOTAutograd and the inner compiler; storm's part sits between
them, in :func:`storm_partition`, which AOTAutograd calls with the joint graph.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from torch import fx

from storm_compile.graphs import DECISION_KEY, JointGraph, PassContext, StormGraphs, saved_values
from storm_compile.passes import (
    annotate_costs,
    insert_transfers,
    plan_memory,
    plan_offload,
    rematerialize,
    schedule_transfers,
    verify_graphs,
)
from storm_compile.passes.verify import StormVerificationError

log = logging.getLogger("storm_compile")

Pass = Callable[[StormGraphs, PassContext], StormGraphs]

PLAN: tuple[Pass, ...] = (
    annotate_costs,      # bytes and predicted compute time of every node
    plan_offload,        # which saved storages may leave the device
    plan_memory,         # keep, offload or recompute each of them (decisions only)
)


def _run(storm_pass: Pass, graphs: StormGraphs, ctx: PassContext) -> StormGraphs:
    """Run one pass and verify the graphs it leaves; a failure names the pass. Logs its time
    at DEBUG level (``benchmarks/planning_time.py`` reads it)."""
    start = time.perf_counter()
    graphs = storm_pass(graphs, ctx)
    log.debug("storm: pass %s took %.3f s", storm_pass.__name__, time.perf_counter() - start)
    try:
        verify_graphs(graphs)
    except Exception as error:
        raise StormVerificationError(
            f"storm pass {storm_pass.__name__!r} left invalid graphs: {error}") from error
    return graphs


def run_passes(graphs: StormGraphs, ctx: PassContext) -> StormGraphs:
    """Plan, realise recomputation, plan the new split's offloads, place and insert transfers."""
    first_split = graphs.plan is None
    for storm_pass in PLAN:
        graphs = _run(storm_pass, graphs, ctx)
    if first_split and graphs.plan.recompute:
        graphs = _run(rematerialize, graphs, ctx)    # split again with recompute tags
        for storm_pass in PLAN:                      # offloads of the new split, same target
            graphs = _run(storm_pass, graphs, ctx)
    graphs = _run(schedule_transfers, graphs, ctx)   # where each copy and wait goes
    graphs = _run(insert_transfers, graphs, ctx)     # rewrite both graphs from the decisions
    moved = [n for n in saved_values(graphs)
             if n.meta.get(DECISION_KEY) and n.meta[DECISION_KEY].action == "offload"]
    if not moved and not graphs.plan.recompute:
        reasons = sorted({n.meta[DECISION_KEY].reason for n in saved_values(graphs)
                          if DECISION_KEY in n.meta})
        log.debug("storm: nothing to offload or recompute (%s); graphs run unchanged",
                  "; ".join(reasons) or "nothing is saved for the backward")
    return graphs


def storm_partition(joint: fx.GraphModule, joint_inputs, *, ctx: PassContext,
                    observer: Callable[[StormGraphs], None] | None = None,
                    **partition_kwargs) -> tuple[fx.GraphModule, fx.GraphModule]:
    # 1. capture: AOTAutograd traced the joint graph; split it the way torch.compile does.
    joint_graph = JointGraph(joint, joint_inputs, partition_kwargs)
    start = time.perf_counter()
    forward, backward = joint_graph.split()
    log.debug("storm: pass split took %.3f s", time.perf_counter() - start)
    graphs = StormGraphs(forward, backward, partition_kwargs["num_fwd_outputs"], joint=joint_graph)
    # 2-5. annotate costs, plan, (re-split to recompute), schedule, insert transfers; verified.
    graphs = run_passes(graphs, ctx)
    if observer is not None:
        observer(graphs)
    # 6. compile: AOTAutograd hands both graphs to the inner compiler.
    return graphs.forward, graphs.backward
