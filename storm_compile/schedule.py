"""The annotated schedule of a pair of rewritten graphs: one row per node in execution order."""

from __future__ import annotations

import dataclasses

from tabulate import tabulate
from torch import fx

from storm_compile import ops
from storm_compile.graphs import COST_KEY, DECISION_KEY, StormGraphs

COMPUTE_STREAM = "compute"
D2H_STREAM = "d2h"
H2D_STREAM = "h2d"


@dataclasses.dataclass(frozen=True)
class ScheduleRow:
    graph: str
    index: int
    node: str
    op: str
    stream: str
    event: str
    bytes: int
    decision: str


def _op_name(node: fx.Node) -> str:
    if node.op in ("placeholder", "output"):
        return node.op
    return str(getattr(node.target, "__name__", node.target))


def _copy_stream(transfer: fx.Node) -> str:
    return D2H_STREAM if transfer.target is ops.offload else H2D_STREAM


def graph_rows(gm: fx.GraphModule, graph_name: str) -> list[ScheduleRow]:
    rows: list[ScheduleRow] = []
    events: dict[fx.Node, str] = {}
    for index, node in enumerate(gm.graph.nodes):
        stream, event = COMPUTE_STREAM, ""
        if node.op in ("placeholder", "output"):
            stream = "-"
        if node.target in (ops.offload, ops.prefetch):
            stream = _copy_stream(node)
        elif node.target is ops.record_event:
            stream = _copy_stream(node.args[0])
            events[node] = f"ev{len(events)}"
            event = f"record {events[node]}"
        elif node.target is ops.wait_event:
            event = f"wait {events[node.args[0]]}"
        decision = node.meta.get(DECISION_KEY)
        sized = node.args[0] if node.target in (ops.offload, ops.prefetch) else node
        cost = sized.meta.get(COST_KEY)
        nbytes = cost.output_bytes if cost else 0
        rows.append(ScheduleRow(
            graph=graph_name, index=index, node=node.name, op=_op_name(node), stream=stream,
            event=event, bytes=nbytes,
            decision=(f"{decision.action}: {decision.reason}" if decision else "")))
    return rows


def schedule_rows(graphs: StormGraphs) -> list[ScheduleRow]:
    return graph_rows(graphs.forward, "fw") + graph_rows(graphs.backward, "bw")


def summary(graphs: StormGraphs) -> dict[str, int]:
    storages = {n.meta[DECISION_KEY].storage: n.meta[DECISION_KEY]
                for n in graphs.forward.graph.nodes if DECISION_KEY in n.meta}
    offloaded = [d for d in storages.values() if d.action == "offload"]
    kept = [d for d in storages.values() if d.action == "keep"]
    return {
        "saved_storages": len(storages),
        "offloaded_storages": len(offloaded),
        "offloaded_bytes": sum(d.storage_bytes for d in offloaded),
        "kept_bytes": sum(d.storage_bytes for d in kept),
    }


def format_table(graphs: StormGraphs) -> str:
    rows = [dataclasses.asdict(r) for r in schedule_rows(graphs)]
    table = tabulate(rows, headers="keys", tablefmt="simple")
    totals = summary(graphs)
    lines = [table, "", tabulate(list(totals.items()), headers=["summary", "value"])]
    return "\n".join(lines)
