"""Every way users save activation memory today, side by side with storm, on one GPU in one run.

For each configuration and method: warm-up steps, then fw+bw steps timed with CUDA events
(median of steps synchronised one by one, and the mean of as many steps run back to back, where
the host prepares each step while the GPU runs the last: the GPU-bound step time), activation
memory (allocated at the end of the forward above weights and input, the
output included: what the step holds for the backward), peak memory of the step (same baseline,
after ``reset_peak_memory_stats``), pinned host memory in use, and the relative gradient error
against torch.compile. ``--profile`` adds, per profiled method, the compute stream's busy
fraction, D2H and H2D copy time and the fraction of copy time overlapping compute kernels
(under ``--nproc`` each rank writes its own trace; the row has rank 0's figures). ``--loss-steps N`` then trains
each method's model for N AdamW steps on its batch and reports the largest relative loss
difference against torch.compile's over those steps.

    python -m benchmarks.activation_memory --quick --out DIR      # smallest configuration
    python -m benchmarks.activation_memory --configs wide --methods compile,storm --profile storm
    python -m benchmarks.activation_memory --smoke --out DIR      # CPU: the harness itself
    python -m benchmarks.activation_memory --nproc 2 --quick --loss-steps 50   # under DDP and FSDP2

With ``--nproc N`` the run spawns N ranks on this machine (one GPU each, NCCL; gloo with
``--smoke``) and runs every method under each of ``--engines``: DDP (its default
DDPOptimizer split under torch.compile), DDP with ``optimize_ddp="python_reducer"`` and
compiled autograd (the model compiled whole) and FSDP2 (each block and the root
``fully_shard``ed, the whole model compiled). Each rank trains on its own batch; the table shows
rank 0's figures, the step time as the slowest rank's, and gradient errors on the full
gradients.

Writes ``results.md`` (tabulate, ratios against torch.compile of the same run), ``results.json``
(every raw number and the environment) and, with matplotlib, ``pareto_<config>.png``; both files
are rewritten after each method, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.utils.checkpoint
from tabulate import tabulate

from benchmarks.trace_analysis import profiled
from storm_compile.cli.models import GPT, GPTShape, build_gpt
from storm_compile.compiler.backend import StormBackend
from storm_compile.config import CPU_PLANNING, PRESETS, StormConfig
from storm_compile.cost.simulate import simulate
from storm_compile.fx.graphs import StormGraphs
from storm_compile.fx.plan import MemoryPlan
from storm_compile.fx.prediction import Prediction
from storm_compile.fx.vocabulary import GIB, MS
from storm_compile.runtime.streams import get_runtime

EXIT_NO_CUDA = 2
LINK_PROBE_BYTES = 256 << 20
"""Size of the copies that measure the link at start: large enough to be bandwidth-bound
(a 64 MiB copy already runs at full rate on the H100)."""
REFERENCE = "compile"
LOSS_LR = 1e-4
"""AdamW's learning rate in ``--loss-steps`` runs: the loss moves visibly within 50 steps
without leaving the range where bf16 rounding, not divergence, separates the methods."""

CONFIGS: dict[str, GPTShape] = {
    "d2048-T2048-L8-B4": GPTShape(d_model=2048, layers=8, heads=16, seq=2048, batch=4,
                                  dtype="bfloat16"),
    "d4096-T4096-L4-B2": GPTShape(d_model=4096, layers=4, heads=32, seq=4096, batch=2,
                                  dtype="bfloat16"),
    "d2048-T16384-L4-B1": GPTShape(d_model=2048, layers=4, heads=16, seq=16384, batch=1,
                                   dtype="bfloat16"),
    "wide": GPTShape(d_model=8192, layers=4, heads=64, seq=4096, batch=1, hidden=28672,
                     dtype="bfloat16"),
}
QUICK_CONFIG = "d2048-T2048-L8-B4"
SMOKE_CONFIG = GPTShape(d_model=64, layers=2, heads=4, seq=64, batch=2, dtype="float32")


def _no_pinned_memory() -> int:
    return 0


def _unchanged(model: GPT) -> None:
    return None


@dataclasses.dataclass(frozen=True)
class Method:
    """How one method runs a step: change the model in place before any engine wraps it,
    wrap the (engine's) model once, a context around each step, and how many pinned host
    bytes it holds for the backward."""

    name: str
    wrap: Callable[[torch.nn.Module], Callable[[torch.Tensor], torch.Tensor]]
    step_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    pinned_bytes: Callable[[], int] = _no_pinned_memory
    predict: Callable[[], dict] | None = None
    """For storm methods: the cost model's predictions for the graphs it compiled."""
    prepare: Callable[[GPT], None] = _unchanged


class _CountingSaveOnCpu(torch.autograd.graph.save_on_cpu):
    """``save_on_cpu(pin_memory=True)`` that counts the bytes it moves to the host."""

    packed_bytes = 0

    def __init__(self) -> None:
        super().__init__(pin_memory=torch.cuda.is_available())
        type(self).packed_bytes = 0
        pack = self.pack_hook

        def counting_pack(tensor: torch.Tensor):
            type(self).packed_bytes += tensor.numel() * tensor.element_size()
            return pack(tensor)

        self.pack_hook = counting_pack


def _checkpoint_blocks(model: GPT) -> None:
    """Each block's forward runs under non-reentrant checkpointing; the module hooks of an
    engine (DDP, FSDP2) still run around it."""
    for block in model.blocks:
        block.forward = functools.partial(torch.utils.checkpoint.checkpoint, block.forward,
                                          use_reentrant=False)


def _ddp(model: GPT) -> torch.nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model)


def _fsdp2(model: GPT) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)


def _python_reducer() -> contextlib.AbstractContextManager:
    """DDP compiled whole: its reduction traced by compiled autograd instead of DDPOptimizer's
    split into one graph per bucket."""
    return torch._dynamo.config.patch(optimize_ddp="python_reducer", compiled_autograd=True)


@dataclasses.dataclass(frozen=True)
class Engine:
    """How a data-parallel engine wraps the model, and a context around each step (compile
    included: dynamo reads its configuration when it traces)."""

    wrap: Callable[[GPT], torch.nn.Module]
    step_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


ENGINES: dict[str, Engine] = {"ddp": Engine(_ddp),
                              "ddp-python-reducer": Engine(_ddp, _python_reducer),
                              "fsdp2": Engine(_fsdp2)}


def _with_budget(budget: float) -> Callable[[], contextlib.AbstractContextManager]:
    return lambda: torch._functorch.config.patch(activation_memory_budget=budget)


def _storm_pool_bytes() -> int:
    return get_runtime().pool.in_use_bytes()


class _StormRun:
    """Compiles with a storm backend and simulates each plan as it is made, to set predictions
    beside figures (Inductor rewrites the graphs in place once they are compiled)."""

    def __init__(self, options: dict) -> None:
        self.options = options
        self.simulated: list[tuple[Prediction, MemoryPlan]] = []
        self.backend: StormBackend | None = None

    def wrap(self, model: GPT) -> Callable[[torch.Tensor], torch.Tensor]:
        self.simulated.clear()
        self.backend = StormBackend(StormConfig.from_options(**self.options),
                                    observer=self._observe)
        return torch.compile(model, backend=self.backend)

    def _observe(self, graphs: StormGraphs) -> None:
        self.simulated.append((simulate(graphs, self.backend.ctx.cost), graphs.plan))

    def predict(self) -> dict:
        """The step's predictions over every graph it compiled (DDP makes one per bucket):
        times and bytes summed, the peak where one graph's peak sits on the activations the
        graphs before it hold."""
        ours = [prediction for prediction, _ in self.simulated]
        plans = [plan for _, plan in self.simulated]
        baseline = [plan.baseline for plan in plans]
        targets = [plan.target_bytes for plan in plans if plan.target_bytes is not None]
        return {"profile": self.backend.ctx.cost.profile.name,
                "graphs": len(ours),
                "pred_step_ms": sum(p.step_s for p in ours) * MS,
                "pred_exposed_ms": sum(p.exposed_transfer_s for p in ours) * MS,
                "pred_activation_gib": sum(p.activation_bytes for p in ours) / GIB,
                "pred_peak_gib": _stacked_peak(ours) / GIB,
                "pred_baseline_step_ms": sum(p.step_s for p in baseline) * MS,
                "pred_baseline_activation_gib": sum(p.activation_bytes for p in baseline) / GIB,
                "pred_baseline_peak_gib": _stacked_peak(baseline) / GIB,
                "pred_offloaded_gib": sum(p.offloaded_bytes for p in ours) / GIB,
                "pred_recomputed_gib": sum(plan.recompute_bytes for plan in plans) / GIB,
                "budget_gib": sum(targets) / GIB if targets else None}


def _stacked_peak(predictions: list[Prediction]) -> int:
    """The step's peak when its graphs run one after another, each holding its activations
    for the backward: graph ``k``'s peak above the activations of graphs ``0..k-1``."""
    held, peak = 0, 0
    for prediction in predictions:
        peak = max(peak, held + prediction.peak_bytes)
        held += prediction.activation_bytes
    return peak


CPU_STORM_OPTIONS = {**CPU_PLANNING, "min_offload_bytes": 0}
"""The benchmarks' storm options on the CPU (smoke runs): the tiny model's activations are all
below the default ``min_offload_bytes``; planning every one of them keeps the budget presets
feasible."""


def _storm_method(name: str, options: dict, cpu: bool) -> Method:
    run = _StormRun({**options, **CPU_STORM_OPTIONS} if cpu else options)
    return Method(name, run.wrap, pinned_bytes=_storm_pool_bytes, predict=run.predict)


def methods(cpu: bool = False) -> dict[str, Method]:
    """The anchor methods, then one storm method per preset the backend offers."""
    table = [
        Method("eager", lambda m: m),
        Method("compile", lambda m: torch.compile(m)),
        Method("checkpoint", lambda m: m, prepare=_checkpoint_blocks),
        Method("compile-budget-0.5", lambda m: torch.compile(m), _with_budget(0.5)),
        Method("compile-budget-0.1", lambda m: torch.compile(m), _with_budget(0.1)),
        Method("save_on_cpu", lambda m: m, _CountingSaveOnCpu,
               lambda: _CountingSaveOnCpu.packed_bytes),
    ]
    table += [_storm_method(name, options, cpu) for name, options in PRESETS.items()]
    return {m.name: m for m in table}


def parse_config(text: str) -> GPTShape:
    """``d_model=1024,layers=4,heads=8,seq=2048,batch=2[,hidden=N][,dtype=bfloat16]``."""
    fields = {f.name: f for f in dataclasses.fields(GPTShape)}
    values = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in fields:
            raise ValueError(f"--config item {item!r}: expected key=value with key in "
                             f"{', '.join(fields)}")
        values[key] = value.strip() if key == "dtype" else int(value)
    return GPTShape(**{**dataclasses.asdict(GPTShape(dtype="bfloat16")), **values})


class _Device:
    """Memory and timing on CUDA; on the CPU (smoke mode) memory reads as None."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def allocated(self) -> int | None:
        return torch.cuda.memory_allocated() if self.cuda else None

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def peak(self) -> int | None:
        return torch.cuda.max_memory_allocated() if self.cuda else None

    def host_allocations(self) -> int | None:
        """Pinned blocks created so far (each one a cudaHostAlloc)."""
        return torch.cuda.host_memory_stats().get("num_host_alloc") if self.cuda else None

    @contextlib.contextmanager
    def timer(self, out: list[float]) -> Iterator[None]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            torch.cuda.synchronize()
            out.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            yield
            out.append((time.perf_counter() - begin) * MS)


def _minus(value: int | None, base: int | None) -> int | None:
    return None if value is None or base is None else value - base


def _gib(value: int | None) -> float | None:
    return None if value is None else value / GIB


def _full(grad: torch.Tensor) -> torch.Tensor:
    """A gradient as one tensor (FSDP2's are sharded DTensors)."""
    full = getattr(grad, "full_tensor", None)
    return (full() if full is not None else grad).detach()


def _slowest(ms: float) -> float:
    """The slowest rank's time, in a process group; ``ms`` itself outside one."""
    if not dist.is_initialized():
        return ms
    value = torch.tensor([ms], device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def run_method(method: Method, shape: GPTShape, dev: _Device, args, out_dir: Path,
               config_name: str, reference_grads: dict | None, engine: str | None = None
               ) -> dict:
    """Measure one method, under ``engine`` when given; with ``reference_grads`` None, keep
    its gradients as the reference."""
    torch._dynamo.reset()
    gc.collect()     # the last method's model, when cycles hold it (FSDP2's hooks), before `base`
    torch.manual_seed(0)
    model, (x,) = build_gpt(shape, "cuda" if dev.cuda else "cpu")
    if dist.is_initialized():
        with torch.no_grad():
            x.add_(dist.get_rank())          # each rank its own batch
    method.prepare(model)
    engine_context = contextlib.nullcontext if engine is None else ENGINES[engine].step_context
    run = method.wrap(model if engine is None else ENGINES[engine].wrap(model))
    dev.sync()
    base = dev.allocated()
    held: dict[str, int | None] = {}

    def step() -> None:
        for p in (*model.parameters(), x):
            p.grad = None
        with engine_context(), method.step_context():
            out = run(x)
            held["device"], held["pinned"] = dev.allocated(), method.pinned_bytes()
            out.float().pow(2).mean().backward()

    for _ in range(args.warmup):
        step()
    dev.sync()
    dev.reset_peak()
    step()
    dev.sync()
    peak = dev.peak()
    allocations_before = dev.host_allocations()
    times: list[float] = []
    for _ in range(args.steps):
        with dev.timer(times):
            step()
    allocations_after = dev.host_allocations()
    back_to_back: list[float] = []
    with dev.timer(back_to_back):
        for _ in range(args.steps):
            step()
    result = {
        "method": method.name, "step_ms": _slowest(statistics.median(times)),
        "back_to_back_step_ms": _slowest(back_to_back[0] / args.steps),
        "activation_gib": _gib(_minus(held["device"], base)),
        "peak_gib": _gib(_minus(peak, base)),
        "pinned_gib": _gib(held["pinned"]),
        "pinnings_per_step": _minus(allocations_after, allocations_before) / args.steps
        if dev.cuda else None,
    }
    grads = {n: _full(p.grad) for n, p in model.named_parameters()}
    if reference_grads is not None:
        result["grad_rel_error"] = _grad_error(grads, reference_grads)
    if method.name == REFERENCE:
        result["grads"] = grads
    if method.predict is not None:
        result.update(method.predict())
    if method.name in args.profile:
        rank = f"_rank{dist.get_rank()}" if dist.is_initialized() else ""
        result.update(profiled(step, dev.cuda,
                               out_dir / f"trace_{config_name}_{method.name}{rank}.json"))
    if args.loss_steps:
        with engine_context():
            result["losses"] = _train(model, run, x, method, args.loss_steps)
    return result


def _train(model: torch.nn.Module, run: Callable, x: torch.Tensor, method: Method,
           steps: int) -> list[float]:
    """This rank's loss at each of ``steps`` AdamW steps of ``run`` on its batch ``x``."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LOSS_LR)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        with method.step_context():
            loss = run(x).float().pow(2).mean()
            loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _loss_error(losses: list[float], reference: list[float]) -> float:
    """Largest relative difference of two loss trajectories, step by step."""
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference))


def _grad_error(grads: dict, reference: dict) -> float:
    """Largest relative error of any parameter gradient, in float32, one parameter at a time."""
    return max(((grads[n].float() - reference[n].float()).norm()
                / reference[n].float().norm().clamp_min(1e-30)).item() for n in reference)


def _link_bandwidth() -> dict:
    host = torch.empty(LINK_PROBE_BYTES, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(LINK_PROBE_BYTES, dtype=torch.uint8, device="cuda")
    figures = {}
    for name, dst, src in (("h2d_gbps", device, host), ("d2h_gbps", host, device)):
        dst.copy_(src, non_blocking=True)
        times: list[float] = []
        for _ in range(5):
            with _Device("cuda").timer(times):
                dst.copy_(src, non_blocking=True)
        figures[name] = LINK_PROBE_BYTES / (statistics.median(times) / MS) / 1e9
    return figures


def run_config(name: str, shape: GPTShape, chosen: list[Method], dev: _Device, args,
               out_dir: Path, engine: str | None = None) -> Iterator[dict]:
    """Each method's row, as it is measured."""
    reference_grads = reference_losses = None
    for method in chosen:
        try:
            row = run_method(method, shape, dev, args, out_dir, name, reference_grads, engine)
            if method.name == REFERENCE:
                reference_grads = row.pop("grads")
                reference_losses = row.get("losses")
            elif reference_losses is not None:
                row["loss_rel_error"] = _loss_error(row["losses"], reference_losses)
        except Exception as error:  # a failing method is reported in its row; the run goes on
            cause = getattr(error, "inner_exception", None) or error
            first_line = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
            row = {"method": method.name, "error": f"{type(cause).__name__}: {first_line}"}
        finally:
            if dev.cuda:
                torch.cuda.empty_cache()
        if not dist.is_initialized() or not dist.get_rank():
            print(f"[{name}] {row['method']}: {row.get('error') or '%.2f ms' % row['step_ms']}",
                  flush=True)
        yield row


def _ratio(value, reference):
    return None if value is None or not reference else value / reference


def markdown(results: dict) -> str:
    parts = []
    for name, rows in results["configs"].items():
        ref = next((r for r in rows if r["method"] == REFERENCE and "step_ms" in r), {})
        table = []
        for r in rows:
            if "error" in r:
                table.append({"method": r["method"], "error": r["error"]})
                continue
            table.append({
                "method": r["method"], "step ms": r["step_ms"],
                "step ×": _ratio(r["step_ms"], ref.get("step_ms")),
                "b2b ms": r["back_to_back_step_ms"],
                "act GiB": r["activation_gib"],
                "act ×": _ratio(r["activation_gib"], ref.get("activation_gib")),
                "peak GiB": r["peak_gib"], "peak ×": _ratio(r["peak_gib"], ref.get("peak_gib")),
                "pinned GiB": r["pinned_gib"], "pins/step": r["pinnings_per_step"],
                "grad err": r.get("grad_rel_error"),
                "loss err": r.get("loss_rel_error"),
                "busy": r.get("compute_busy_fraction"),
                "copy overlap": r.get("copy_overlap_fraction"),
            })
        parts.append(f"### {name}\n\n" + tabulate(table, headers="keys", tablefmt="github",
                                                    floatfmt=".3g", missingval="") + "\n")
        predicted = [{"method": r["method"], "profile": r["profile"], "graphs": r["graphs"],
                      "step ms (pred / meas / back-to-back)":
                          f"{r['pred_step_ms']:.1f} / {r['step_ms']:.1f} / "
                          f"{r['back_to_back_step_ms']:.1f}",
                      "act GiB (pred / meas)":
                          f"{r['pred_activation_gib']:.3f} / {r['activation_gib'] or 0:.3f}",
                      "peak GiB (pred / meas)":
                          f"{r['pred_peak_gib']:.3f} / {r['peak_gib'] or 0:.3f}",
                      "exposed ms (pred)": r["pred_exposed_ms"],
                      "offloaded GiB (pred)": r["pred_offloaded_gib"],
                      "recomputed GiB (pred)": r["pred_recomputed_gib"],
                      "budget GiB": r["budget_gib"],
                      "compile pred: step ms / act / peak GiB":
                          f"{r['pred_baseline_step_ms']:.1f} / "
                          f"{r['pred_baseline_activation_gib']:.3f} / "
                          f"{r['pred_baseline_peak_gib']:.3f}"}
                     for r in rows if "pred_step_ms" in r]
        if predicted:
            parts.append(tabulate(predicted, headers="keys", tablefmt="github", floatfmt=".3g")
                         + "\n")
    return "\n".join(parts)


def plot(results: dict, out_dir: Path) -> list[Path]:
    try:
        import matplotlib
    except ImportError:
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for name, rows in results["configs"].items():
        ref = next((r for r in rows if r["method"] == REFERENCE and "step_ms" in r), None)
        points = [r for r in rows if "step_ms" in r and r.get("activation_gib") is not None]
        if ref is None or not points:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in points:
            x, y = r["activation_gib"] / ref["activation_gib"], r["step_ms"] / ref["step_ms"]
            ax.scatter(x, y)
            ax.annotate(r["method"], (x, y), fontsize=7)
        ax.set_xlabel("activation memory / torch.compile")
        ax.set_ylabel("step time / torch.compile")
        ax.set_title(name)
        path = out_dir / f"pareto_{name}.png"
        fig.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=None,
                        help=f"comma-separated names from {', '.join(CONFIGS)} (default: all)")
    parser.add_argument("--config", action="append", default=[], type=parse_config,
                        help="an extra configuration, d_model=..,layers=..,heads=..,seq=..,"
                             "batch=..[,hidden=..][,dtype=..]")
    parser.add_argument("--methods", default=None, help="comma-separated (default: all)")
    parser.add_argument("--profile", default="", help="comma-separated methods to profile")
    parser.add_argument("--quick", action="store_true", help=f"only {QUICK_CONFIG}")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU smoke test of the harness: tiny model, two steps")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--loss-steps", type=int, default=0,
                        help="then train each method this many AdamW steps and compare its "
                             "losses with torch.compile's")
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument("--nproc", type=int, default=1,
                        help="ranks on this machine, one GPU each (gloo on the CPU with "
                             "--smoke); every method runs under each of --engines")
    parser.add_argument("--engines", default=",".join(ENGINES),
                        help=f"with --nproc: comma-separated, of {', '.join(ENGINES)}")
    args = parser.parse_args(argv)
    args.profile = [m for m in args.profile.split(",") if m]
    args.engines = [e for e in args.engines.split(",") if e]
    unknown = [e for e in args.engines if e not in ENGINES]
    if unknown:
        parser.error(f"unknown engine(s) {unknown}; known: {', '.join(ENGINES)}")
    if args.nproc < 1:
        parser.error(f"--nproc must be at least 1, got {args.nproc}")
    return args


def _select(args, cpu: bool) -> tuple[dict[str, GPTShape], list[Method]]:
    available = methods(cpu=cpu)
    names = args.methods.split(",") if args.methods else list(available)
    unknown = [n for n in names + args.profile if n not in available]
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; known: {', '.join(available)}")
    names = [REFERENCE] + [n for n in names if n != REFERENCE]
    if args.smoke:
        return {"smoke": SMOKE_CONFIG}, [available[n] for n in names]
    config_names = [QUICK_CONFIG] if args.quick else (
        args.configs.split(",") if args.configs else ([] if args.config else list(CONFIGS)))
    unknown = [n for n in config_names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configuration(s) {unknown}; known: {', '.join(CONFIGS)}")
    configs = {n: CONFIGS[n] for n in config_names}
    for shape in args.config:
        configs[f"d{shape.d_model}-T{shape.seq}-L{shape.layers}-B{shape.batch}"] = shape
    return configs, [available[n] for n in names]


def main(argv=None) -> int:
    args = _parse(argv)
    if args.smoke:
        args.warmup, args.steps = 1, 2
        dev = _Device("cpu")
    elif not torch.cuda.is_available():
        print("activation_memory: no CUDA device; the GPU benchmark needs one "
              "(--smoke runs the harness on the CPU)", file=sys.stderr)
        return EXIT_NO_CUDA
    elif args.nproc > torch.cuda.device_count():
        print(f"activation_memory: --nproc {args.nproc} needs as many GPUs; this machine has "
              f"{torch.cuda.device_count()}", file=sys.stderr)
        return EXIT_NO_CUDA
    else:
        dev = _Device("cuda")
    if args.nproc > 1:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        mp.spawn(_rank, args=(args, port), nprocs=args.nproc)
        return 0
    _run(args, dev, engines=[None])
    return 0


def _rank(rank: int, args, port: int) -> None:
    """One rank of a ``--nproc`` run: the whole run under each engine; rank 0 writes."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      LOCAL_WORLD_SIZE=str(args.nproc))
    cuda = not args.smoke
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=args.nproc)
    try:
        _run(args, _Device("cuda" if cuda else "cpu"), engines=args.engines)
    finally:
        dist.destroy_process_group()


def _run(args, dev: _Device, engines: list[str | None]) -> None:
    configs, chosen = _select(args, cpu=not dev.cuda)
    writes = not dist.is_initialized() or dist.get_rank() == 0
    if writes:
        args.out.mkdir(parents=True, exist_ok=True)
    environment = {"torch": torch.__version__, "python": platform.python_version(),
                   "device": torch.cuda.get_device_name() if dev.cuda else platform.processor(),
                   "ranks": args.nproc}
    if dev.cuda:
        environment["link"] = _link_bandwidth()
    results = {"environment": environment, "configs": {}, "shapes": {}}
    for name, shape in configs.items():
        for engine in engines:
            key = name if engine is None else f"{name}-{engine}"
            results["shapes"][key] = dataclasses.asdict(shape)
            rows = results["configs"][key] = []
            for row in run_config(name, shape, chosen, dev, args, args.out, engine):
                rows.append(row)
                if writes:
                    _write(results, args.out)
    if writes:
        plot(results, args.out)
        print(markdown(results))


def _write(results: dict, out_dir: Path) -> None:
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    (out_dir / "results.md").write_text(markdown(results))


if __name__ == "__main__":
    sys.exit(main())
