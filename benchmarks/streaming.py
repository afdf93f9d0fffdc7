"""Weights in host memory: a Llama preset trained with its parameters streamed under storm,
beside uncapped torch.compile and FSDP2's CPU offload on one rank, in one run.

Every method starts from the same bf16 weights (``--preset``, optionally fewer ``--layers``)
and sees the same batches; the optimizer is AdamW (``fused=True``) where the parameters live:

* ``compile``: the whole model, its gradients and AdamW's state on the GPU, ``torch.compile``
  with Inductor, no memory cap (the reference).
* ``eager``: ``compile`` without ``torch.compile``. Its losses differ from ``compile``'s only by
  how the kernels round (Inductor's fusions round bf16 otherwise, and cuDNN's attention
  backward, which PyTorch does not make deterministic, sums in an order that can change from run
  to run), so its gap to ``compile`` over the loss part is the spread that rounding alone gives
  that trajectory, against which a storm run's gap is read.
* ``storm``: the plain loop (``backward()`` per micro-batch, ``optimizer.step()``,
  ``zero_grad()``). :func:`~storm_compile.weights.streaming.stream_parameters` keeps the parameters
  of 1 MiB or more in pinned host memory, ``torch.compile(backend=storm(memory_budget=--budget))``,
  AdamW on the host; the process's GPU memory capped at ``--cap-gib`` with
  ``torch.cuda.set_per_process_memory_fraction``. Storm learns the loop
  (:mod:`storm_compile.runtime.cycles`) in the untimed step and the first timed one; where the
  number of micro-batches changes between points, the run says so with
  :func:`~storm_compile.weights.streaming.overlap_optimizer`, which starts the learning afresh.
* ``storm-explicit``: ``storm`` with the constructs that say up front what storm would learn:
  :class:`~storm_compile.weights.streaming.OverlappedOptimizer` around the last micro-batch's
  backward and the micro-batches in :func:`~storm_compile.weights.streaming.gradient_accumulation`.
* ``fsdp2-offload``: ``fully_shard`` on every block and the root with ``CPUOffloadPolicy`` on a
  one-rank process group (torch's hook-based offload), eager, AdamW on the host, same cap;
  gradient accumulation as FSDP2 documents it: ``set_requires_gradient_sync(False)`` for every
  micro-batch but the last: the gradients before it accumulate unsharded on the GPU, and only
  the sum is reduced and sent to the host (benchmarks/RESULTS.md has FSDP2 sending every
  micro-batch's home instead).

Every method runs with the caching allocator's expandable segments unless
``PYTORCH_CUDA_ALLOC_CONF`` is set (:data:`ALLOCATOR`).

Two parts, both optional:

* loss (``--loss-steps N``): N optimizer steps of one micro-batch of ``--loss-tokens`` tokens,
  every method's loss of every step, and the largest and median differences against
  ``compile`` (run for the losses whether listed or not). Each step draws new random tokens,
  which no model can learn; with ``--loss-batches K`` the steps cycle through K drawn batches,
  which a model can learn by heart;
* throughput: for each tokens per micro-batch in ``--tokens`` and each listed method, one
  model built and compiled, then for each micro-batches per optimizer step in
  ``--micro-batches`` ``--steps`` timed optimizer steps after one untimed one (the first
  point's untimed step compiles): tokens/s and, when ``compile`` is listed, the ratio to its
  tokens/s, achieved TFLOP/s (model FLOPs: 6 per parameter per token plus causal attention's
  6 · layers · d_model · seq per token), the optimizer's share of the step, peak device memory
  and the caching allocator's retries per timed step (each frees its cached blocks, which
  synchronizes the device),
  the seconds the method's setup (model, streaming, optimizer) and each point's untimed step took,
  and for storm its plans' predicted tokens/s (the whole optimizer step: the micro-batches' forward
  and backward, the host thread's additions and the host AdamW, overlapped or after, as
  :func:`storm_compile.cost.simulate.predict_step` predicts it) with where it predicts the step
  waits: on copies (exposed transfers) and on the host (additions and optimizer), its predicted
  device peak (the largest of its graphs'), and in ``results.json`` the ops it predicts the most
  compute time for; with ``--profile``, one more step of the listed methods traced, and where its
  compute stream sat idle; with ``--peak-history``, one more step whose allocator history gives
  what is live at its peak (:mod:`benchmarks.peak_history`).

    python -m benchmarks.streaming --out DIR [--preset 3b] [--cap-gib 16] [--tokens 2048,4096]
        [--micro-batches 1,4] [--loss-steps 100] [--methods compile,storm,fsdp2-offload]
        [--reference-losses earlier/results.json] [--profile storm] [--log host.log]

With ``--lora RANK`` every method trains adapters of that rank beside every linear layer of a
frozen base, built on the meta device and loaded from the same drawn weights one at a time
(:class:`_DrawnWeights`); with ``--host-format`` storm holds the frozen streamed weights in that
format and ``compile`` trains on the same quantized weights resident, so their losses differ by
streaming alone. A LoRA row's TFLOP/s counts 4 FLOP per frozen parameter and token, and its
``of bound`` is its tokens/s over the lower of two limits at its micro-batch size: the link's
(every streamed host byte crossing twice, at the calibrated host-to-device rate) and the
GPU's (the model FLOPs at the calibrated matmul rate).

``--compile-blocks`` compiles each block of the model on its own (regional compilation), for
``compile`` and storm alike: identical blocks share one compiled graph, so the compile takes one
block's time, and the embedding, the head and the loss run uncompiled. Its storm rows record no
predictions: a block's plan is made once and run once per block.

``--cached`` plans storm's graphs without the benchmark's observer, so that torch's caches
(AOTAutograd's and Inductor's, under ``TORCHINDUCTOR_CACHE_DIR``) serve a later process running
the same command and skip storm's planning and Inductor; such a run records no predictions.
With ``--storm-profile PATH`` (a ``storm calibrate`` JSON) storm plans, and the bounds are
computed, from that calibration instead of the one cached for the present GPU, so that two
processes on two hosts plan the same step.

``--smoke`` runs the harness on the CPU (tiny preset, storm with ``transfer_cpu_tensors``).
Writes ``results.json`` and ``results.md`` after every row.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import gc
import json
import logging
import os
import platform
import statistics
import sys
import time
import typing
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from tabulate import tabulate
from torch import nn
from torch._dynamo.utils import counters

from benchmarks.activation_memory import CPU_STORM_OPTIONS, EXIT_NO_CUDA
from benchmarks.compile_time import cuda_missing, error_line, write
from benchmarks.memory_at_oom import record_until_oom
from benchmarks.peak_history import recorded
from benchmarks.trace_analysis import MATMUL_PACKETS, matmul_key, profiled
from storm_compile.cli.models import LLAMA_PRESETS, Llama, LlamaShape, add_lora
from storm_compile.compiler.backend import StormBackend
from storm_compile.config import OffloadFormat, StormConfig
from storm_compile.cost.calibrate import profile_for
from storm_compile.cost.simulate import device_bytes, predict_step, simulate
from storm_compile.fx.graphs import COST_KEY, StormGraphs
from storm_compile.fx.prediction import StepPrediction
from storm_compile.fx.vocabulary import GB, GIB, MS, US
from storm_compile.weights.quantize import FORMATS, dequantize, quantize
from storm_compile.weights.streaming import (
    DEFAULT_RESIDENT_BYTES,
    OverlappedOptimizer,
    gradient_accumulation,
    overlap_optimizer,
    stream_parameters,
)

OPS_REPORTED = 12
"""The ops with the most predicted compute time a storm row lists in results.json: enough to see
which op a prediction gets wrong when it is set beside a profile of the run."""
MATMULS_REPORTED = 24
"""The matrix-product shapes with the most measured GPU time a profiled storm row sets beside
their prices (``matmul_prices``): a Llama step has a handful per layer, LoRA adds four per
adapted matrix."""
REFERENCE = "compile"
METHODS = ("compile", "storm", "storm-explicit", "fsdp2-offload")
OFFLOAD_FORMATS = tuple(f for f in typing.get_args(OffloadFormat) if f is not None)
"""``--offload-format``'s choices: storm's ``offload_format`` values other than exact."""
LEARNING_RATE = 3e-4
"""A usual AdamW rate for models of this size: the loss moves visibly within 100 steps."""
MODEL_SEED = 0
DATA_SEED = 1_000
"""Micro-batch ``i`` of a run is drawn from seed ``DATA_SEED + i`` (``i`` modulo K under
``--loss-batches K``): the same for every method."""
FLOPS_PER_PARAMETER_TOKEN = 6
"""Forward and backward of a weight matrix: 2 + 4 FLOP per parameter per token."""
ATTENTION_FLOPS = 6
"""Causal attention, forward and backward, per layer, d_model unit and key position, per token
(12 for full attention, halved by the mask)."""
ALLOCATOR = ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
"""The caching allocator's setting of every method's run unless the environment sets one: a
streamed step frees and reallocates weight-sized blocks on three streams, and with fixed
segments the 8B step at a 24 GiB cap failed with 1.38 GiB reserved but unallocated; with
expandable segments it trained."""
OOM_REPORT = "oom.txt"
"""With ``--oom-report``: what held the device at the first failed allocation
(:mod:`benchmarks.memory_at_oom`)."""
LINK_CROSSINGS = 2
"""Times a streamed weight crosses the link per micro-batch (forward and backward): the
link-bound limit of a frozen base counts every host byte twice."""
FROZEN_FLOPS_PER_PARAMETER_TOKEN = 4
"""A frozen weight matrix: forward and the gradient of its input, no gradient of its own."""
INIT_STD = 0.02
"""Standard deviation of every drawn matrix and adapter factor (Llama's initializer range); norm
weights are ones."""
SMOKE_SHAPE = dataclasses.replace(LLAMA_PRESETS["tiny"], batch=1)
SMOKE_RESIDENT_BYTES = 4096
"""The tiny preset's parameters are all below the default ``resident_bytes``; the smoke run
streams all but its norms."""


@dataclasses.dataclass
class _Run:
    """A method ready to train: ``step(micro_batches)`` runs one optimizer step, returning the
    loss of the last micro-batch and the optimizer's seconds."""

    step: Callable[[list[tuple[torch.Tensor, torch.Tensor]]], tuple[float, float]]
    predicted: Callable[[int], StepPrediction | None]
    """The prediction of an optimizer step of that many micro-batches (all graphs of the step
    summed); None if unpredicted."""
    op_ms: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    """Predicted milliseconds of one micro-batch's forward and backward on the compute stream,
    by op, over the graphs the method compiled (empty when unpredicted)."""
    peaks: list[int] = dataclasses.field(default_factory=list)
    """Each compiled graph's predicted device peak, bytes (empty when unpredicted)."""
    host_bytes: int | None = None
    """Bytes of the streamed parameters in host memory (None when nothing streams)."""
    matmul_us: dict[tuple[str, str], list[float]] = dataclasses.field(default_factory=dict)
    """The priced microseconds of every matrix product the plans run, by
    :func:`~benchmarks.trace_analysis.matmul_key` (empty when unpredicted)."""


def _model(shape: LlamaShape, args, on: str) -> nn.Module:
    """The preset's model on ``on``, its weights drawn on ``args.device`` from ``MODEL_SEED``:
    every method of a run starts from the same weights, and the GPU draws an 8B model's in
    well under a second where the host's one generator takes minutes. With ``--lora``, frozen
    with adapters beside every linear layer, loaded from :class:`_DrawnWeights`, and with
    ``--host-format``, its frozen matrices hold what the format keeps of them."""
    if args.lora is None:
        torch.manual_seed(MODEL_SEED)
        return Llama(shape, device=args.device, dtype=getattr(torch, shape.dtype)).to(on)
    model, weights = _adapted(shape, args)
    state = {name: weights[name] for name in weights}
    if args.host_format is not None:
        frozen = {n for n, p in model.named_parameters()
                  if not p.requires_grad and p.numel() * p.element_size() >= args.resident_bytes}
        state = {n: dequantize(*quantize(v, args.host_format)) if n in frozen else v
                 for n, v in state.items()}
    model.load_state_dict(state, assign=True)
    return model.to(on)


DRAW_DTYPE = torch.float32
"""Weights are drawn in float32, then cast to the model's dtype."""

DRAW_CHUNK_BYTES = 256 * 2**20
"""Float32 drawn at a time for one weight. Drawn whole, a 70B vocabulary matrix held two
float32 tensors of 3.91 GiB on the device (the draw and its scaled copy): under ``--cap-gib
7.45`` the 8-layer shape ran out of memory there, before its first step."""


class _DrawnWeights(Mapping):
    """Every parameter of a model built on the meta device, drawn on ``device`` when looked up
    (each from its own seed, so in any order and any number of times the same): a model larger
    than host memory in its dtype is never held whole."""

    def __init__(self, model: nn.Module, device: str) -> None:
        self.params = {n: (i, p.shape, p.dtype) for i, (n, p) in enumerate(
            model.named_parameters())}
        self.device = device

    def __getitem__(self, name: str) -> torch.Tensor:
        index, shape, dtype = self.params[name]
        if len(shape) < 2:
            return torch.ones(shape, dtype=dtype, device=self.device)
        generator = torch.Generator(self.device).manual_seed(MODEL_SEED + index)
        weight = torch.empty(shape, dtype=dtype, device=self.device)
        rows = max(1, DRAW_CHUNK_BYTES // (weight[0].numel() * DRAW_DTYPE.itemsize))
        for chunk in weight.split(rows):
            chunk.copy_(torch.randn(chunk.shape, generator=generator, dtype=DRAW_DTYPE,
                                    device=self.device) * INIT_STD)
        return weight

    def __iter__(self):
        return iter(self.params)

    def __len__(self) -> int:
        return len(self.params)


def _adapted(shape: LlamaShape, args) -> tuple[nn.Module, _DrawnWeights]:
    """The preset's model on the meta device, frozen, with ``--lora`` adapters, and the weights
    every method of the run loads into it."""
    with torch.device("meta"):
        model = add_lora(Llama(shape, dtype=getattr(torch, shape.dtype)), args.lora)
    return model, _DrawnWeights(model, args.device)


def _batches(shape: LlamaShape, count: int, device: str, distinct: int | None = None
             ) -> list[tuple[torch.Tensor, ...]]:
    """``count`` micro-batches of random tokens, cycling through ``distinct`` drawn ones (all
    distinct when None)."""
    batches = []
    for index in range(count):
        drawn = index if distinct is None else index % distinct
        generator = torch.Generator().manual_seed(DATA_SEED + drawn)
        tokens = torch.randint(shape.vocab, (shape.batch, shape.seq + 1), generator=generator)
        batches.append((tokens[:, :-1].to(device), tokens[:, 1:].to(device)))
    return batches


def _trainer(forward: Callable, optimizer: torch.optim.Optimizer, sync: Callable[[], None],
             overlapped: OverlappedOptimizer | None = None, deferred: bool = False,
             reduce_gradients: Callable[[bool], None] | None = None,
             relearn: bool = False) -> Callable:
    """With ``overlapped``, the last micro-batch's backward steps the streamed parameters;
    ``deferred``, the micro-batches run in :func:`gradient_accumulation`;
    ``reduce_gradients(last)`` is called before each micro-batch; ``relearn``: a step with
    another number of micro-batches than the one before starts storm's learning afresh."""
    counts = []

    def step(micro_batches):
        if relearn and counts[-1:] != [len(micro_batches)]:
            overlap_optimizer(optimizer)
        counts.append(len(micro_batches))
        with gradient_accumulation() if deferred else contextlib.nullcontext():
            for index, (tokens, targets) in enumerate(micro_batches):
                last = index == len(micro_batches) - 1
                if reduce_gradients is not None:
                    reduce_gradients(last)
                loss = forward(tokens, targets) / len(micro_batches)
                with overlapped.final_backward() if overlapped and last \
                        else contextlib.nullcontext():
                    loss.backward()
        sync()
        begin = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad()
        sync()
        return loss.item() * len(micro_batches), time.perf_counter() - begin
    return step


def _cap(gib: float | None, cuda: bool) -> None:
    if cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(1.0 if gib is None else
                                                   min(1.0, gib * GIB / total))


def _compiled(model: nn.Module, backend, args) -> Callable:
    """``model`` compiled whole, or with ``--compile-blocks`` each of its blocks compiled on its
    own (regional compilation: the embedding, the head and the loss run uncompiled)."""
    if not args.compile_blocks:
        return torch.compile(model, backend=backend)
    for block in model.blocks:
        block.compile(backend=backend)
    return model


def _compile(shape: LlamaShape, args, cuda: bool, compiled: bool = True) -> _Run:
    _cap(None, cuda)
    model = _model(shape, args, args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, fused=True)
    return _Run(_trainer(_compiled(model, "inductor", args) if compiled else model, optimizer,
                         args.sync),
                lambda micro_batches: None)


def _storm(shape: LlamaShape, args, cuda: bool, explicit: bool = False) -> _Run:
    _cap(args.cap_gib, cuda)
    if args.lora is None:
        model = _model(shape, args, "cpu")
        streamed = stream_parameters(model, args.device, resident_bytes=args.resident_bytes)
    else:
        model, weights = _adapted(shape, args)
        streamed = stream_parameters(model, args.device, resident_bytes=args.resident_bytes,
                                     host_format=args.host_format, weights=weights)
    options = {"memory_budget": args.budget} if args.budget is not None else {}
    if args.cost is not None:
        options["cost"] = args.cost
    if args.offload_format is not None:
        options["offload_format"] = args.offload_format
    if not cuda:
        options = {**options, **CPU_STORM_OPTIONS, "transfer_cpu_tensors": True}
    if args.storm_profile is not None:
        options["profile"] = args.storm_profile
    predicted: list[dict[int, StepPrediction]] = []
    peaks: list[int] = []
    op_ms: collections.Counter = collections.Counter()
    matmul_us: dict[tuple[str, str], list[float]] = collections.defaultdict(list)

    def observe(graphs: StormGraphs) -> None:
        """Simulate each plan as it is made: Inductor rewrites the graphs once it compiles."""
        predicted.append({count: predict_step(graphs, backend.ctx.cost, count, overlapped=True,
                                              accumulating=True)
                          for count in args.micro_batches})
        peaks.append(device_bytes(graphs, simulate(graphs, backend.ctx.cost)))
        for module in (graphs.forward, graphs.backward):
            for node in module.graph.nodes:
                if node.op == "call_function" and COST_KEY in node.meta:
                    op_ms[str(node.target)] += node.meta[COST_KEY].compute_s * MS
                    if matmul_key(str(node.target), ())[0] in MATMUL_PACKETS:
                        shapes = [a.meta["val"].shape for a in node.args[:2]]
                        matmul_us[matmul_key(str(node.target), shapes)].append(
                            node.meta[COST_KEY].compute_s * US)

    def predicted_step(micro_batches: int) -> StepPrediction | None:
        if not predicted:
            return None
        fields = ("first_micro_batch_s", "micro_batch_s", "last_micro_batch_s", "optimizer_s",
                  "exposed_transfer_s", "first_host_wait_s", "host_wait_s", "last_host_wait_s")
        return dataclasses.replace(predicted[0][micro_batches], **{
            f: sum(getattr(p[micro_batches], f) for p in predicted) for f in fields})

    backend = StormBackend(StormConfig.from_options(**options),
                           observer=None if args.cached or args.compile_blocks else observe)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, fused=True)
    overlapped = OverlappedOptimizer(optimizer) if explicit else None
    return _Run(_trainer(_compiled(model, backend, args), optimizer, args.sync,
                         overlapped, deferred=explicit, relearn=not explicit),
                predicted_step, op_ms, peaks, streamed.host_bytes, matmul_us)


def _fsdp2_offload(shape: LlamaShape, args, cuda: bool) -> _Run:
    if not cuda:
        raise RuntimeError("fsdp2-offload needs CUDA (one NCCL rank)")
    if args.lora is not None:
        raise RuntimeError("fsdp2-offload is not run with --lora")
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    _cap(args.cap_gib, cuda)
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    model = _model(shape, args, "cpu")
    for block in model.blocks:
        fully_shard(block, offload_policy=CPUOffloadPolicy())
    fully_shard(model, offload_policy=CPUOffloadPolicy())
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, fused=True)
    return _Run(_trainer(model, optimizer, args.sync,
                         reduce_gradients=model.set_requires_gradient_sync),
                lambda micro_batches: None)


BUILDERS = {"compile": _compile, "eager": functools.partial(_compile, compiled=False),
            "storm": _storm,
            "storm-explicit": functools.partial(_storm, explicit=True),
            "fsdp2-offload": _fsdp2_offload}


def _profile(args, cuda: bool):
    """The device profile storm plans with here: ``--storm-profile``, by default the present
    GPU's calibration (the CPU test profile on a smoke run)."""
    return profile_for(args.storm_profile or ("auto" if cuda else "cpu-test"))


def _release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    torch._dynamo.reset()


def _model_flops(shape: LlamaShape, tokens: int, lora: int | None = None) -> float:
    """Model FLOPs of ``tokens``: 6 per matrix parameter and token (4 for a frozen one, with
    ``lora`` adapters of that rank beside every matrix, which train: 6 per adapter parameter),
    plus causal attention."""
    matrices = shape.parameters - shape.vocab * shape.d_model * (
        0 if shape.tie_embeddings else 1)
    attention = ATTENTION_FLOPS * shape.layers * shape.d_model * shape.seq
    if lora is None:
        return tokens * (FLOPS_PER_PARAMETER_TOKEN * matrices + attention)
    with torch.device("meta"):
        model = add_lora(Llama(shape), lora)
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return tokens * (FROZEN_FLOPS_PER_PARAMETER_TOKEN * matrices
                     + FLOPS_PER_PARAMETER_TOKEN * adapters + attention)


def _losses(shape: LlamaShape, args, cuda: bool, method: str) -> dict | str:
    """Every step's loss, the median step's seconds and the peak device memory of the run."""
    batches = _batches(shape, args.loss_steps, args.device, args.loss_batches)
    try:
        run = BUILDERS[method](shape, args, cuda)
        losses, seconds = [], []
        for index, batch in enumerate(batches):
            begin = time.perf_counter()
            losses.append(run.step([batch])[0])
            seconds.append(time.perf_counter() - begin)
            print(f"{method} step {index}: loss {losses[-1]:.4f}", flush=True)
        return {"losses": losses, "step_ms": statistics.median(seconds) * MS,
                "peak_gib": torch.cuda.max_memory_allocated() / GIB if cuda else None}
    except Exception as error:  # noqa: BLE001 - a failing method is a result, not a crash
        return error_line(error)
    finally:
        run = None
        _release()


def _loss_summary(runs: dict[str, dict | str]) -> dict:
    reference = runs.get(REFERENCE)
    summary = {}
    for method, run in runs.items():
        if isinstance(run, str) or isinstance(reference, str):
            summary[method] = run if isinstance(run, str) else "no reference"
            continue
        gaps = [abs(a - b) for a, b in zip(run["losses"], reference["losses"])]
        summary[method] = {"max_abs_diff": max(gaps),
                           "median_abs_diff": statistics.median(gaps),
                           "max_rel_diff": max(g / abs(b) for g, b in
                                               zip(gaps, reference["losses"])),
                           "first": run["losses"][0], "last": run["losses"][-1],
                           "step_ms": run["step_ms"], "peak_gib": run["peak_gib"]}
    return {"runs": runs, "summary": summary}


def _throughput_rows(method: str, shape: LlamaShape, args, cuda: bool) -> list[dict]:
    """One row per ``--micro-batches`` point of ``method`` at ``shape``'s tokens, on one built
    and compiled model: the micro-batch count does not change the graphs, so only the first
    point pays the method's setup and compile (its ``build_s``; every row's ``first_step_s`` is
    its untimed step)."""
    tokens = shape.batch * shape.seq
    rows = []
    try:
        begin = time.perf_counter()
        run = BUILDERS[method](shape, args, cuda)
        built_s = time.perf_counter() - begin
    except Exception as error:  # noqa: BLE001 - a failing method is a result, not a crash
        _release()
        return [{"method": method, "tokens": tokens, "micro_batches": m,
                 "error": error_line(error)} for m in args.micro_batches]
    for index, micro_batches in enumerate(args.micro_batches):
        row = {"method": method, "tokens": tokens, "micro_batches": micro_batches}
        if index == 0:
            row["build_s"] = built_s
        try:
            _measure(run, row, shape, args, cuda)
        except Exception as error:  # noqa: BLE001 - a failing point is a result, not a crash
            row["error"] = error_line(error)
        rows.append(row)
        print(row, flush=True)
    del run
    _release()
    return rows


def _measure(run: _Run, row: dict, shape: LlamaShape, args, cuda: bool) -> None:
    """Time ``args.steps`` optimizer steps of ``row``'s micro-batches after one untimed one, and
    set the row's figures and, for storm, its predictions."""
    micro_batches = row["micro_batches"]
    batches = _batches(shape, micro_batches, args.device)
    before = collections.Counter(counters["aot_autograd"])
    begin = time.perf_counter()
    run.step(batches)
    row["first_step_s"] = time.perf_counter() - begin
    row["autograd_cache"] = {k: v for k, v in (counters["aot_autograd"] - before).items()
                             if k.startswith("autograd_cache")}
    print(f"{row['method']}, {row['tokens']} tokens × {micro_batches}: untimed step "
          f"{row['first_step_s']:.1f} s", flush=True)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    retries = _alloc_retries(cuda)
    step_s, optimizer_s = [], []
    for _ in range(args.steps):
        begin = time.perf_counter()
        optimizer_s.append(run.step(batches)[1])
        step_s.append(time.perf_counter() - begin)
    step = min(step_s)
    tokens = row["tokens"] * micro_batches
    row.update(step_ms=step * MS, tokens_per_s=tokens / step,
               tflops=_model_flops(shape, tokens, args.lora) / step / 1e12,
               optimizer_ms=min(optimizer_s) * MS,
               peak_gib=torch.cuda.max_memory_allocated() / GIB if cuda else None,
               alloc_retries=(_alloc_retries(cuda) - retries) / args.steps if cuda else None)
    if row["method"] in args.peak_history and cuda:
        owners: dict = {}
        with recorded(owners):
            run.step(batches)
        row["peak_history"] = owners
    if row["method"] in args.profile:
        row.update(profiled(lambda: run.step(batches), cuda,
                            args.out / f"trace_{row['method']}_{row['tokens']}x{micro_batches}"
                                       f".json"))
    if "matmul_kernels" in row and run.matmul_us:
        row["matmul_prices"] = _matmul_prices(row.pop("matmul_kernels"), run.matmul_us)
    predicted = run.predicted(micro_batches)
    if run.host_bytes is not None and args.lora is not None:
        profile = _profile(args, cuda)
        link_s = LINK_CROSSINGS * run.host_bytes / profile.h2d_bandwidth
        compute_s = _model_flops(shape, row["tokens"], args.lora) / profile.matmul_flops
        row.update(link_bound_tokens_per_s=row["tokens"] / link_s,
                   compute_bound_tokens_per_s=row["tokens"] / compute_s,
                   of_bound=row["tokens_per_s"] / (row["tokens"] / max(link_s, compute_s)))
    if predicted is not None:
        row.update(pred_tokens_per_s=tokens / predicted.step_s,
                   pred_error=(tokens / predicted.step_s) / row["tokens_per_s"] - 1,
                   pred_exposed_ms=predicted.micro_batches * predicted.exposed_transfer_s * MS,
                   pred_host_ms=predicted.host_s * MS,
                   pred_peak_gib=max(run.peaks) / GIB, graphs=len(run.peaks),
                   pred_op_ms=dict(run.op_ms.most_common(OPS_REPORTED)))


def _matmul_prices(measured: list[dict], priced: dict[tuple[str, str], list[float]]
                   ) -> list[dict]:
    """The profiled step's matrix products with the most GPU time
    (:data:`MATMULS_REPORTED`), each beside what storm's plans priced for the same op and
    shapes: calls and microseconds per call of both."""
    rows = []
    for kernels in measured[:MATMULS_REPORTED]:
        prices = priced.get((kernels["op"], kernels["shapes"]), [])
        rows.append({"op": kernels["op"], "shapes": kernels["shapes"], "calls": kernels["calls"],
                     "us_per_call": kernels["kernel_us"] / kernels["calls"],
                     "priced_calls": len(prices),
                     "priced_us_per_call": sum(prices) / len(prices) if prices else None})
    return rows


def _alloc_retries(cuda: bool) -> int:
    """The caching allocator's retries so far: each an allocation that found no free block
    under the cap, freed the cached ones (synchronizing the device) and tried again."""
    return torch.cuda.memory_stats().get("num_alloc_retries", 0) if cuda else 0


def _rates(profile: dict) -> str:
    """The link and host rates of the profile storm planned with, as a line of the report."""
    return (f"Storm's profile ({profile['name']}): H2D {profile['h2d_bandwidth'] / GB:.1f} GB/s, "
            f"D2H {profile['d2h_bandwidth'] / GB:.1f} GB/s, both at once "
            f"{profile['duplex_bandwidth'] / GB:.1f} GB/s, "
            f"{profile['copy_latency_s'] * US:.0f} µs copy latency, host additions "
            f"{profile['host_add_bandwidth'] / GB:.1f} GB/s, host AdamW "
            f"{profile['host_adamw_bandwidth'] / GB:.2f} GB/s.")


def markdown(results: dict) -> str:
    parts = [_rates(results["profile"])] if "profile" in results else []
    if results.get("lora") is not None:
        held = results["host_format"] or "their dtype"
        parts.append(f"LoRA rank {results['lora']} beside every linear layer, the base frozen, "
                     f"its streamed weights in {held}; {REFERENCE}: the same weights resident.")
    if results.get("offload_format") is not None:
        parts.append(f"Storm's offloaded activations held in {results['offload_format']} on the "
                     f"host (lossy).")
    if results.get("compile_blocks"):
        parts.append("Each block compiled on its own (regional compilation); the embedding, "
                     "the head and the loss uncompiled.")
    loss = results.get("loss")
    if loss:
        rows = [[m, s] if isinstance(s, str) else
                [m, f"{s['first']:.4f}", f"{s['last']:.4f}", f"{s['max_abs_diff']:.4f}",
                 f"{s['max_rel_diff']:.2%}", f"{s['median_abs_diff']:.4f}",
                 f"{s['step_ms']:.0f}",
                 "" if s["peak_gib"] is None else f"{s['peak_gib']:.2f}"]
                for m, s in loss["summary"].items()]
        parts.append(tabulate(rows, headers=["method", "first loss", "last loss",
                                             f"max |Δ| vs {REFERENCE}", "max relative",
                                             "median |Δ|", "median step ms", "peak GiB"],
                              tablefmt="github"))
    reference = {(r["tokens"], r["micro_batches"]): r for r in results["throughput"]
                 if r["method"] == REFERENCE and "error" not in r}
    rows = []
    for row in results["throughput"]:
        if "error" in row:
            rows.append([row["method"], row["tokens"], row["micro_batches"], row["error"]])
            continue
        base = reference.get((row["tokens"], row["micro_batches"]))
        rows.append([row["method"], row["tokens"], row["micro_batches"],
                     f"{row['tokens_per_s']:.0f}",
                     "" if base is None else f"{row['tokens_per_s'] / base['tokens_per_s']:.2f}",
                     f"{row['tflops']:.1f}", f"{row['optimizer_ms']:.0f}",
                     " ".join(([] if row["peak_gib"] is None else [f"{row['peak_gib']:.2f}"])
                              + ([f"({row['pred_peak_gib']:.2f})"] if "pred_peak_gib" in row
                                 else [])),
                     f"{row['pred_tokens_per_s']:.0f} ({row['pred_error']:+.0%})"
                     if "pred_tokens_per_s" in row else "",
                     f"{row['pred_exposed_ms']:.0f} / {row['pred_host_ms']:.0f}"
                     if "pred_tokens_per_s" in row else "",
                     f"{row['build_s']:.0f} / {row['first_step_s']:.0f}" if "build_s" in row
                     else f"(built) / {row['first_step_s']:.0f}",
                     f"{row['of_bound']:.0%}" if "of_bound" in row else "",
                     "" if row.get("alloc_retries") is None else f"{row['alloc_retries']:g}"])
    if rows:
        parts.append(tabulate(rows, headers=["method", "tokens/µbatch", "µbatches", "tokens/s",
                                             f"× {REFERENCE}", "TFLOP/s", "optimizer ms",
                                             "peak GiB (predicted)", "predicted tokens/s",
                                             "predicted copy / host waits ms",
                                             "build / first step s", "of bound",
                                             "allocator retries / step"],
                              tablefmt="github"))
    return "\n\n".join(parts) + "\n"


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="3b", choices=sorted(LLAMA_PRESETS))
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the preset")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence")
    parser.add_argument("--cap-gib", type=float, default=16.0,
                        help="GPU memory cap of the storm and fsdp2-offload runs")
    parser.add_argument("--budget", default=None, help="storm's memory_budget (default: none)")
    parser.add_argument("--cost", default=None, choices=("roofline", "measured"),
                        help="storm's cost option (default: storm's)")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"comma-separated; the losses are always compared with "
                             f"{REFERENCE}'s, the throughput with {REFERENCE}'s when it is listed")
    parser.add_argument("--tokens", default="", help="comma-separated tokens per micro-batch")
    parser.add_argument("--micro-batches", default="1", help="comma-separated, per step")
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps per point")
    parser.add_argument("--loss-steps", type=int, default=0)
    parser.add_argument("--loss-tokens", type=int, default=4096)
    parser.add_argument("--loss-batches", type=int, default=None, metavar="K",
                        help="the loss steps cycle through K drawn batches, which a model can "
                             "learn by heart (default: new random tokens every step)")
    parser.add_argument("--reference-losses", type=Path, default=None,
                        help=f"results.json of an earlier run of the same shape and steps: its "
                             f"{REFERENCE} losses are the reference, and {REFERENCE} is not "
                             f"trained again")
    parser.add_argument("--log", type=Path, default=None,
                        help="write the storm_compile logger's DEBUG lines (among them one per "
                             "gradient added on the host: bytes, wait for its copy, addition "
                             "time, jobs queued) to this file")
    parser.add_argument("--profile", default="",
                        help="comma-separated methods whose each throughput point also profiles "
                             "one more step: its trace in --out, and in results.json the compute "
                             "stream's busy fraction and idle time, split by the copy it waited "
                             "on (home, to the device, none), and each direction's copy time by "
                             "stream")
    parser.add_argument("--peak-history", default="",
                        help="comma-separated methods whose each throughput point also records "
                             "one more step's allocator history: in results.json what is live "
                             "at its peak, grouped by the lines that allocated it")
    parser.add_argument("--lora", type=int, default=None, metavar="RANK",
                        help="freeze the model, adapters of this rank beside every linear layer "
                             "(LoRA fine-tuning); every method loads the same drawn weights")
    parser.add_argument("--host-format", default=None, choices=FORMATS,
                        help=f"with --lora: storm holds the frozen streamed weights in this "
                             f"format; {REFERENCE} trains on the same quantized weights, resident")
    parser.add_argument("--offload-format", default=None, choices=OFFLOAD_FORMATS,
                        help="storm's offload_format: its offloaded activations held in fp8 with "
                             "a power-of-two scale (lossy; the loss part shows what it costs)")
    parser.add_argument("--oom-report", action="store_true",
                        help="record the allocator's history (slower steps) and write what "
                             "held the device at the first failed allocation to OUT/oom.txt")
    parser.add_argument("--compile-blocks", action="store_true",
                        help="compile each block on its own (regional compilation) instead of "
                             "the whole model: identical blocks share one compiled graph")
    parser.add_argument("--cached", action="store_true",
                        help="storm plans without the benchmark's observer, so torch's caches "
                             "serve a later run of the same command; no predictions recorded")
    parser.add_argument("--storm-profile", default=None, metavar="SPEC",
                        help="storm's profile option (a built-in name or a storm calibrate "
                             "JSON), also the rates of the bounds (default: the present GPU's "
                             "cached calibration; cpu-test on a smoke run)")
    parser.add_argument("--smoke", action="store_true", help="CPU smoke run of the harness")
    parser.add_argument("--out", type=Path, default=Path("bench-out/streaming"))
    args = parser.parse_args(argv)
    args.methods = list(dict.fromkeys(m for m in args.methods.split(",") if m))
    args.loss_methods = list(dict.fromkeys([REFERENCE, *args.methods]))
    unknown = [m for m in args.methods if m not in BUILDERS]
    if unknown:
        parser.error(f"unknown method(s) {unknown}; known: {', '.join(BUILDERS)}")
    args.profile = [m for m in args.profile.split(",") if m]
    args.peak_history = [m for m in args.peak_history.split(",") if m]
    for option, listed in (("--profile", args.profile), ("--peak-history", args.peak_history)):
        unlisted = [m for m in listed if m not in args.methods]
        if unlisted:
            parser.error(f"{option} {','.join(unlisted)}: not among --methods")
    if args.loss_batches is not None and args.loss_batches < 1:
        parser.error(f"--loss-batches must be at least 1, got {args.loss_batches}")
    if args.host_format is not None and args.lora is None:
        parser.error("--host-format holds frozen weights: it needs --lora RANK")
    args.tokens, args.micro_batches = _ints(args.tokens), _ints(args.micro_batches)
    return args


def _shape(args, tokens: int) -> LlamaShape:
    shape = SMOKE_SHAPE if args.smoke else LLAMA_PRESETS[args.preset]
    seq = args.seq or shape.seq
    if tokens % seq:
        raise SystemExit(f"streaming: {tokens} tokens per micro-batch is not a multiple of "
                         f"the sequence length {seq}")
    return dataclasses.replace(shape, layers=args.layers or shape.layers, seq=seq,
                               batch=tokens // seq)


def main(argv=None) -> int:
    args = _parse(argv)
    os.environ.setdefault(*ALLOCATOR)
    cuda = not args.smoke
    if cuda_missing("streaming", args.smoke):
        return EXIT_NO_CUDA
    args.device = "cuda" if cuda else "cpu"
    args.resident_bytes = DEFAULT_RESIDENT_BYTES if cuda else SMOKE_RESIDENT_BYTES
    args.sync = torch.cuda.synchronize if cuda else (lambda: None)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.oom_report and cuda:
        record_until_oom(args.out / OOM_REPORT)
    if args.log is not None:
        handler = logging.FileHandler(args.log, mode="w")
        handler.setFormatter(logging.Formatter("%(relativeCreated).1f ms %(message)s"))
        logger = logging.getLogger("storm_compile")
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
    shape = _shape(args, args.loss_tokens)
    results = {"environment": {"torch": torch.__version__, "python": platform.python_version(),
                               "device": torch.cuda.get_device_name() if cuda
                               else platform.processor()},
               "shape": dataclasses.asdict(shape), "cap_gib": args.cap_gib,
               "budget": args.budget, "lora": args.lora, "host_format": args.host_format,
               "offload_format": args.offload_format, "compile_blocks": args.compile_blocks,
               "loss_batches": args.loss_batches,
               "profile": dataclasses.asdict(_profile(args, cuda)), "throughput": []}
    runs: dict[str, dict | str] = {}
    if args.reference_losses is not None:
        saved = json.loads(args.reference_losses.read_text())
        if saved["shape"] != results["shape"]:
            raise SystemExit(f"streaming: --reference-losses {args.reference_losses} ran "
                             f"another shape")
        if saved.get("loss_batches") != args.loss_batches:
            raise SystemExit(f"streaming: --reference-losses {args.reference_losses} drew its "
                             f"batches otherwise (--loss-batches {saved.get('loss_batches')})")
        runs[REFERENCE] = saved["loss"]["runs"][REFERENCE]
    for method in args.loss_methods if args.loss_steps else ():
        if method not in runs:
            runs[method] = _losses(shape, args, cuda, method)
        results["loss"] = _loss_summary(runs)
        write(args.out, results, markdown(results))
    for tokens in args.tokens:
        for method in args.methods:
            results["throughput"].extend(_throughput_rows(method, _shape(args, tokens), args,
                                                          cuda))
            write(args.out, results, markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
