"""The report of a planned graph pair (what ``storm schedule`` prints): every node in execution
order with its lane, timing and decision, every saved storage with its decision, a summary of
the predicted step against the same graphs without storm, and a Perfetto/Chrome trace."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Sequence

from tabulate import tabulate
from torch import fx

from storm_compile.cost.cost_model import CostModel
from storm_compile.cost.simulate import device_bytes, host_inputs, simulate
from storm_compile.fx.graphs import PassRecord, StormGraphs
from storm_compile.fx.plan import Action, Decision, Storage
from storm_compile.fx.prediction import Prediction, StepPrediction
from storm_compile.fx.vocabulary import COPY_LANES, GIB, MS, US, Lane, node_order, tensor_bytes
from storm_compile.runtime import ops


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


def _decided(graphs: StormGraphs) -> list[tuple[Storage, Decision]]:
    """Each saved storage of the forward and its decision, with the storages recomputed by an
    earlier split (the forward still computes them, by name), in forward order."""
    nodes = {n.name: n for n in graphs.forward.graph.nodes}
    order = node_order(graphs.forward)
    decided = [*graphs.storages, *((s, d) for s, d in graphs.plan.recomputed
                                   if s.name in nodes)]
    return sorted(decided, key=lambda sd: order[nodes[sd[0].name]])


def schedule_rows(graphs: StormGraphs, prediction: Prediction) -> list[ScheduleRow]:
    """One row per node of both graphs; a forward node owning or holding a saved storage shows
    the storage's decision."""
    timings = {(t.graph, t.node): t for t in prediction.timings}
    copies = {(c.graph, c.node): c for c in prediction.copies}
    decisions = {n.name: d for s, d in _decided(graphs) for n in (s.root, *s.members)}
    rows = []
    for name, gm in (("fw", graphs.forward), ("bw", graphs.backward)):
        events = _events(gm)
        for node in gm.graph.nodes:
            timing = timings[(name, node.name)]
            copy = copies.get((name, node.name))
            stream, event = timing.lane, ""
            if node.target is ops.record_event:
                stream = COPY_LANES[node.args[0].target]
                event = f"record {events[node]}"
            elif node.target is ops.wait_event:
                event = f"wait {events[node.args[0]]}"
            elif node.target is ops.accumulate_grad:
                event = f"add after {events[node.args[0].args[0]]}"
            elif node.target is ops.wait_host:
                event = f"wait {len(node.args[0])} adds"
            decision = decisions.get(node.name) if name == "fw" else None
            rows.append(ScheduleRow(
                graph=name, node=node.name, op=_op_name(node), stream=str(stream),
                compute_us=(timing.end_s - timing.start_s) * US
                if timing.lane is Lane.COMPUTE else 0.0,
                transfer_bytes=copy.nbytes if copy else 0,
                transfer_us=(copy.end_s - copy.start_s) * US if copy else 0.0,
                event=event, memory_after=timing.memory_after,
                decision=f"{decision.action}: {decision.reason}" if decision else ""))
    return rows


@dataclasses.dataclass(frozen=True)
class StorageRow:
    storage: str
    """Forward node owning the storage saved for the backward."""
    bytes: int
    decision: str
    """``keep``, ``offload`` or ``recompute``."""
    reason: str
    graph_input: bool
    """A parameter's, buffer's or user input's storage: saved for the backward but not activation
    memory, so it always stays."""


def storage_rows(graphs: StormGraphs) -> list[StorageRow]:
    """One row per storage saved for the backward, in forward order."""
    return [StorageRow(storage=s.name, bytes=s.nbytes, decision=d.action.value,
                       reason=d.reason, graph_input=s.root.op == "placeholder")
            for s, d in _decided(graphs)]


def summary(graphs: StormGraphs, prediction: Prediction, profile: str,
            tokens: int | None = None, host_format: str | None = None) -> dict[str, object]:
    """Every figure of the plan; with ``tokens`` (tokens per micro-batch, for a language model)
    also the predicted tokens per second of its forward and backward; ``host_format`` is the
    format the frozen streamed weights were held in (None: their dtype)."""
    actions = [d.action for _, d in _decided(graphs)]
    plan, baseline = graphs.plan, graphs.plan.baseline
    streamed = host_inputs(graphs)
    return {
        "profile": profile,
        "predicted_step_ms": prediction.step_s * MS,
        "predicted_forward_ms": prediction.forward_s * MS,
        "baseline_step_ms": baseline.step_s * MS,
        "exposed_transfer_ms": prediction.exposed_transfer_s * MS,
        "host_wait_ms": prediction.host_wait_s * MS,
        "activation_bytes": prediction.activation_bytes,
        "baseline_activation_bytes": baseline.activation_bytes,
        "budget_bytes": plan.target_bytes,
        "minimum_activation_bytes": plan.minimum_bytes,
        "peak_bytes": prediction.peak_bytes,
        "baseline_peak_bytes": baseline.peak_bytes,
        "offloaded_bytes": prediction.offloaded_bytes,
        "recomputed_bytes": plan.recompute_bytes,
        "recompute_ms": plan.recompute_s * MS,
        "offloaded_storages": actions.count(Action.OFFLOAD),
        "recomputed_storages": actions.count(Action.RECOMPUTE),
        "kept_storages": actions.count(Action.KEEP),
        "streamed_weight_bytes": sum(tensor_bytes(n.meta.get("val")) for n in streamed),
        "host_format": host_format,
        "resident_weight_bytes": sum(w.nbytes for w in graphs.storages.resident),
        "summed_gradient_bytes": sum(w.nbytes for w in graphs.storages.resident if w.summed),
        "device_bytes": device_bytes(graphs, prediction),
        "tokens": tokens,
        "predicted_tokens_per_s": None if tokens is None else tokens / prediction.step_s,
    }


def annotate(graphs: StormGraphs, cost: CostModel, tokens: int | None = None,
             host_format: str | None = None) -> dict[str, object]:
    """Everything the CLI prints: ``{"nodes": [...], "storages": [...], "summary": {...}}`` and
    the prediction (``tokens`` and ``host_format`` as :func:`summary` takes them)."""
    prediction = simulate(graphs, cost)
    return {"nodes": [dataclasses.asdict(r) for r in schedule_rows(graphs, prediction)],
            "storages": [dataclasses.asdict(r) for r in storage_rows(graphs)],
            "summary": summary(graphs, prediction, cost.profile.name, tokens, host_format),
            "prediction": prediction}


def _readable(key: str, value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    if key.endswith("_bytes"):
        return _size(value)
    return str(value)


SIZE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")
REASON_WIDTH = 64
"""Characters of a reason the storage table shows, keeping it within about 100 columns; the JSON
and ``--nodes`` carry every reason whole."""


def _size(nbytes: int) -> str:
    """Bytes in the largest binary unit below them, to three or four significant digits."""
    value, unit = float(nbytes), 0
    while value >= 1024 and unit < len(SIZE_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    if unit == 0:
        return f"{nbytes} B"
    return f"{value:.{2 if value < 10 else 1 if value < 100 else 0}f} {SIZE_UNITS[unit]}"


@dataclasses.dataclass(frozen=True)
class Column:
    """One column of a text table: the row field it shows, its header, how a value reads, and
    whether it is left-aligned (text) rather than right-aligned (numbers and sizes, which then
    line up at their units)."""

    field: str
    header: str
    show: Callable[[object], str]
    left: bool = False


NAME_WIDTH = 21
"""Characters of a node's or op's name the ``--nodes`` table shows (a longer one keeps its
start and its end, where a node's number is, around "…"; the JSON has it whole): a row stays
within 120 columns."""


def _cut(text: str, width: int = NAME_WIDTH) -> str:
    if len(text) <= width:
        return text
    head = (width - 1) // 2
    return f"{text[:head]}…{text[len(text) - (width - 1 - head):]}"


def _us(value: float) -> str:
    return f"{value:.1f}" if value else ""


NODE_TEXT = (Column("node", "node", _cut, left=True),
             Column("op", "op", lambda v: _cut(v.removesuffix(".default")), left=True),
             Column("stream", "lane", str, left=True), Column("compute_us", "µs", _us),
             Column("transfer_bytes", "copy", lambda v: _size(v) if v else ""),
             Column("transfer_us", "copy µs", _us), Column("event", "event", str, left=True),
             Column("memory_after", "memory", _size),
             Column("decision", "decision", lambda v: v.split(":")[0], left=True))
"""The columns of ``storm schedule --nodes``. A decision shows its action (the storage table
and the JSON give the reason)."""


def format_table(annotated: dict[str, object]) -> str:
    """Every node of both graphs, each graph under its name, then every summary figure
    (``storm schedule --nodes``)."""
    tables = [f"{title}\n" + _text_table([r for r in annotated["nodes"] if r["graph"] == graph],
                                         NODE_TEXT)
              for graph, title in (("fw", "forward"), ("bw", "backward"))]
    totals = tabulate([(k, _readable(k, v)) for k, v in annotated["summary"].items()],
                      headers=["summary", "value"], disable_numparse=True)
    return "\n\n".join([*tables, totals])


def _change(before: float, after: float) -> str:
    return f"{(after / before - 1) * 100:+.1f} %" if before else "-"


def _short(reason: str) -> str:
    """A reason's first clause, cut to REASON_WIDTH."""
    first = reason.split(";")[0]
    return first if len(first) <= REASON_WIDTH else first[:REASON_WIDTH - 1] + "…"


def format_storages(annotated: dict[str, object], title: str) -> str:
    """What ``storm schedule`` prints by default: the predicted step and memory with storm
    against without, then one row per activation storage saved for the backward."""
    s = annotated["summary"]
    activations = [r for r in annotated["storages"] if not r["graph_input"]]
    inputs = len(annotated["storages"]) - len(activations)
    counts = {action.value: sum(r["decision"] == action.value for r in activations)
              for action in Action}
    lines = [
        ("predicted step", f"{s['predicted_step_ms']:.2f} ms with storm, "
                           f"{s['baseline_step_ms']:.2f} ms without "
                           f"({_change(s['baseline_step_ms'], s['predicted_step_ms'])})"),
        ("activation memory", f"{_size(s['baseline_activation_bytes'])} → "
                              f"{_size(s['activation_bytes'])} ("
                              f"{_change(s['baseline_activation_bytes'], s['activation_bytes'])})"),
        ("peak memory", f"{_size(s['baseline_peak_bytes'])} → {_size(s['peak_bytes'])} "
                        f"({_change(s['baseline_peak_bytes'], s['peak_bytes'])}); "
                        f"{_size(s['device_bytes'])} with the inputs"),
        ("offloaded", f"{_size(s['offloaded_bytes'])}, exposed transfer "
                      f"{s['exposed_transfer_ms']:.2f} ms"),
        ("recomputed", f"{_size(s['recomputed_bytes'])}, {s['recompute_ms']:.2f} ms in the "
                       f"backward"),
        ("saved storages", f"{counts['offload']} offloaded, {counts['recompute']} recomputed, "
                           f"{counts['keep']} kept; not listed: {inputs} of parameters and "
                           f"inputs"),
    ]
    if s["streamed_weight_bytes"] or s["resident_weight_bytes"]:
        held = f" (frozen weights in {s['host_format']})" if s["host_format"] else ""
        lines.append(("streamed weights", f"{_size(s['streamed_weight_bytes'])} fetched from "
                                          f"host memory{held}, "
                                          f"{_size(s['resident_weight_bytes'])} "
                                          f"kept on the device" + (
                                              f", the gradients of "
                                              f"{_size(s['summed_gradient_bytes'])} of them "
                                              f"summed there" if s["summed_gradient_bytes"]
                                              else "")))
    if s["tokens"] is not None:
        lines.append(("throughput", f"{s['predicted_tokens_per_s']:.0f} tokens/s predicted "
                                    f"({s['tokens']} tokens per micro-batch, forward and "
                                    f"backward)"))
    if s["budget_bytes"] is not None:
        lines.append(("activation target", f"{_size(s['budget_bytes'])} (minimum feasible "
                                           f"{_size(s['minimum_activation_bytes'])})"))
    head = tabulate(lines, headers=[title, f"profile {s['profile']}"], tablefmt="plain",
                    disable_numparse=True)
    table = tabulate([(r["storage"], _size(r["bytes"]), r["decision"], _short(r["reason"]))
                      for r in activations],
                     headers=["storage", "bytes", "decision", "reason"], disable_numparse=True)
    return f"{head}\n\n{table}"


STAGE_CONTEXT = 1
"""Unchanged lines shown around each change of a stage's diff."""


def format_stages(records: Sequence[PassRecord]) -> str:
    """What each pass did (``storm schedule --stages``), in the order they ran: its name,
    seconds and changes, then, for each graph whose code it recorded, the unified diff against
    that graph's code at the stage before (the whole code where the graph first appears:
    ``joint`` at ``capture``, ``forward`` and ``backward`` at ``split``)."""
    seen: dict[str, str] = {}
    parts = []
    for record in records:
        parts.append(f"== {record.name} ({record.seconds:.3f} s): {record.changed or 'no change'}")
        for graph, code in record.code:
            before = seen.get(graph)
            if before is None:
                parts.append(f"-- {graph} graph\n{code.strip()}")
            elif before != code:
                parts.extend(difflib.unified_diff(before.splitlines(), code.splitlines(),
                                                  f"{graph} before", f"{graph} after",
                                                  n=STAGE_CONTEXT, lineterm=""))
            seen[graph] = code
    return "\n".join(parts)


LANE_TIDS = {Lane.COMPUTE: 1, Lane.D2H: 2, Lane.H2D: 3}
HOST_THREAD_TID = 4
HOST_THREAD_TRACK = "host thread"


def chrome_trace(prediction: Prediction) -> dict[str, object]:
    """The predicted timeline as Chrome trace JSON, one track per lane and, when it has work,
    one for storm's host thread (ui.perfetto.dev)."""
    events: list[dict[str, object]] = [
        {"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": lane.value}}
        for lane, tid in LANE_TIDS.items()]
    if prediction.host:
        events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": HOST_THREAD_TID,
                       "args": {"name": HOST_THREAD_TRACK}})
    for h in prediction.host:
        events.append({"name": f"{h.work} {h.node}", "cat": h.graph, "ph": "X", "pid": 1,
                       "tid": HOST_THREAD_TID, "ts": h.start_s * US,
                       "dur": (h.end_s - h.start_s) * US, "args": {"bytes": h.nbytes}})
    for t in prediction.timings:
        if t.lane is Lane.COMPUTE and t.end_s > t.start_s:
            events.append({"name": t.node, "cat": t.graph, "ph": "X", "pid": 1, "tid": 1,
                           "ts": t.start_s * US, "dur": (t.end_s - t.start_s) * US})
    for c in prediction.copies:
        events.append({"name": c.node, "cat": c.graph, "ph": "X", "pid": 1,
                       "tid": LANE_TIDS[c.lane], "ts": c.start_s * US,
                       "dur": (c.end_s - c.start_s) * US, "args": {"bytes": c.nbytes}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


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


def _ms(value: float) -> str:
    return f"{value:.2f}"


PARETO_TEXT = (Column("budget_bytes", "budget", _size),
               Column("predicted_step_ms", "step ms", _ms),
               Column("step_ratio", "× no storm", lambda v: f"{v:.3f}"),
               Column("activation_bytes", "activations", _size),
               Column("peak_bytes", "peak", _size), Column("offloaded_bytes", "offloaded", _size),
               Column("recomputed_bytes", "recomputed", _size),
               Column("frontier", "frontier", lambda v: "yes" if v else ""))
"""The columns of ``storm pareto``'s table (sizes once, in binary units; the JSON keeps every
field's exact value)."""


def format_pareto(points: list[dict[str, object]]) -> str:
    return _text_table(points, PARETO_TEXT)


def _text_table(rows: list[dict[str, object]], columns: Sequence[Column]) -> str:
    """``rows`` as a table of ``columns``, two spaces apart, the headers over a rule."""
    cells = [[c.header for c in columns], *([c.show(r[c.field]) for c in columns] for r in rows)]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = ["  ".join(cell.ljust(width) if c.left else cell.rjust(width)
                       for cell, width, c in zip(line, widths, columns)).rstrip()
             for line in cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


THROUGHPUT_FIELDS = ("tokens", "micro_batches", "predicted_tokens_per_s", "optimizer_step_ms",
                     "first_micro_batch_ms", "micro_batch_ms", "host_wait_ms", "optimizer_ms",
                     "exposed_transfer_ms", "activation_bytes", "device_bytes",
                     "streamed_weight_bytes", "resident_weight_bytes",
                     "summed_gradient_bytes", "host_format")
"""What ``storm throughput`` shows per tokens per micro-batch and micro-batches per step."""


def throughput_row(summary: dict[str, object], step: StepPrediction) -> dict[str, object]:
    """One row of ``storm throughput``: a plan's ``summary`` and its optimizer step ``step``."""
    tokens = summary["tokens"] * step.micro_batches
    return {**{k: summary[k] for k in THROUGHPUT_FIELDS if k in summary},
            "micro_batches": step.micro_batches, "predicted_tokens_per_s": tokens / step.step_s,
            "optimizer_step_ms": step.step_s * MS,
            "first_micro_batch_ms": step.first_micro_batch_s * MS,
            "micro_batch_ms": step.micro_batch_s * MS,
            "last_micro_batch_ms": step.last_micro_batch_s * MS,
            "host_wait_ms": step.host_wait_s * MS, "optimizer_ms": step.optimizer_s * MS}


THROUGHPUT_TEXT = (Column("tokens", "tokens", str), Column("micro_batches", "µbatches", str),
                   Column("predicted_tokens_per_s", "tokens/s", lambda v: f"{v:.0f}"),
                   Column("optimizer_step_ms", "step ms", _ms),
                   Column("micro_batch_ms", "µbatch ms", _ms),
                   Column("host_wait_ms", "wait ms", _ms), Column("optimizer_ms", "optim ms", _ms),
                   Column("exposed_transfer_ms", "exposed ms", _ms),
                   Column("activation_bytes", "activations", _size),
                   Column("device_bytes", "device", _size),
                   Column("streamed_weight_bytes", "streamed", _size),
                   Column("resident_weight_bytes", "resident", _size))
"""The columns of ``storm throughput``'s table, in the order of :data:`THROUGHPUT_FIELDS`
(the host format, the same in every row, is a line above it)."""


def format_throughput(rows: list[dict[str, object]]) -> str:
    formats = {row.get("host_format") for row in rows} - {None}
    above = "".join(f"frozen streamed weights in {f}\n" for f in sorted(formats))
    return above + _text_table(rows, THROUGHPUT_TEXT)


SVG_SIZE = (640, 420)
SVG_MARGIN = 60


def pareto_svg(points: list[dict[str, object]], title: str) -> str:
    """The frontier as an SVG scatter: activation memory (GiB) against predicted step (ms)."""
    width, height = SVG_SIZE
    xs = [p["activation_bytes"] / GIB for p in points]
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
