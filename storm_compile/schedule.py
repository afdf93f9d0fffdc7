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


def summary(graphs: StormGraphs, prediction: Prediction, profile: str) -> dict[str, object]:
    storages = {n.meta[DECISION_KEY].storage: n.meta[DECISION_KEY]
                for n in graphs.forward.graph.nodes if DECISION_KEY in n.meta}
    plan, baseline = graphs.plan, graphs.plan.baseline
    return {
        "profile": profile,
        "predicted_step_ms": prediction.step_s * MS,
        "predicted_forward_ms": prediction.forward_s * MS,
        "baseline_step_ms": baseline.step_s * MS,
        "exposed_transfer_ms": prediction.exposed_transfer_s * MS,
        "activation_bytes": prediction.activation_bytes,
        "baseline_activation_bytes": baseline.activation_bytes,
        "budget_bytes": plan.target_bytes,
        "minimum_activation_bytes": plan.minimum_bytes,
        "peak_bytes": prediction.peak_bytes,
        "baseline_peak_bytes": baseline.peak_bytes,
        "offloaded_bytes": prediction.offloaded_bytes,
        "recomputed_bytes": plan.recompute_bytes,
        "recompute_ms": plan.recompute_s * MS,
        "offloaded_storages": sum(d.action == "offload" for d in storages.values()),
        "recomputed_storages": sum(d.action == "recompute" for d in storages.values()),
        "kept_storages": sum(d.action == "keep" for d in storages.values()),
    }


def annotate(graphs: StormGraphs, cost: CostModel) -> dict[str, object]:
    """Everything the CLI prints: ``{"nodes": [...], "summary": {...}}`` and the prediction."""
    prediction = simulate(graphs, cost)
    return {"nodes": [dataclasses.asdict(r) for r in schedule_rows(graphs, prediction)],
            "summary": summary(graphs, prediction, cost.profile.name),
            "prediction": prediction}


def _readable(key: str, value: object) -> str:
    if value is None:
        return "-"
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


PARETO_COLUMNS = ("budget_bytes", "predicted_step_ms", "step_ratio", "activation_bytes",
                  "peak_bytes", "offloaded_bytes", "recomputed_bytes", "frontier")


def pareto_points(summaries: list[dict[str, object]]) -> list[dict[str, object]]:
    """One row per planned budget, with the step time relative to no storm, and whether the
    point is on the frontier (no other point is at least as fast with no more memory)."""
    points = [{"budget_bytes": s["budget_bytes"], "predicted_step_ms": s["predicted_step_ms"],
               "step_ratio": s["predicted_step_ms"] / s["baseline_step_ms"],
               "activation_bytes": s["activation_bytes"], "peak_bytes": s["peak_bytes"],
               "offloaded_bytes": s["offloaded_bytes"], "recomputed_bytes": s["recomputed_bytes"]}
              for s in summaries]
    for p in points:
        p["frontier"] = not any(
            q is not p and q["predicted_step_ms"] <= p["predicted_step_ms"]
            and q["activation_bytes"] <= p["activation_bytes"]
            and (q["predicted_step_ms"], q["activation_bytes"])
            != (p["predicted_step_ms"], p["activation_bytes"]) for q in points)
    return points


def format_pareto(points: list[dict[str, object]]) -> str:
    rows = [[_readable(k, p[k]) for k in PARETO_COLUMNS] for p in points]
    return tabulate(rows, headers=PARETO_COLUMNS, disable_numparse=True)


SVG_SIZE = (640, 420)
SVG_MARGIN = 60


def pareto_svg(points: list[dict[str, object]], title: str) -> str:
    """The frontier as an SVG scatter: activation memory (GiB) against predicted step (ms)."""
    width, height = SVG_SIZE
    xs = [p["activation_bytes"] / (1 << 30) for p in points]
    ys = [p["predicted_step_ms"] for p in points]
    x_max, y_min, y_max = max(xs) or 1.0, min(ys), max(ys)
    y_span = (y_max - y_min) or 1.0

    def sx(x: float) -> float:
        return SVG_MARGIN + x / x_max * (width - 2 * SVG_MARGIN)

    def sy(y: float) -> float:
        return height - SVG_MARGIN - (y - y_min) / y_span * (height - 2 * SVG_MARGIN)

    frontier = sorted((x, y) for x, y, p in zip(xs, ys, points) if p["frontier"])
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">',
             f'<text x="{width / 2}" y="24" text-anchor="middle">{title}: predicted frontier'
             f'</text>',
             f'<text x="{width / 2}" y="{height - 16}" text-anchor="middle">activation memory '
             f'(GiB, 0 to {x_max:.2f})</text>',
             f'<text x="16" y="{height / 2}" transform="rotate(-90 16 {height / 2})" '
             f'text-anchor="middle">predicted step (ms, {y_min:.1f} to {y_max:.1f})</text>',
             '<polyline fill="none" stroke="steelblue" points="'
             + " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in frontier) + '"/>']
    for x, y in zip(xs, ys):
        parts.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="4" fill="steelblue">'
                     f'<title>{x:.3f} GiB, {y:.2f} ms</title></circle>')
    parts.append("</svg>")
    return "\n".join(parts)
