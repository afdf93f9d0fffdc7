"""The ``storm`` command line's parser, and the defaults and choices its help names.

It imports no torch, so ``storm --help``, ``storm --version`` and usage errors print at once;
:func:`storm_compile.cli.main` imports the commands (:mod:`storm_compile.cli.commands`) only once
the command line has parsed.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from storm_compile import __version__
from storm_compile.cli.shapes import BUILTIN_MODELS, FLOAT_DTYPES, LLAMA_PRESETS, GPTShape
from storm_compile.cost.profiles import DEFAULT_PROFILE, GPU_PLANNING_PROFILE

EXIT_USAGE = 2
"""Exit status for bad input (argparse's convention)."""

GPT_KNOBS = ("d_model", "layers", "heads", "seq", "batch", "hidden", "dtype")
"""What sizes the built-in gpt on the command line: the fields of its shape."""
LLAMA_KNOBS = ("preset", "layers", "seq", "batch", "dtype")
"""What sizes the built-in llama on the command line: a named shape, and overrides of it."""
HOST_FORMATS = ("int8", "nf4")
"""``--host-format``'s choices: :data:`storm_compile.weights.quantize.FORMATS`, named here so that
the
parser imports no torch."""

DEFAULT_LLAMA_PRESET = "1b"
"""The llama's shape where ``--preset`` is not given."""

PARETO_FRACTIONS = (1.0, 0.9, 0.75, 0.5, 0.25, 0.1)
"""Budgets ``storm pareto`` sweeps, as fractions of the no-storm activation memory; the graph's
minimum feasible budget is added as the last point."""

OUTPUT_RULE = ("if the model's output has a 'loss' entry (a dict key or an attribute) that is a "
               "tensor, only the loss is differentiated; otherwise every floating-point tensor "
               "in the output (a tensor, or dicts, dataclasses, namedtuples, tuples and lists of "
               "them) is")

ANY_MODEL_HELP = (f"one of {', '.join(BUILTIN_MODELS)}, or path/to/file.py:factory returning "
                  f"(model, inputs); {OUTPUT_RULE}")
"""What ``storm schedule`` and ``storm pareto`` plan."""
BUILTIN_MODEL_HELP = (f"one of {', '.join(BUILTIN_MODELS)} (a built-in model: --tokens sets its "
                      f"batch)")
"""What ``storm throughput`` plans: only a built-in model, as a factory's example inputs fix
their batch."""


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line like storm's own."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"storm: error: {message} (see {self.prog} --help)\n")


def _model_arguments(parser: argparse.ArgumentParser, model_help: str) -> None:
    parser.add_argument("model", help=model_help)
    defaults = GPTShape()
    for knob in GPT_KNOBS:
        allowed = f"; one of {', '.join(FLOAT_DTYPES)}" if knob == "dtype" else ""
        models = "gpt and llama" if knob in LLAMA_KNOBS else "gpt only"
        parser.add_argument(f"--{knob.replace('_', '-')}", default=None,
                            type=str if knob == "dtype" else int,
                            help=f"{models} (gpt's default {getattr(defaults, knob)}{allowed}; "
                                 f"llama's from its preset)" if knob in LLAMA_KNOBS else
                            f"{models} (default {getattr(defaults, knob)}{allowed})")
    parser.add_argument("--preset", default=None, choices=tuple(LLAMA_PRESETS),
                        help=f"llama only: a named shape (default {DEFAULT_LLAMA_PRESET})")
    parser.add_argument("--profile", default=None,
                        help=f"storm option profile: a built-in name, a JSON path, or auto "
                             f"(default {DEFAULT_PROFILE}: the present GPU's calibration, as "
                             f"the backend uses; without CUDA, {GPU_PLANNING_PROFILE})")
    parser.add_argument("--min-offload-bytes", default=None,
                        help="storm option min_offload_bytes (bytes or e.g. 4MiB)")
    parser.add_argument("--host-memory-limit", default=None,
                        help="storm option host_memory_limit: pinned host memory the offloads "
                             "may hold (bytes or e.g. 64GiB; default half of this machine's "
                             "RAM)")
    parser.add_argument("--no-recompute", dest="recompute", action="store_false", default=None,
                        help="storm option recompute=False: plan with offloads only")
    parser.add_argument("--format", choices=("table", "json"), default="table")


def _weight_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lora", type=int, default=None, metavar="RANK",
                        help="freeze the model and put LoRA adapters of this rank beside every "
                             "linear layer (storm_compile.cli.models.add_lora)")
    parser.add_argument("--host-format", default=None, choices=HOST_FORMATS,
                        help="with --stream and --lora: hold the frozen streamed weights in "
                             "this format in host memory (storm_compile.weights.quantize)")


def build_parser() -> argparse.ArgumentParser:
    """The parser of every ``storm`` command; ``--version`` prints ``storm-compile`` and the
    package's version."""
    parser = _Parser(prog="storm", description="plan a model with storm and print the predicted "
                                               "step and memory, or calibrate the present GPU")
    parser.add_argument("--version", action="version", version=f"storm-compile {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    schedule = commands.add_parser(
        "schedule", help="print the predicted step and memory, and each saved activation's fate")
    _model_arguments(schedule, ANY_MODEL_HELP)
    schedule.add_argument("--offload", choices=("hidden", "all"), default=None,
                          help="storm option offload")
    schedule.add_argument("--offload-format", choices=("fp8",), default=None,
                          help="storm option offload_format: offloaded activations held in fp8 "
                               "with a scale (lossy)")
    schedule.add_argument("--memory-budget", default=None,
                          help="storm option memory_budget, read as in Python: a number without "
                               "a unit is a fraction in (0, 1] (0.5, 1), a size carries its unit "
                               "(12GiB, 512MB), or auto")
    schedule.add_argument("--max-overhead", type=float, default=None,
                          help="storm option max_overhead (for --memory-budget auto)")
    schedule.add_argument("--nodes", action="store_true",
                          help="table format: print every node of both rewritten graphs and "
                               "every summary figure instead")
    schedule.add_argument("--trace", type=Path, default=None,
                          help="write the predicted timeline as a Chrome/Perfetto trace JSON")
    schedule.add_argument("--stream", action="store_true",
                          help="keep the model's parameters of 1 MiB or more in host memory and "
                               "stream them to the device (storm_compile.weights.streaming)")
    _weight_arguments(schedule)
    schedule.add_argument("--timings", action="store_true",
                          help="also print each pass run: its seconds and what it changed "
                               "(json format: under \"passes\")")
    schedule.add_argument("--stages", action="store_true",
                          help="also print what each pass did to the graphs' code, from the "
                               "joint graph as captured to the rewritten pair: a diff per pass "
                               "(json format: each pass's code under \"stages\")")
    pareto = commands.add_parser(
        "pareto", help="print the predicted step time and memory over a sweep of budgets")
    _model_arguments(pareto, ANY_MODEL_HELP)
    pareto.add_argument("--budgets", default=None,
                        help=f"comma-separated budgets, each read as --memory-budget (default "
                             f"{','.join(map(str, PARETO_FRACTIONS))} and the minimum); "
                             f"budgets below the minimum are skipped with a note")
    pareto.add_argument("--plot", type=Path, default=None,
                        help="write the frontier as an SVG picture")
    throughput = commands.add_parser(
        "throughput", help="print the predicted tokens/s of a built-in model against tokens per "
                           "micro-batch")
    _model_arguments(throughput, BUILTIN_MODEL_HELP)
    throughput.add_argument("--tokens", required=True,
                            help="comma-separated tokens per micro-batch, multiples of --seq "
                                 "(the batch is tokens / seq)")
    throughput.add_argument("--memory-budget", default=None,
                            help="storm option memory_budget, as for schedule")
    throughput.add_argument("--stream", action="store_true",
                            help="stream the parameters of 1 MiB or more from host memory, as "
                                 "for schedule")
    _weight_arguments(throughput)
    throughput.add_argument("--micro-batches", default="1",
                            help="comma-separated micro-batches per optimizer step (default 1)")
    throughput.add_argument("--overlap-optimizer", action="store_true",
                            help="step the streamed weights on the host thread during the last "
                                 "backward (OverlappedOptimizer) instead of after it")
    throughput.add_argument("--accumulate", action="store_true",
                            help="run the micro-batches in gradient_accumulation(): a backward "
                                 "does not wait for its gradients' host additions, the "
                                 "next micro-batch's does")
    calibrate_cmd = commands.add_parser("calibrate", help="measure the present GPU into a profile")
    calibrate_cmd.add_argument("--out", type=Path, default=None,
                               help="profile JSON to write (default: the backend's cache)")
    return parser
