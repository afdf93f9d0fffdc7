"""Each model of the zoo on one GPU: storm against torch.compile, in the same run.

For every zoo model (``bench`` size, bf16 parameters, cuda) and every method (``compile``:
Inductor, the reference; ``storm``: storm's defaults; ``storm-budget-0.5``:
``memory_budget=0.5``; ``storm-measured-budget-0.5``: the same with ``cost="measured"``;
``storm-peak-F``: a byte budget of ``F`` times ``compile``'s step peak):
a fresh model from the same seed and ``torch._dynamo.reset()``, warm-up steps, then fw+bw steps
timed with CUDA events (median), activation memory (allocated at the end of the forward minus
before it: what the step holds for the backward), the step's peak above the same baseline
(after ``reset_peak_memory_stats``), the step peak a byte budget bounds (the peak less what the
process held besides the parameters and the batch before the step: cuBLAS's workspaces, what
earlier methods left) beside the one storm predicted (its simulator's device peak of the
graph that peaks highest), and the largest relative gradient error against ``compile``. With
``--peak-history``, the allocator records the listed methods' measured step and the results
list what is live at its peak (:mod:`benchmarks.peak_history`). A method
that fails records its error in its row and the run goes on.

    python -m benchmarks.zoo_memory --out DIR [--models llama,gpt2] [--steps 10]
    python -m benchmarks.zoo_memory --methods compile,storm-peak-0.75 --out DIR
    python -m benchmarks.zoo_memory --models unet --methods compile,storm-peak-0.75 \
        --peak-history storm-peak-0.75 --out DIR
    python -m benchmarks.zoo_memory --smoke --out DIR     # CPU, tiny sizes: the harness itself

Writes ``results.md`` (one tabulate table, model × method) and ``results.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import platform
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from tabulate import tabulate
from torch import nn

from benchmarks import model_zoo
from benchmarks.activation_memory import (CPU_STORM_OPTIONS, EXIT_NO_CUDA, _Device, _gib,
                                          _grad_error, _minus, _ratio)
from benchmarks.compile_time import error_line, write
from benchmarks.peak_history import recorded
from storm_compile import StormBackend, StormConfig
from storm_compile.config import PRESETS
from storm_compile.cost.simulate import device_bytes, simulate

REFERENCE = "compile"
PEAK_FRACTIONS = (0.9, 0.75, 0.65)
"""Byte budgets measured, as fractions of ``compile``'s step peak."""
PEAK_METHOD = "storm-peak-"
METHODS = (REFERENCE, "storm", "storm-budget-0.5", "storm-measured-budget-0.5",
           *(f"{PEAK_METHOD}{fraction}" for fraction in PEAK_FRACTIONS))
"""Inductor, the storm presets of :data:`storm_compile.config.PRESETS` measured here, and the
byte budgets of :data:`PEAK_FRACTIONS`."""
SMOKE_METHODS = METHODS[:3]
"""What ``--smoke`` measures by default: the CPU has no peak to take a byte budget from."""
MODEL_SEED = 0
"""Every method's model is built after this seed: the same weights for all."""
DATA_SEED = 1
"""Seed of the one batch every step of every method runs."""
STEP_SEED = 2
"""Set before each step, so random ops (dropout) draw the same numbers under every method."""


def budget_bytes(method: str, reference_peak: int | None) -> int | None:
    """The byte budget of a ``storm-peak-F`` method: ``F`` times ``reference_peak`` (None for
    the other methods)."""
    if not method.startswith(PEAK_METHOD):
        return None
    if reference_peak is None:
        raise ValueError(f"{method} needs {REFERENCE}'s peak: measure {REFERENCE} first")
    return int(float(method.removeprefix(PEAK_METHOD)) * reference_peak)


def wrap(method: str, model: nn.Module, storm_options: dict | None = None,
         budget: int | None = None, predicted: list[int] | None = None) -> Callable:
    """``model`` compiled by ``method``: Inductor, the storm preset of that name, or a byte
    ``budget``, with ``storm_options`` on top; storm's predicted device peak of each graph it
    plans goes in ``predicted``."""
    if method == REFERENCE:
        return torch.compile(model)
    options = {"memory_budget": f"{budget}B"} if budget is not None else PRESETS[method]

    def observe(graphs) -> None:
        predicted.append(device_bytes(graphs, simulate(graphs, backend.ctx.cost)))

    backend = StormBackend(StormConfig.from_options(**{**options, **(storm_options or {})}),
                           observer=None if predicted is None else observe)
    return torch.compile(model, backend=backend)


def _zero_grads(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameter gradients in float32 on the host (a parameter without one reads as zeros), so
    the reference kept across methods holds no device memory."""
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().float().cpu()
            for n, p in model.named_parameters() if p.requires_grad}


def run_method(name: str, method: str, dev: _Device, args, reference: dict | None,
               reference_peak: int | None = None) -> dict:
    """Measure one method on one zoo model; its gradients go in ``"grads"`` for the reference,
    its step peak in ``"step_peak"``."""
    torch._dynamo.reset()
    torch.manual_seed(MODEL_SEED)
    case = model_zoo.build(name, args.size, device=args.device, dtype=args.dtype)
    inputs = case.batch(DATA_SEED)
    budget = budget_bytes(method, reference_peak)
    predicted: list[int] = []
    run = wrap(method, case.model, None if dev.cuda else CPU_STORM_OPTIONS, budget, predicted)
    held: dict[str, int | None] = {}

    def step() -> None:
        _zero_grads(case.model)
        torch.manual_seed(STEP_SEED)
        held["before"] = dev.allocated()
        out = run(*inputs)
        held["activation"] = _minus(dev.allocated(), held["before"])
        case.loss(out).backward()

    for _ in range(args.warmup):
        step()
    _zero_grads(case.model)
    dev.sync()
    dev.reset_peak()
    owners: dict = {}
    with recorded(owners) if method in args.peak_history and dev.cuda else \
            contextlib.nullcontext():
        step()
    dev.sync()
    peak = _minus(dev.peak(), held["before"])
    graph_inputs = sum(p.nbytes for p in case.model.parameters()) + sum(
        t.nbytes for t in inputs if isinstance(t, torch.Tensor))
    times: list[float] = []
    for _ in range(args.steps):
        with dev.timer(times):
            step()
    row = {"model": name, "method": method, "step_ms": statistics.median(times),
           "activation_gib": _gib(held["activation"]), "peak_gib": _gib(peak),
           "step_peak": None if peak is None else peak + graph_inputs,
           "budget_gib": _gib(budget),
           "predicted_peak": max(predicted, default=None),
           "peak_owners": owners or None, "grads": _grads(case.model)}
    if reference is not None:
        row["grad_rel_error"] = _grad_error(row["grads"], reference)
    return row


def run_model(name: str, dev: _Device, args) -> list[dict]:
    rows, reference, reference_peak = [], None, None
    for method in args.methods:
        try:
            row = run_method(name, method, dev, args, reference, reference_peak)
            grads = row.pop("grads")
            if method == REFERENCE:
                reference, reference_peak = grads, row["step_peak"]
        except Exception as error:  # a failing method is reported in its row; the run goes on
            row = {"model": name, "method": method, "error": error_line(error)}
        finally:
            gc.collect()
            if dev.cuda:
                torch.cuda.empty_cache()
        rows.append(row)
        print(f"[{name}] {method}: {row.get('error') or '%.2f ms' % row['step_ms']}", flush=True)
    return rows


def _within(row: dict) -> str:
    if row["budget_gib"] is None or row["step_peak"] is None:
        return ""
    return "yes" if _gib(row["step_peak"]) <= row["budget_gib"] else "no"


def _peak_above_reference(row: dict, ref: dict) -> str:
    if row is ref or row.get("peak_gib") is None or ref.get("peak_gib") is None:
        return ""
    return "yes" if row["peak_gib"] > ref["peak_gib"] else "no"


def markdown(rows: list[dict]) -> str:
    references = {r["model"]: r for r in rows if r["method"] == REFERENCE and "step_ms" in r}
    table = []
    for r in rows:
        ref = references.get(r["model"], {})
        if "error" in r:
            table.append({"model": r["model"], "method": r["method"], "error": r["error"]})
            continue
        table.append({
            "model": r["model"], "method": r["method"], "step ms": r["step_ms"],
            "step × compile": _ratio(r["step_ms"], ref.get("step_ms")),
            "act GiB": r["activation_gib"], "peak GiB": r["peak_gib"],
            "peak > compile": _peak_above_reference(r, ref),
            "step peak GiB": _gib(r["step_peak"]),
            "predicted GiB": _gib(r.get("predicted_peak")),
            "budget GiB": r["budget_gib"], "within budget": _within(r),
            "grad err": r.get("grad_rel_error"),
        })
    owners = [_owners_section(r) for r in rows if r.get("peak_owners")]
    return "\n".join([tabulate(table, headers="keys", tablefmt="github", floatfmt=".3g",
                                missingval="") + "\n", *owners])


def _owners_section(row: dict) -> str:
    owners = row["peak_owners"]
    return "\n".join([
        f"### What is live at {row['model']} {row['method']}'s peak\n",
        f"{owners['peak_gib']:.3f} GiB allocated at the peak, {owners['before_gib']:.3f} GiB "
        f"before the step; reached by {owners['reached_by']}\n",
        tabulate(owners["owners"], headers="keys", tablefmt="github", floatfmt=".3f") + "\n"])


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(model_zoo.ZOO_NAMES),
                        help=f"comma-separated, from {', '.join(model_zoo.ZOO_NAMES)}")
    parser.add_argument("--methods", default=None,
                        help=f"comma-separated, from {', '.join(METHODS)} ({REFERENCE} first "
                             f"where a {PEAK_METHOD}F method is measured); default: all "
                             f"(with --smoke, {', '.join(SMOKE_METHODS)})")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per method")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--peak-history", default="",
                        help="comma-separated methods whose measured step the allocator "
                             "records, to list what is live at its peak (CUDA only)")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, tiny sizes, fp32, one warm-up and two timed steps")
    parser.add_argument("--out", type=Path, default=Path("bench-out/zoo"))
    args = parser.parse_args(argv)
    default = SMOKE_METHODS if args.smoke else METHODS
    args.models = args.models.split(",")
    args.methods = list(default) if args.methods is None else args.methods.split(",")
    args.peak_history = [m for m in args.peak_history.split(",") if m]
    unknown_methods = set(args.methods + args.peak_history) - set(METHODS)
    if unknown_methods:
        parser.error(f"unknown method(s) {sorted(unknown_methods)}; "
                     f"known: {', '.join(METHODS)}")
    unknown = [m for m in args.models if m not in model_zoo.ZOO_NAMES]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; known: {', '.join(model_zoo.ZOO_NAMES)}")
    if args.smoke:
        args.size, args.device, args.dtype, args.warmup, args.steps = \
            "tiny", "cpu", torch.float32, 1, 2
    else:
        args.size, args.device, args.dtype = "bench", "cuda", torch.bfloat16
    return args


def main(argv=None) -> int:
    args = _parse(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("zoo_memory: no CUDA device; the GPU benchmark needs one "
              "(--smoke runs the harness on the CPU)", file=sys.stderr)
        return EXIT_NO_CUDA
    dev = _Device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    environment = {"torch": torch.__version__, "python": platform.python_version(),
                   "device": torch.cuda.get_device_name() if dev.cuda else platform.processor(),
                   "size": args.size, "dtype": str(args.dtype), "warmup": args.warmup,
                   "steps": args.steps}
    rows = []
    for name in args.models:
        rows += run_model(name, dev, args)
        table = write(args.out, {"environment": environment, "rows": rows}, markdown(rows))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
