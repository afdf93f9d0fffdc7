"""Where the cost model's roofline misses, by op class.

Each zoo model (``benchmarks.model_zoo``) runs one forward and backward under storm at its
defaults, compiled by Inductor, and storm's observer keeps its graphs as it planned them (after
Inductor's decompositions). Every node of those graphs that computes and that Inductor does not fuse
(matrix products, convolutions, attention, normalisations it keeps whole, and the other kernels
it calls as they are: an embedding's backward, scatters, sorts) is priced twice: by the roofline
on the device's profile (what storm plans with at its default ``cost="roofline"``) and timed alone
on the device with random inputs of its shapes
(:class:`~storm_compile.cost.cost_model.MeasuredCosts`, what ``cost="measured"`` plans with).
Pointwise ops and the reductions Inductor fuses are left out: timed alone they would run unfused.

Per model and op class (:data:`CLASSES`, the rest ``other``): the nodes, how many could be timed,
the predicted and measured milliseconds summed over the timed nodes, their ratio, the median of
each node's |predicted / measured − 1|, and the node furthest off; then each class over every
model.

    python -m benchmarks.op_costs --out DIR                   # cuda, bf16, the zoo's bench sizes
    python -m benchmarks.op_costs --smoke --out DIR           # CPU, tiny sizes, fp32: the harness

``--smoke`` runs the graphs as captured (``inner="eager"``: no code generation, and so none of
Inductor's decompositions: normalisations stay whole there) and times on the CPU.

Writes ``results.md`` (tabulate) and ``results.json`` after every model.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import platform
import statistics
from pathlib import Path

import torch
from tabulate import tabulate

from benchmarks import model_zoo
from benchmarks.compile_time import write
from benchmarks.step_overhead import run_benchmark
from storm_compile import StormBackend, StormConfig
from storm_compile.cost.calibrate import profile_for
from storm_compile.cost.cost_model import (
    ATTENTION_OPS,
    FLOP_ALIASES,
    CostModel,
    MeasuredCosts,
    is_fusible,
)
from storm_compile.fx.torch_private import OpOverload
from storm_compile.fx.vocabulary import MS, is_compute, is_transfer

aten = torch.ops.aten

CLASSES = {
    "matmul": frozenset({aten.mm, aten.addmm, aten.bmm, aten.baddbmm}),
    "convolution": frozenset({aten.convolution, aten.convolution_backward}),
    "attention": frozenset(ATTENTION_OPS | set(FLOP_ALIASES)),
    "normalisation": frozenset({
        aten.native_group_norm, aten.native_group_norm_backward, aten.native_batch_norm,
        aten.native_batch_norm_backward, aten._native_batch_norm_legit_functional,
        aten.native_layer_norm, aten.native_layer_norm_backward}),
}
"""Op classes by overload packet; a priced node of none of them is ``other``."""
MODELS = ("llama", "vit", "unet", "resnet")
"""Default ``--models``: attention with grouped heads, patch convolutions, a conv U-Net with
GroupNorm, BatchNorm convolutions."""
SMOKE_MODELS = ("unet",)


@dataclasses.dataclass
class Priced:
    """One node: its op, class, and the roofline's and the device's seconds (None: could not
    be timed)."""

    op: str
    op_class: str
    predicted_s: float
    measured_s: float | None


def op_class(node: torch.fx.Node) -> str:
    packet = getattr(node.target, "overloadpacket", None)
    return next((name for name, packets in CLASSES.items() if packet in packets), "other")


def priced(node: torch.fx.Node) -> bool:
    """Whether ``node`` is one this benchmark prices: it computes, is an aten op Inductor
    does not fuse, and is not one of storm's transfers."""
    return (is_compute(node) and isinstance(node.target, OpOverload) and not is_fusible(node)
            and not is_transfer(node))


def price_graphs(graphs: list, roofline: CostModel, measured: MeasuredCosts) -> list[Priced]:
    """Every priced node of the forward and backward of each of ``graphs``."""
    return [Priced(str(node.target), op_class(node), roofline.compute_seconds(node),
                   measured(node))
            for pair in graphs for graph in (pair.forward, pair.backward)
            for node in graph.graph.nodes if priced(node)]


def summarise(nodes: list[Priced]) -> list[dict]:
    """One row per op class of ``nodes``, in :data:`CLASSES` order, ``other`` last."""
    by_class: dict[str, list[Priced]] = collections.defaultdict(list)
    for node in nodes:
        by_class[node.op_class].append(node)
    rows = []
    for name in (*CLASSES, "other"):
        members = by_class.get(name, [])
        timed = [n for n in members if n.measured_s]
        if not members:
            continue
        predicted = sum(n.predicted_s for n in timed)
        measured = sum(n.measured_s for n in timed)
        errors = [abs(n.predicted_s / n.measured_s - 1) for n in timed]
        worst = max(timed, key=lambda n: abs(n.predicted_s / n.measured_s - 1), default=None)
        rows.append({
            "class": name, "nodes": len(members), "timed": len(timed),
            "predicted_ms": predicted * MS, "measured_ms": measured * MS,
            "predicted_over_measured": predicted / measured if measured else None,
            "median_node_error": statistics.median(errors) if errors else None,
            "worst": None if worst is None else
            f"{worst.op}: {worst.predicted_s * MS:.3g} / {worst.measured_s * MS:.3g} ms"})
    return rows


def measure_model(name: str, smoke: bool) -> list[Priced]:
    """Zoo model ``name``'s priced nodes, its graphs priced as storm plans them in one step."""
    cuda = not smoke
    torch.manual_seed(0)
    case = model_zoo.build(name, "tiny" if smoke else "bench", "cuda" if cuda else "cpu",
                           torch.float32 if smoke else torch.bfloat16)
    config = StormConfig.from_options(**({"inner": "eager"} if smoke else {}))
    roofline, measured = CostModel(profile_for(config.profile)), MeasuredCosts(case.device)
    nodes: list[Priced] = []
    # Priced as storm hands them on: Inductor then rewrites the graphs, dropping nodes' meta.
    backend = StormBackend(config, observer=lambda graphs: nodes.extend(
        price_graphs([graphs], roofline, measured)))
    run = torch.compile(case.model, backend=backend)
    case.loss(run(*case.inputs)).backward()
    return nodes


def markdown(results: dict) -> str:
    headers = ["model", "class", "nodes", "timed", "predicted ms", "measured ms",
               "predicted / measured", "median node error", "node furthest off"]
    lines = [[model, r["class"], r["nodes"], r["timed"], r["predicted_ms"], r["measured_ms"],
              r["predicted_over_measured"], r["median_node_error"], r["worst"]]
             for model, rows in results["models"].items() for r in rows]
    return tabulate(lines, headers, tablefmt="github", floatfmt=".3g")


def _run(args: argparse.Namespace) -> None:
    environment = {"torch": torch.__version__, "python": platform.python_version(),
                   "device": torch.cuda.get_device_name() if not args.smoke else "cpu"}
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {"environment": environment, "models": {}}
    every: list[Priced] = []
    for name in args.models:
        nodes = measure_model(name, args.smoke)
        every += nodes
        results["models"][name] = summarise(nodes)
        results["models"]["all"] = summarise(every)
        print(write(args.out, results, markdown(results)))


def _parse(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.op_costs",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=None,
                        help=f"comma-separated zoo models (default: {','.join(MODELS)})")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, tiny sizes, fp32: check the harness")
    parser.add_argument("--out", type=Path, default=Path("bench-out/op_costs"))
    args = parser.parse_args(argv)
    chosen = args.models.split(",") if args.models else \
        list(SMOKE_MODELS if args.smoke else MODELS)
    unknown = [m for m in chosen if m not in model_zoo.ZOO_NAMES]
    if unknown:
        parser.error(f"unknown zoo models: {', '.join(unknown)}")
    args.models = chosen
    return args


def main(argv=None) -> int:
    return run_benchmark("op_costs", _parse(argv), _run)


if __name__ == "__main__":
    raise SystemExit(main())
