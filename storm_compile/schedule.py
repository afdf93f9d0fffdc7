"""The annotated schedule of a rewritten graph pair: rows in execution order, a summary of the
predicted step against the same graphs without storm, and a Perfetto/Chrome trace."""

from __future__ import annotations

import dataclasses

from tabulate import tabulate
from torch import fx

from storm_compile import ops
from storm_compile.cost_model import CostModel
from storm_compile.graphs import DECISION_KEY, StormGraphs
from storm_compile.simulate import COMPUTE, Prediction, simulate

US = 1e6
MS = 1e3


@dataclasses.dataclass(frozen=True)
class ScheduleRow:
    graph: str
    node: str
    op: str
    stream: str
    compute_us: float
    """Time the compute stream spends on the node; for a wait, the time it stalls."""
    transfer_bytes: int
    transfer_us: float
    event: str
    memory_after: int
    """Predicted device bytes live after the node, above weights and inputs."""
    decision: str


def _op_name(node: fx.Node) -> str:
    if node.op in ("placeholder", "output"):
        return node.op
    return str(getattr(node.target, "__name__", node.target))


def _events(gm: fx.GraphModule) -> dict[fx.Node, str]:
    records = gm.graph.find_nodes(op="call_function", target=ops.record_event)
    return {record: f"ev{index}" for index, record in enumerate(records)}


def schedule_rows(graphs: StormGraphs, prediction: Prediction) -> list[ScheduleRow]:
    timings = {(t.graph, t.node): t for t in prediction.timings}
    copies = {(c.graph, c.node): c for c in prediction.copies}
    rows = []
    for name, gm in (("fw", graphs.forward), ("bw", graphs.backward)):
        events = _events(gm)
        for node in gm.graph.nodes:
            timing = timings[(name, node.name)]
            copy = copies.get((name, node.name))
            stream, event = timing.lane, ""
            if node.target is ops.record_event:
                stream = "d2h" if node.args[0].target is ops.offload else "h2d"
                event = f"record {events[node]}"
            elif node.target is ops.wait_event:
                event = f"wait {events[node.args[0]]}"
            decision = node.meta.get(DECISION_KEY)
            rows.append(ScheduleRow(
                graph=name, node=node.name, op=_op_name(node), stream=stream,
                compute_us=(timing.end_s - timing.start_s) * US if timing.lane == COMPUTE else 0.0,
                transfer_bytes=copy.nbytes if copy else 0,
                transfer_us=(copy.end_s - copy.start_s) * US if copy else 0.0,
                event=event, memory_after=timing.memory_after,
                decision=f"{decision.action}: {decision.reason}" if decision else ""))
    return rows


def summary(graphs: StormGraphs, prediction: Prediction, baseline: Prediction,
            profile: str) -> dict[str, object]:
    storages = {n.meta[DECISION_KEY].storage: n.meta[DECISION_KEY]
                for n in graphs.forward.graph.nodes if DECISION_KEY in n.meta}
    return {
        "profile": profile,
        "predicted_step_ms": prediction.step_s * MS,
        "predicted_forward_ms": prediction.forward_s * MS,
        "baseline_step_ms": baseline.step_s * MS,
        "exposed_transfer_ms": prediction.exposed_transfer_s * MS,
        "activation_bytes": prediction.activation_bytes,
        "baseline_activation_bytes": baseline.activation_bytes,
        "peak_bytes": prediction.peak_bytes,
        "baseline_peak_bytes": baseline.peak_bytes,
        "offloaded_bytes": prediction.offloaded_bytes,
        "offloaded_storages": sum(d.action == "offload" for d in storages.values()),
        "kept_storages": sum(d.action == "keep" for d in storages.values()),
    }


def annotate(graphs: StormGraphs, cost: CostModel) -> dict[str, object]:
    """Everything the CLI prints: ``{"nodes": [...], "summary": {...}}`` and the prediction."""
    prediction = simulate(graphs, cost)
    baseline = simulate(graphs, cost, ignore_transfers=True)
    return {"nodes": [dataclasses.asdict(r) for r in schedule_rows(graphs, prediction)],
            "summary": summary(graphs, prediction, baseline, cost.profile.name),
            "prediction": prediction}


def _readable(key: str, value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    if key.endswith("_bytes"):
        return f"{value} ({value / (1 << 30):.3f} GiB)"
    return str(value)


def format_table(annotated: dict[str, object]) -> str:
    table = tabulate(annotated["nodes"], headers="keys", tablefmt="simple", floatfmt=".1f")
    totals = tabulate([(k, _readable(k, v)) for k, v in annotated["summary"].items()],
                      headers=["summary", "value"], disable_numparse=True)
    return f"{table}\n\n{totals}"


LANE_TIDS = {"compute": 1, "d2h": 2, "h2d": 3}


def chrome_trace(prediction: Prediction) -> dict[str, object]:
    """The predicted timeline as Chrome trace JSON, one track per lane (ui.perfetto.dev)."""
    events: list[dict[str, object]] = [
        {"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": lane}}
        for lane, tid in LANE_TIDS.items()]
    for t in prediction.timings:
        if t.lane == COMPUTE and t.end_s > t.start_s:
            events.append({"name": t.node, "cat": t.graph, "ph": "X", "pid": 1, "tid": 1,
                           "ts": t.start_s * US, "dur": (t.end_s - t.start_s) * US})
    for c in prediction.copies:
        events.append({"name": c.node, "cat": c.graph, "ph": "X", "pid": 1,
                       "tid": LANE_TIDS[c.lane], "ts": c.start_s * US,
                       "dur": (c.end_s - c.start_s) * US, "args": {"bytes": c.nbytes}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}
