"""``storm``: command-line entry point.

``storm schedule MODEL`` compiles MODEL with storm, runs one forward and backward, and prints
both rewritten graphs in execution order with the inserted transfer nodes, their streams and
events. Without CUDA the model runs on the CPU and activations are planned as on a GPU (the
transfers are plain copies there), so the schedule can be read on any machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence

import torch
from torch.utils._pytree import tree_leaves

from storm_compile.backend import StormBackend
from storm_compile.config import StormConfig, StormOptionError
from storm_compile.graphs import StormGraphs
from storm_compile.models import BUILTIN_MODELS, GPTShape, ModelSpecError, build_gpt, load_factory
from storm_compile.schedule import format_table, schedule_rows, summary

EXIT_USAGE = 2
"""Exit status for bad input (argparse's convention)."""

_GPT_KNOBS = ("d_model", "layers", "heads", "seq", "batch", "hidden", "dtype")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="storm", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    schedule = commands.add_parser(
        "schedule", help="print the annotated forward/backward schedule of a model")
    schedule.add_argument("model", help=f"one of {', '.join(BUILTIN_MODELS)}, "
                                        f"or path/to/file.py:factory returning (model, inputs)")
    defaults = GPTShape()
    for knob in _GPT_KNOBS:
        schedule.add_argument(f"--{knob.replace('_', '-')}", default=None,
                              type=str if knob == "dtype" else int,
                              help=f"gpt only (default {getattr(defaults, knob)})")
    schedule.add_argument("--device", default=None,
                          help="device to run on (default: cuda if available, else cpu)")
    schedule.add_argument("--min-offload-bytes", type=int, default=None,
                          help="smallest activation worth offloading (storm option)")
    schedule.add_argument("--format", choices=("table", "json"), default="table")
    return parser


def _build(args: argparse.Namespace, device: str):
    knobs = {k: getattr(args, k) for k in _GPT_KNOBS if getattr(args, k) is not None}
    if args.model == "gpt":
        if "dtype" in knobs and not isinstance(getattr(torch, knobs["dtype"], None), torch.dtype):
            raise ModelSpecError(f"--dtype {knobs['dtype']!r} is not a torch dtype")
        return build_gpt(dataclasses.replace(GPTShape(), **knobs), device)
    if knobs:
        raise ModelSpecError(f"--{next(iter(knobs)).replace('_', '-')} applies to the built-in "
                             f"gpt model only")
    model, inputs = load_factory(args.model)
    return model.to(device), tuple(t.to(device) if isinstance(t, torch.Tensor) else t
                                   for t in inputs)


def _capture(model, inputs, config: StormConfig) -> StormGraphs:
    captured: list[StormGraphs] = []
    compiled = torch.compile(model, backend=StormBackend(config, observer=captured.append))
    outputs = compiled(*inputs)
    loss = sum(t.float().sum() for t in tree_leaves(outputs)
               if isinstance(t, torch.Tensor) and t.requires_grad)
    if not captured or not isinstance(loss, torch.Tensor):
        raise ModelSpecError("the model produced no output that requires grad, so there is no "
                             "backward to schedule")
    loss.backward()
    if len(captured) > 1:
        print(f"storm: the model compiled into {len(captured)} graphs (graph breaks); "
              f"showing the first", file=sys.stderr)
    return captured[0]


def _schedule(args: argparse.Namespace) -> int:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    options = {"inner": "eager", "transfer_cpu_tensors": device == "cpu"}
    if args.min_offload_bytes is not None:
        options["min_offload_bytes"] = args.min_offload_bytes
    config = StormConfig.from_options(**options)
    model, inputs = _build(args, device)
    graphs = _capture(model, inputs, config)
    if args.format == "json":
        print(json.dumps({"nodes": [dataclasses.asdict(r) for r in schedule_rows(graphs)],
                          "summary": summary(graphs)}, indent=1))
    else:
        if device == "cpu":
            print("# on cpu: activations planned as on a GPU; transfers run as plain copies\n")
        print(format_table(graphs))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _schedule(args)
    except (ModelSpecError, StormOptionError) as error:
        print(f"storm: error: {error}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
