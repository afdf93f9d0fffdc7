"""The storm pipeline, in the order it runs: capture → annotate costs → plan → schedule →
insert transfers → verify → compile.

Capture and compile belong to AOTAutograd and the inner compiler; storm's part sits between
them, in :func:`storm_partition`, which AOTAutograd calls with the joint graph.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from torch import fx
from torch._functorch.partitioners import min_cut_rematerialization_partition

from storm_compile.graphs import DECISION_KEY, PassContext, StormGraphs, saved_values
from storm_compile.passes import (
    annotate_costs,
    insert_transfers,
    plan_offload,
    schedule_transfers,
    verify_graphs,
)
from storm_compile.passes.verify import StormVerificationError

log = logging.getLogger("storm_compile")

Pass = Callable[[StormGraphs, PassContext], StormGraphs]

PASSES: tuple[Pass, ...] = (
    annotate_costs,      # bytes and predicted compute time of every node
    plan_offload,        # which saved storages may leave the device (decisions only)
    schedule_transfers,  # where each copy and wait goes; drops copies that would not hide
    insert_transfers,    # rewrite both graphs from the decisions
)


def run_passes(graphs: StormGraphs, ctx: PassContext) -> StormGraphs:
    """Run every pass in order, verifying the graphs after each; a failure names the pass."""
    for storm_pass in PASSES:
        graphs = storm_pass(graphs, ctx)
        try:
            verify_graphs(graphs)
        except Exception as error:
            raise StormVerificationError(
                f"storm pass {storm_pass.__name__!r} left invalid graphs: {error}") from error
    offloaded = [n for n in saved_values(graphs)
                 if n.meta.get(DECISION_KEY) and n.meta[DECISION_KEY].action == "offload"]
    if not offloaded:
        reasons = sorted({n.meta[DECISION_KEY].reason for n in saved_values(graphs)
                          if DECISION_KEY in n.meta})
        log.debug("storm: nothing to offload (%s); graphs run unchanged",
                  "; ".join(reasons) or "nothing is saved for the backward")
    return graphs


def storm_partition(joint: fx.GraphModule, joint_inputs, *, ctx: PassContext,
                    observer: Callable[[StormGraphs], None] | None = None,
                    **partition_kwargs) -> tuple[fx.GraphModule, fx.GraphModule]:
    # 1. capture: AOTAutograd traced the joint graph; split it the way torch.compile does.
    forward, backward = min_cut_rematerialization_partition(joint, joint_inputs,
                                                            **partition_kwargs)
    graphs = StormGraphs(forward, backward, partition_kwargs["num_fwd_outputs"])
    # 2-5. annotate costs, plan, schedule, insert transfers, verifying after each pass.
    graphs = run_passes(graphs, ctx)
    if observer is not None:
        observer(graphs)
    # 6. compile: AOTAutograd hands both graphs to the inner compiler.
    return graphs.forward, graphs.backward
