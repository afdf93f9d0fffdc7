"""Cold and warm compile time of storm against Inductor, each in a fresh process.

For each model of ``--models`` and each backend (``inductor``: plain ``torch.compile``; ``storm``:
storm's defaults, or, for a streamed model, its byte budget), a child process times its first fw+bw
step (wall clock: Dynamo, AOTAutograd, storm's passes, Inductor) with empty cache directories
(``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR`` in a new temporary directory) = cold, then a
second fresh child with the same directories = warm. Each child prints one JSON line: the first-step
seconds, the median of the steps after it, and Inductor's FX graph cache and AOTAutograd cache
counters (the table also divides the warm first step less the steady step, its compile alone, by
Inductor's), the reasons the caches logged for a bypass, the seconds of each compile phase torch
timed (per call) and the number of kernels Inductor generated; ``results.json`` keeps them. The
parent counts the child's stderr lines that show a traceback or a failed pickle (a cache entry that
could not be written) and its warning lines, and keeps each stderr in the output directory.

Models: ``gpt-L<n>``: the built-in gpt with n blocks (``gpt-L<n>-streamed``: its parameters
streamed, storm at :data:`STREAMED_GPT_BUDGET`); ``llama-<preset>``: a Llama preset
(:data:`~storm_compile.cli.models.LLAMA_PRESETS`) at :data:`LLAMA_TOKENS` tokens, its loss
differentiated; ``llama-<preset>-streamed``: the same with its parameters streamed from host
memory (:func:`~storm_compile.weights.streaming.stream_parameters`), storm under the preset's byte
budget (:data:`STREAMED_BUDGETS`). Inductor cannot stream: its row of a streamed model is the
same model resident on the GPU, the compile storm's stands beside (measured once where the run
also lists the unstreamed model). ``--profile`` runs one more warm child per row and writes
where its first step spent its host time.

    python -m benchmarks.compile_time --out DIR                         # cuda: gpt-L8, gpt-L32
    python -m benchmarks.compile_time --models llama-3b-streamed,llama-8b-streamed --out DIR
    python -m benchmarks.compile_time --device cpu --models gpt-L2 --out DIR  # small, fp32

cuda: gpt d2048/T2048/B4, bf16. cpu: gpt d256/T256/B2 and the tiny Llama, fp32, storm with
``transfer_cpu_tensors`` and ``min_offload_bytes=0`` (so its passes insert transfers at this
size; the C++ Inductor backend compiles). Writes ``results.md`` (tabulate) and
``results.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import json
import logging
import os
import platform
import pstats
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from tabulate import tabulate
from torch._dynamo.utils import compilation_time_metrics, counters
from torch._inductor import metrics as inductor_metrics

from benchmarks.activation_memory import CPU_STORM_OPTIONS, EXIT_NO_CUDA, _Device, _ratio
from storm_compile import storm
from storm_compile.cli.models import LLAMA_PRESETS, GPTShape, build_gpt, build_llama
from storm_compile.weights.streaming import stream_parameters

BACKENDS = ("inductor", "storm")
CUDA_SHAPE = GPTShape(d_model=2048, heads=16, seq=2048, batch=4, dtype="bfloat16")
"""The benchmark stack of ``benchmarks.activation_memory`` (its first configuration)."""
CPU_SHAPE = GPTShape(d_model=256, heads=4, seq=256, batch=2, dtype="float32")
"""Small enough that the C++ Inductor backend compiles it in under a minute on two cores."""
LLAMA_TOKENS = 4096
"""Tokens of a Llama preset's step on CUDA (one sequence): the streaming benchmark's first
point."""
STREAMED_BUDGETS = {"1b": "14GiB", "3b": "14GiB", "8b": "22GiB", "tiny": "2MiB"}
"""storm's byte budget for a streamed preset: the streaming benchmark's (a 16 GiB cap for 3B,
24 GiB for 8B, 2 GiB of each left to the allocator and the caching of blocks)."""
STREAMED_GPT_BUDGET = 0.5
"""storm's budget for a streamed gpt: the trainer benchmark's for its streamed rows, a fraction
(the gpt's bf16 weights, 0.8 GB at 8 blocks, fit any GPU; the row times the streamed compile)."""
STEADY_STEPS = 3
"""Steps after the first, whose median separates compile time from the step's own time."""
CHILD_TIMEOUT_S = 1800
"""A cold 32-layer compile takes minutes; a child that hangs must not stall the whole run."""
METRIC_MIN_S = 0.05
"""A compile phase torch timed (``compilation_time_metrics``) that took less in all its calls is
left out of the child's ``compile_metrics_s``: the detail behind :data:`PHASES`."""
STDERR_MARKERS = ("Traceback", "Failed to pickle")
"""Lines of a child's stderr that show an error was logged (a cache write that failed)."""
WARNING_RE = re.compile(r"^(\[rank\d+\]:)?W\d{4} |Warning: |WARNING")
"""A warning line: torch's log format (``W0930 12:00:00.0 ...``), ``warnings.warn`` or logging."""
PROFILE_LINES = 60
"""Functions of a profiled first step written out (``--profile``), twice: by cumulative time (its
callers down to the passes, Dynamo's tracing and Inductor's phases) and by own time (where the
seconds are spent), with the raw statistics beside them (``.pstats``, for ``pstats``)."""
CACHE_COUNTERS = {
    "inductor": ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass"),
    "aot_autograd": ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass"),
}
"""``torch._dynamo.utils.counters`` entries read by the child; absent ones read as 0."""
PHASES = {
    "tracing": ("bytecode_tracing", "aot_trace_joint_graph"),
    "partition": ("StormPartitioner", "min_cut_rematerialization_partition"),
    "Inductor forward": ("compile_fx.<locals>.fw_compiler_base",),
    "Inductor backward": ("compile_fx.<locals>.bw_compiler",),
    "cache load": ("AOTAutogradCache.inductor_load",),
}
"""Where a first step's seconds went, from the compile phases torch times
(``torch._dynamo.utils.compilation_time_metrics``, summed over a phase's names; a name this
torch does not time counts 0): Dynamo's and AOTAutograd's tracing, the partition (storm's whole
pipeline, or Inductor's min-cut), Inductor compiling each graph, a cache hit's load. The first
step's ``other`` is what is left: running it (pinned buffers allocated, kernels autotuned at
their first launch) and what the phases above do not cover."""
CACHE_LOGGERS = ("torch._inductor.codecache", "torch._functorch._aot_autograd.autograd_cache")
"""Loggers that say, at INFO, why a graph bypassed the FX graph or AOTAutograd cache."""


class _BypassReasons(logging.Handler):
    """Collects the reasons the caches give for a bypass."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.reasons: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Bypassing"):
            self.reasons.add(message)


@contextlib.contextmanager
def _bypass_reasons() -> Iterator[set[str]]:
    handler = _BypassReasons()
    loggers = [logging.getLogger(name) for name in CACHE_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    try:
        yield handler.reasons
    finally:
        for logger, level in zip(loggers, levels):
            logger.removeHandler(handler)
            logger.setLevel(level)


def _shape(device: str, layers: int | None = None) -> GPTShape:
    """The device's shape with ``layers`` blocks (None: the shape as defined)."""
    shape = CUDA_SHAPE if device == "cuda" else CPU_SHAPE
    return shape if layers is None else dataclasses.replace(shape, layers=layers)


def _build(model_name: str, device: str, streamed_on: bool):
    """``(model, inputs, loss_of_output, storm options)`` of a ``--models`` name; with
    ``streamed_on`` a streamed model's parameters go to host memory."""
    kind, _, rest = model_name.partition("-")
    cpu_options = CPU_STORM_OPTIONS if device == "cpu" else {}
    if kind == "gpt":
        layers, _, streamed = rest.removeprefix("L").partition("-")
        model, inputs = build_gpt(_shape(device, int(layers)), device)
        options = dict(cpu_options)
        if streamed and streamed_on:
            stream_parameters(model, device)
            options["memory_budget"] = STREAMED_GPT_BUDGET
        return model, inputs, lambda out: out.float().pow(2).mean(), options
    preset, _, streamed = rest.partition("-")
    shape = LLAMA_PRESETS[preset]
    if device == "cuda":
        shape = dataclasses.replace(shape, seq=LLAMA_TOKENS, batch=1)
    streamed = streamed == "streamed"
    model, inputs = build_llama(shape, device)    # the GPU draws an 8B model's weights fast
    options = dict(cpu_options)
    if streamed and streamed_on:
        stream_parameters(model, device)
        options["memory_budget"] = STREAMED_BUDGETS[preset]
    return model, inputs, lambda out: out, options


def child(backend_name: str, model_name: str, device: str, profile: Path | None = None) -> dict:
    """Time the first compiled fw+bw step and the steady steps after it, in this process; with
    ``profile``, write there where the first step's host time went (cProfile)."""
    dev = _Device(device)
    torch.manual_seed(0)
    model, inputs, loss_of, options = _build(model_name, device, backend_name == "storm")
    setup_begin = time.perf_counter()
    backend = "inductor" if backend_name == "inductor" else storm(**options)
    setup_s = time.perf_counter() - setup_begin
    run = torch.compile(model, backend=backend)

    def step() -> float:
        begin = time.perf_counter()
        loss_of(run(*inputs)).backward()
        dev.sync()
        return time.perf_counter() - begin

    dev.sync()
    profiler = cProfile.Profile() if profile else contextlib.nullcontext()
    with _bypass_reasons() as reasons, profiler:
        first_s = step()
    if profile:
        profiler.dump_stats(profile.with_suffix(".pstats"))
        with profile.open("w") as stream:
            stats = pstats.Stats(profiler, stream=stream)
            for order in ("cumulative", "tottime"):
                stats.sort_stats(order).print_stats(PROFILE_LINES)
    steady_s = statistics.median(step() for _ in range(STEADY_STEPS))
    result = {"first_step_s": first_s, "steady_step_s": steady_s,
              "compile_s": first_s - steady_s, "backend_setup_s": setup_s,
              "bypass_reasons": sorted(reasons), "phases_s": phase_seconds(first_s)}
    for group, names in CACHE_COUNTERS.items():
        result.update({name: counters[group][name] for name in names})
    result["compile_metrics_s"] = {
        name: [round(s, 3) for s in seconds]
        for name, seconds in compilation_time_metrics.items() if sum(seconds) >= METRIC_MIN_S}
    result["generated_kernels"] = inductor_metrics.generated_kernel_count
    return result


def phase_seconds(first_s: float) -> dict[str, float]:
    """Seconds of each of :data:`PHASES` this process spent, and ``other``: the rest of
    ``first_s``."""
    metrics = compilation_time_metrics
    phases = {phase: sum(sum(metrics.get(name, ())) for name in names)
              for phase, names in PHASES.items()}
    return {**phases, "other": first_s - sum(phases.values())}


def error_line(error: BaseException) -> str:
    """``Type: first line`` of a failure, looking through Dynamo's backend-failure wrapper."""
    cause = getattr(error, "inner_exception", None) or error
    first_line = (str(cause).strip().splitlines() or [""])[0]
    return f"{type(cause).__name__}: {first_line}"


def _run_child(backend: str, model: str, device: str, cache: Path, stderr_path: Path,
               profile: Path | None) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
           "TRITON_CACHE_DIR": str(cache / "triton")}
    command = [sys.executable, "-m", "benchmarks.compile_time", "--child", "--backend", backend,
               "--models", model, "--device", device]
    if profile:
        command += ["--profile-to", str(profile)]
    begin = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True,
                              timeout=CHILD_TIMEOUT_S, cwd=Path(__file__).resolve().parent.parent)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {CHILD_TIMEOUT_S} s", "stderr_errors": 0,
                "stderr_warnings": 0}
    stderr_path.write_text(done.stderr)
    lines = done.stderr.splitlines()
    row = {"process_s": time.perf_counter() - begin, "stderr": str(stderr_path),
           "stderr_errors": sum(any(m in line for m in STDERR_MARKERS) for line in lines),
           "stderr_warnings": sum(bool(WARNING_RE.search(line)) for line in lines)}
    json_lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not json_lines:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return {**row, "error": last}
    return {**row, **json.loads(json_lines[-1])}


def measure(backend: str, model: str, device: str, out_dir: Path, profile: bool) -> dict:
    """Cold then warm first-step times of one backend and model, in two fresh processes; with
    ``profile``, a third warm child whose first step is profiled into
    ``profile_<model>_<backend>.txt`` (the profiler's overhead stays out of the two timed)."""
    row = {"model": model, "backend": backend}
    with tempfile.TemporaryDirectory(prefix="storm-compile-time-") as cache:
        for phase in ("cold", "warm", "profiled")[:3 if profile else 2]:
            stderr_path = out_dir / f"stderr_{row['model']}_{backend}_{phase}.txt"
            profile_path = out_dir / f"profile_{model}_{backend}.txt" \
                if phase == "profiled" else None
            row[phase] = _run_child(backend, model, device, Path(cache), stderr_path,
                                    profile_path)
            print(f"[{row['model']}] {backend} {phase}: "
                  f"{row[phase].get('error') or '%.1f s' % row[phase]['first_step_s']}",
                  flush=True)
    return row


def _reused(rows: list[dict], backend: str, model: str) -> dict | None:
    """Inductor's row of a streamed model, where the run measured its unstreamed model: the
    same compile (Inductor cannot stream), measured once."""
    unstreamed = model.removesuffix("-streamed")
    if backend != "inductor" or unstreamed == model:
        return None
    for row in rows:
        if row["model"] == unstreamed and row["backend"] == "inductor":
            return {**row, "model": model}
    return None


def _seconds(row: dict | None, phase: str, figure: str = "first_step_s") -> float | None:
    return None if row is None else row[phase].get(figure)


def _counts(row: dict, group: str) -> str:
    """``hit/miss/bypass`` of one cache, cold then warm (``-`` where a child failed)."""
    def one(phase: dict) -> str:
        if "error" in phase:
            return "-"
        return "/".join(str(phase[name]) for name in CACHE_COUNTERS[group])

    return f"{one(row['cold'])}; {one(row['warm'])}"


def markdown(rows: list[dict]) -> str:
    inductor = {r["model"]: r for r in rows if r["backend"] == "inductor"}
    table = []
    for r in rows:
        ref = None if r["backend"] == "inductor" else inductor.get(r["model"])
        table.append({
            "model": r["model"], "backend": r["backend"],
            "cold s": _seconds(r, "cold"), "warm s": _seconds(r, "warm"),
            "cold × inductor": _ratio(_seconds(r, "cold"), _seconds(ref, "cold")),
            "warm × inductor": _ratio(_seconds(r, "warm"), _seconds(ref, "warm")),
            "steady step s": _seconds(r, "warm", "steady_step_s"),
            "warm compile × inductor": _ratio(_seconds(r, "warm", "compile_s"),
                                              _seconds(ref, "warm", "compile_s")),
            "FX graph cache hit/miss/bypass (cold; warm)": _counts(r, "inductor"),
            "AOT autograd cache hit/miss/bypass (cold; warm)": _counts(r, "aot_autograd"),
            "stderr errors (cold; warm)":
                f"{r['cold']['stderr_errors']}; {r['warm']['stderr_errors']}",
            "stderr warnings (cold; warm)":
                f"{r['cold']['stderr_warnings']}; {r['warm']['stderr_warnings']}",
            "error": r["cold"].get("error") or r["warm"].get("error"),
        })
    reasons = sorted({reason for r in rows for phase in ("cold", "warm")
                      for reason in r[phase].get("bypass_reasons", ())})
    notes = "".join(f"\n- {reason}" for reason in reasons)
    return (tabulate(table, headers="keys", tablefmt="github", floatfmt=".3g", missingval="")
            + (f"\nCache bypass reasons:\n{notes}\n" if notes else "\n")
            + "\nWhere each first step's seconds went:\n\n" + phases_markdown(rows))


def phases_markdown(rows: list[dict]) -> str:
    """One line per row and phase (cold, warm) that ran: its seconds in each of
    :data:`PHASES` and ``other``."""
    table = [{"model": r["model"], "backend": r["backend"], "phase": phase,
              **{name: seconds for name, seconds in r[phase]["phases_s"].items()}}
             for r in rows for phase in ("cold", "warm") if "phases_s" in r[phase]]
    return tabulate(table, headers="keys", tablefmt="github", floatfmt=".1f") + "\n"


def cuda_missing(benchmark: str, smoke: bool) -> bool:
    """Whether a GPU benchmark run without ``--smoke`` finds no CUDA device; says so on stderr
    in one line."""
    if smoke or torch.cuda.is_available():
        return False
    print(f"{benchmark}: no CUDA device; the GPU benchmark needs one (--smoke runs the "
          f"harness on the CPU)", file=sys.stderr)
    return True


def write(out_dir: Path, results: dict, table: str) -> str:
    """Write ``results.json`` and ``results.md``; after every row, so a run cut short by a time
    limit leaves what it measured."""
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    (out_dir / "results.md").write_text(table)
    return table


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt-L8,gpt-L32",
                        help="comma-separated: gpt-L<layers>, gpt-L<layers>-streamed, "
                             "llama-<preset>, llama-<preset>-streamed")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", type=Path, default=Path("bench-out/compile-time"))
    parser.add_argument("--profile", action="store_true",
                        help="one more warm child, its first step profiled (profile_*.txt)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--profile-to", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--backend", choices=BACKENDS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.models = args.models.split(",")
    for model in args.models:
        kind, _, rest = model.partition("-")
        preset = rest.removesuffix("-streamed")
        if not (kind == "gpt" and preset.removeprefix("L").isdigit()
                or kind == "llama" and preset in LLAMA_PRESETS):
            parser.error(f"--models: cannot read {model!r}; expected gpt-L<layers>, "
                         f"gpt-L<layers>-streamed, llama-<preset> or llama-<preset>-streamed, "
                         f"presets "
                         f"{', '.join(LLAMA_PRESETS)}")
    return args


def main(argv=None) -> int:
    args = _parse(argv)
    if args.child:
        try:
            result = child(args.backend, args.models[0], args.device, args.profile_to)
        except Exception as error:  # reported in the parent's row; the run goes on
            print(json.dumps({"error": error_line(error)}), flush=True)
            return 1
        print(json.dumps(result), flush=True)
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("compile_time: no CUDA device; run with --device cpu for the CPU variant",
              file=sys.stderr)
        return EXIT_NO_CUDA
    args.out.mkdir(parents=True, exist_ok=True)
    environment = {"torch": torch.__version__, "python": platform.python_version(),
                   "device": torch.cuda.get_device_name() if args.device == "cuda"
                   else platform.processor(),
                   "shape": {k: v for k, v in dataclasses.asdict(_shape(args.device)).items()
                             if k != "layers"}}
    rows = []
    for model in args.models:
        for backend in BACKENDS:
            rows.append(_reused(rows, backend, model)
                        or measure(backend, model, args.device, args.out, args.profile))
            table = write(args.out, {"environment": environment, "rows": rows}, markdown(rows))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
