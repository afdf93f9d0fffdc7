"""``storm``: command-line entry point.

``storm schedule MODEL`` traces MODEL's forward and backward with fake tensors (no real compute,
no GPU, any size), runs storm's passes with a device profile, and prints both rewritten graphs
in execution order: streams, events, predicted compute and transfer times and device memory,
with the predicted step against the same graphs without storm underneath. The tensors live on
the CPU while tracing, so activations are planned as they would be on the profile's GPU.

``storm pareto MODEL`` plans the same model under a sweep of memory budgets and prints the
predicted frontier: budget → step time, peak, bytes offloaded and recomputed.

``storm calibrate`` measures the present GPU into a profile JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence

from pathlib import Path

import torch
from torch import nn
from torch._dynamo.backends.debugging import boxed_nop
from torch._functorch.aot_autograd import aot_module_simplified
from torch._subclasses.fake_tensor import FakeTensorMode

from storm_compile.backend import StormPartitioner
from storm_compile.calibrate import cache_path, calibrate
from storm_compile.config import StormConfig, StormOptionError
from storm_compile.cost_model import CostModel, resolve_profile
from storm_compile.graphs import PassContext, StormGraphs
from storm_compile.models import BUILTIN_MODELS, GPTShape, ModelSpecError, build_gpt, load_factory
from storm_compile.passes import StormBudgetError
from storm_compile.schedule import (
    annotate,
    chrome_trace,
    format_pareto,
    format_table,
    pareto_points,
    pareto_svg,
)

EXIT_USAGE = 2
"""Exit status for bad input (argparse's convention)."""

_GPT_KNOBS = ("d_model", "layers", "heads", "seq", "batch", "hidden", "dtype")
DEFAULT_PROFILE = "h100"
"""The GPU the project's anchors were measured on."""


PARETO_FRACTIONS = (1.0, 0.9, 0.75, 0.5, 0.25, 0.1)
"""Budgets ``storm pareto`` sweeps, as fractions of the no-storm activation memory; the graph's
minimum feasible budget is added as the last point."""


def _model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help=f"one of {', '.join(BUILTIN_MODELS)}, "
                                      f"or path/to/file.py:factory returning (model, inputs)")
    defaults = GPTShape()
    for knob in _GPT_KNOBS:
        parser.add_argument(f"--{knob.replace('_', '-')}", default=None,
                            type=str if knob == "dtype" else int,
                            help=f"gpt only (default {getattr(defaults, knob)})")
    parser.add_argument("--profile", default=DEFAULT_PROFILE,
                        help=f"device profile: a built-in name or a JSON path "
                             f"(default {DEFAULT_PROFILE})")
    parser.add_argument("--min-offload-bytes", default=None,
                        help="storm option min_offload_bytes (bytes or e.g. 4MiB)")
    parser.add_argument("--no-recompute", dest="recompute", action="store_false", default=None,
                        help="storm option recompute=False: plan with offloads only")
    parser.add_argument("--format", choices=("table", "json"), default="table")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="storm", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    schedule = commands.add_parser(
        "schedule", help="print the annotated forward/backward schedule of a model")
    _model_arguments(schedule)
    schedule.add_argument("--offload", choices=("hidden", "all"), default=None,
                          help="storm option offload")
    schedule.add_argument("--memory-budget", default=None,
                          help="storm option memory_budget: a size with its unit (e.g. 12GiB), "
                               "a fraction such as 0.5 (a bare number is a fraction), or auto")
    schedule.add_argument("--max-overhead", type=float, default=None,
                          help="storm option max_overhead (for --memory-budget auto)")
    schedule.add_argument("--trace", type=Path, default=None,
                          help="write the predicted timeline as a Chrome/Perfetto trace JSON")
    pareto = commands.add_parser(
        "pareto", help="print the predicted step time and memory over a sweep of budgets")
    _model_arguments(pareto)
    pareto.add_argument("--budgets", default=None,
                        help=f"comma-separated budgets (fractions or sizes; default "
                             f"{','.join(map(str, PARETO_FRACTIONS))} and the minimum)")
    pareto.add_argument("--plot", type=Path, default=None,
                        help="write the frontier as an SVG picture")
    calibrate_cmd = commands.add_parser("calibrate", help="measure the present GPU into a profile")
    calibrate_cmd.add_argument("--out", type=Path, default=None,
                               help="profile JSON to write (default: the backend's cache)")
    return parser


class _TupleOutput(nn.Module):
    """AOTAutograd traces modules whose forward returns a tuple."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *inputs):
        out = self.model(*inputs)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _build(args: argparse.Namespace, fake_mode: FakeTensorMode):
    knobs = {k: getattr(args, k) for k in _GPT_KNOBS if getattr(args, k) is not None}
    if args.model == "gpt":
        if "dtype" in knobs and not isinstance(getattr(torch, knobs["dtype"], None), torch.dtype):
            raise ModelSpecError(f"--dtype {knobs['dtype']!r} is not a torch dtype")
        with fake_mode:
            return build_gpt(dataclasses.replace(GPTShape(), **knobs))
    if knobs:
        raise ModelSpecError(f"--{next(iter(knobs)).replace('_', '-')} applies to the built-in "
                             f"gpt model only")
    model, inputs = load_factory(args.model)
    return model, tuple(fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t
                        for t in inputs)


def _trace(args: argparse.Namespace, ctx: PassContext) -> StormGraphs:
    """Trace forward and backward with fake tensors and run storm's passes on them."""
    captured: list[StormGraphs] = []
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    model, inputs = _build(args, fake_mode)
    with fake_mode:
        aot_module_simplified(_TupleOutput(model), inputs, fw_compiler=boxed_nop,
                              bw_compiler=boxed_nop,
                              partition_fn=StormPartitioner(ctx, observer=captured.append))
    if not captured:
        raise ModelSpecError("no input or parameter of the model requires grad, so there is "
                             "no backward to schedule")
    return captured[0]


def _budget(text: str) -> float | str:
    """A budget as typed on the command line: a bare number is a fraction, anything else (a size
    with its unit, ``auto``) goes to the option parser as typed."""
    try:
        return float(text)
    except ValueError:
        return text


def _context(args: argparse.Namespace, **options) -> PassContext:
    options = {"inner": "eager", "transfer_cpu_tensors": True, **options}
    for name in ("offload", "min_offload_bytes", "recompute", "max_overhead"):
        if getattr(args, name, None) is not None:
            options[name] = getattr(args, name)
    config = StormConfig.from_options(**options)
    try:
        cost = CostModel(resolve_profile(args.profile))
    except ValueError as error:
        raise StormOptionError(str(error)) from error
    return PassContext(config, cost)


def _print(args: argparse.Namespace, document, as_table) -> None:
    print(json.dumps(document, indent=1) if args.format == "json" else as_table(document))


def _schedule(args: argparse.Namespace) -> int:
    budget = {} if args.memory_budget is None else {"memory_budget": _budget(args.memory_budget)}
    ctx = _context(args, **budget)
    graphs = _trace(args, ctx)
    annotated = annotate(graphs, ctx.cost)
    prediction = annotated.pop("prediction")
    if args.trace is not None:
        args.trace.write_text(json.dumps(chrome_trace(prediction)))
    _print(args, annotated, format_table)
    return 0


def _pareto(args: argparse.Namespace) -> int:
    budgets: list[float | str] = ([_budget(b) for b in args.budgets.split(",")] if args.budgets
                                  else [*PARETO_FRACTIONS, None])
    rows = []
    for budget in budgets:
        if budget is None:
            budget = rows[0]["minimum_activation_bytes"]
        ctx = _context(args, memory_budget=budget)
        summary = annotate(_trace(args, ctx), ctx.cost)["summary"]
        rows.append({"budget": budget, **summary})
    points = pareto_points(rows)
    if args.plot is not None:
        args.plot.write_text(pareto_svg(points, title=args.model))
    _print(args, points, format_pareto)
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        raise StormOptionError("calibrate needs a CUDA device; none is available")
    profile = calibrate()
    path = args.out or cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    profile.to_json(path)
    print(json.dumps(dataclasses.asdict(profile), indent=1))
    print(f"written to {path}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    commands = {"schedule": _schedule, "pareto": _pareto, "calibrate": _calibrate}
    try:
        return commands[args.command](args)
    except (ModelSpecError, StormOptionError, StormBudgetError) as error:
        print(f"storm: error: {error}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
