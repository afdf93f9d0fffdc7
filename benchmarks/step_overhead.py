"""Storm's per-step tax where it moves nothing: storm at its default options against plain
``torch.compile`` (Inductor), in one process. At its defaults storm moves a storage only where
its cost model predicts the copies hide under compute, which steps of milliseconds leave little
room for; section 4 counts what it moved.

1. Training steps: fw+bw (no optimizer, as ``benchmarks.zoo_memory``) of a Llama-style model
   (``storm_compile.cli.models.build_llama``, 6 layers, d1024, 4 × 1024 tokens) and of a T5-style
   encoder-decoder (:class:`T5`, 6 + 6 layers, d1024, 4 × 1024 tokens each side). Both
   backends' models are built from the same seed, warmed up, then timed in alternating rounds
   (inductor, storm, inductor, storm, ...) so that drift (clocks, other processes) falls on both
   alike: wall clock per step, synchronised before and after. Median, mean, the median of the
   rounds' own storm / inductor ratios, and the median host time from the step's start to the
   return of ``backward()`` (its launches: near the step time where the step is launch-bound).
2. Host time per compiled call: a tiny Llama (so the device never holds the host back); the host
   wall time from calling the compiled forward to its return, and of ``loss.backward()``, not
   synchronised, in batches of :data:`HOST_CALLS_PER_BATCH` iterations with a synchronisation
   between batches (a full launch queue would make the host wait for the device).
3. Host time per transfer op call: every op of ``storm_compile.runtime.ops`` called directly, as a
   compiled graph calls it (its ``.default`` overload), on small tensors, in the order a graph
   calls them (offload, record, wait; prefetch, record, wait; ...), beside ``aten::add`` on the
   same tensors. ``wait_host`` and ``grad_to_host`` block until the host thread has added the
   gradient, so theirs include waiting for the copy home.
4. Where a difference in (1) comes from, from one profiled step of each model under each
   backend (``torch.profiler``; its Chrome trace is kept): kernels launched and their summed
   device time, memcpy and memset (on CUDA), aten ops (nested ones included) and storm ops
   called; the tensors the autograd graph holds for the backward after the forward (what the
   compiled forward saved: count, and bytes of their distinct storages on the device and on
   the host); and storm's transfer ops in its rewritten graphs (its observer; 0 when it moves
   nothing). The kernels launched a different number of times are listed by name.

    python -m benchmarks.step_overhead --out DIR          # cuda, bf16
    python -m benchmarks.step_overhead --smoke --out DIR  # CPU, tiny sizes, fp32: the harness

storm runs at its default options on the CPU too (no ``transfer_cpu_tensors``): it plans
nothing there. Writes ``results.md`` (tabulate) and ``results.json``, both rewritten after every
measurement, and ``trace_<model>_<backend>.json``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import gc
import json
import math
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from tabulate import tabulate
from torch import nn

from benchmarks.activation_memory import EXIT_NO_CUDA, _Device, _ratio
from benchmarks.compile_time import cuda_missing, error_line, write
from storm_compile.cli.models import LLAMA_PRESETS, LlamaShape, build_llama, swiglu_hidden
from storm_compile.compiler.backend import StormBackend
from storm_compile.config import StormConfig
from storm_compile.fx.graphs import StormGraphs
from storm_compile.fx.vocabulary import MIB, MS, US, is_transfer
from storm_compile.runtime import ops

BACKENDS = ("inductor", "storm")
REFERENCE = "inductor"
MODEL_SEED = 0
"""Seed before each model is built: both backends' copies get the same weights and batch."""

LLAMA_SHAPE = LlamaShape(d_model=1024, layers=6, hidden=swiglu_hidden(1024), heads=16,
                         kv_heads=4, vocab=32_000, seq=1024, batch=4, dtype="bfloat16")
"""A small Llama (GQA 16/4 heads as Llama 3's 4:1, Llama 2's vocabulary): a step of some
milliseconds, in which a fixed cost per step or per kernel shows."""
TINY_LLAMA = LLAMA_PRESETS["tiny"]
"""The host-call model (2 layers, d64, 2 × 32 tokens: every kernel runs in microseconds), and
model (a) of ``--smoke``, which then shares its compiled kernels (Inductor's code cache)."""


@dataclasses.dataclass(frozen=True)
class T5Shape:
    """Shape of :class:`T5`: ``layers`` blocks in each of the encoder and the decoder."""

    d_model: int
    layers: int
    heads: int
    hidden: int
    vocab: int
    source: int
    """Encoder tokens per sequence."""
    target: int
    """Decoder tokens per sequence."""
    batch: int


T5_SHAPE = T5Shape(d_model=1024, layers=6, heads=16, hidden=2816, vocab=32_128, source=1024,
                   target=1024, batch=4)
"""T5 v1.1 large's width, heads, FFN and vocabulary, with 6 + 6 layers and as many tokens per
sequence on each side as model (a)."""
SMOKE_T5 = T5Shape(d_model=64, layers=1, heads=4, hidden=176, vocab=256, source=32, target=32,
                   batch=2)
"""One block per side, at the tiny Llama's sizes: Inductor's C++ compile of each new kernel
takes seconds on the CPU, and kernels the two models share (norms, the loss) compile once."""
RELATIVE_BUCKETS = 32
RELATIVE_MAX_DISTANCE = 128
"""T5's relative position buckets: exact below half the buckets, logarithmic up to this
distance, one bucket beyond."""
T5_NORM_EPS = 1e-6

STEPS = 30
WARMUP = 3
"""Steps before timing: the first compiles, the next ones settle the allocator."""
HOST_CALLS_PER_BATCH = 20
"""Forward+backward iterations launched between synchronisations. The tiny Llama's kernels run
in microseconds, faster than the host launches them, so the launch queue stays short and a
call's time is the host's own; the synchronisations bound what a slower device could queue."""
HOST_BATCHES = 50
"""Batches per backend: a thousand timed calls of each."""
OP_CALLS_PER_BATCH = 50
"""Rounds of op calls between synchronisations (a round launches some ten copies and
kernels)."""
OP_BATCHES = 20
"""A thousand rounds."""
OP_NUMEL = 4096
"""Elements of the op tensors (16 KiB of fp32, 8 KiB of bf16): latency-bound copies, so the
figure is the call's own host cost."""
SMOKE_COUNTS = {"steps": 3, "warmup": 1, "host_batches": 2, "op_batches": 2}
"""``--smoke``: enough calls to exercise every path."""
SMOKE_THREADS = 1
"""``--smoke``'s intra-op threads (restored after): on tensors this small a team of OpenMP
threads only adds synchronisation, and where other processes keep the cores busy its spinning
threads made a 13 ms step of the tiny Llama take up to 2 s."""
KERNEL_DIFFS_SHOWN = 15
"""Kernel names listed per model in ``results.md`` (all of them are in ``results.json``)."""
TRACE_CATEGORIES = {"kernel": "kernel", "gpu_memcpy": "copy", "gpu_memset": "copy"}
"""Chrome-trace event categories of device work, and what they count as."""
OP_PREFIXES = {"aten::": "aten_ops", "storm::": "storm_ops"}
"""Host op events (category ``cpu_op``) counted by namespace."""


# --- T5 ----------------------------------------------------------------------------------------

def relative_buckets(query: int, key: int, bidirectional: bool,
                     device: torch.device) -> torch.Tensor:
    """T5's bucket of each key position relative to each query position, ``(query, key)``:
    a bucket per distance below half the buckets (half of them for each direction when
    ``bidirectional``; the decoder sees only the past), logarithmic up to
    :data:`RELATIVE_MAX_DISTANCE`, the last bucket beyond."""
    relative = (torch.arange(key, device=device)[None, :]
                - torch.arange(query, device=device)[:, None])
    buckets, offset = RELATIVE_BUCKETS, 0
    if bidirectional:
        buckets //= 2
        offset = (relative > 0).long() * buckets
        distance = relative.abs()
    else:
        distance = (-relative).clamp_min(0)
    exact = buckets // 2
    logarithmic = exact + (torch.log(distance.clamp_min(exact).float() / exact)
                           / math.log(RELATIVE_MAX_DISTANCE / exact)
                           * (buckets - exact)).long()
    return offset + torch.where(distance < exact, distance, logarithmic.clamp_max(buckets - 1))


class T5Attention(nn.Module):
    """Hugging Face's T5 attention: no biases, scores unscaled (T5 folds the scale into its
    initialisation) plus the position bias, softmax in fp32."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d_model, d_model, bias=False)
                                          for _ in range(4))

    def forward(self, x: torch.Tensor, memory: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        batch, seq, d_model = x.shape
        q = self.q(x).view(batch, seq, self.heads, -1).transpose(1, 2)
        k = self.k(memory).view(batch, memory.shape[1], self.heads, -1).transpose(1, 2)
        v = self.v(memory).view(batch, memory.shape[1], self.heads, -1).transpose(1, 2)
        scores = q @ k.transpose(-2, -1)
        if bias is not None:
            scores = scores + bias
        weights = scores.float().softmax(dim=-1).type_as(scores)
        return self.o((weights @ v).transpose(1, 2).reshape(batch, seq, d_model))


class T5Block(nn.Module):
    """Pre-norm block: self-attention, cross-attention on the encoder's output (decoder only),
    gated-GELU MLP (T5 v1.1), each behind an RMSNorm, no dropout."""

    def __init__(self, shape: T5Shape, cross: bool) -> None:
        super().__init__()
        self.self_norm = nn.RMSNorm(shape.d_model, eps=T5_NORM_EPS)
        self.self_attn = T5Attention(shape.d_model, shape.heads)
        if cross:
            self.cross_norm = nn.RMSNorm(shape.d_model, eps=T5_NORM_EPS)
            self.cross_attn = T5Attention(shape.d_model, shape.heads)
        self.mlp_norm = nn.RMSNorm(shape.d_model, eps=T5_NORM_EPS)
        self.gate = nn.Linear(shape.d_model, shape.hidden, bias=False)
        self.up = nn.Linear(shape.d_model, shape.hidden, bias=False)
        self.down = nn.Linear(shape.hidden, shape.d_model, bias=False)

    def forward(self, x: torch.Tensor, bias: torch.Tensor,
                memory: torch.Tensor | None) -> torch.Tensor:
        h = self.self_norm(x)
        x = x + self.self_attn(h, h, bias)
        if memory is not None:
            x = x + self.cross_attn(self.cross_norm(x), memory, None)
        h = self.mlp_norm(x)
        return x + self.down(F.gelu(self.gate(h), approximate="tanh") * self.up(h))


class T5Stack(nn.Module):
    """The encoder (bidirectional) or the decoder (causal, with cross-attention): blocks sharing
    one relative position bias, learned by the stack, then a final RMSNorm."""

    def __init__(self, shape: T5Shape, decoder: bool) -> None:
        super().__init__()
        self.decoder = decoder
        self.relative = nn.Embedding(RELATIVE_BUCKETS, shape.heads)
        self.blocks = nn.ModuleList(T5Block(shape, cross=decoder) for _ in range(shape.layers))
        self.norm = nn.RMSNorm(shape.d_model, eps=T5_NORM_EPS)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        seq = x.shape[1]
        buckets = relative_buckets(seq, seq, not self.decoder, x.device)
        bias = self.relative(buckets).permute(2, 0, 1).unsqueeze(0)
        if self.decoder:
            bias = bias + torch.full((seq, seq), float("-inf"), device=x.device,
                                     dtype=bias.dtype).triu(1)
        for block in self.blocks:
            x = block(x, bias, memory)
        return self.norm(x)


class T5(nn.Module):
    """A T5 v1.1-style encoder-decoder: shared token embedding, encoder, decoder fed the targets
    shifted right (start token 0), untied LM head; ``forward(source, target)`` returns the
    cross-entropy (in fp32) of the decoder's predictions of ``target``."""

    def __init__(self, shape: T5Shape) -> None:
        super().__init__()
        self.embed = nn.Embedding(shape.vocab, shape.d_model)
        self.encoder = T5Stack(shape, decoder=False)
        self.decoder = T5Stack(shape, decoder=True)
        self.lm_head = nn.Linear(shape.d_model, shape.vocab, bias=False)

    def forward(self, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        memory = self.encoder(self.embed(source))
        x = self.decoder(self.embed(F.pad(target[:, :-1], (1, 0))), memory)
        return F.cross_entropy(self.lm_head(x).flatten(0, 1).float(), target.flatten())


def build_t5(shape: T5Shape, device: str, dtype: torch.dtype
             ) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The model, built on the CPU in fp32 and moved (the same weights on every device and
    dtype, as the zoo does), and a batch ``(source, target)`` of random token ids."""
    model = T5(shape).to(device, dtype)
    source = torch.randint(shape.vocab, (shape.batch, shape.source))
    target = torch.randint(shape.vocab, (shape.batch, shape.target))
    return model, (source.to(device), target.to(device))


# --- compiling and stepping --------------------------------------------------------------------

@dataclasses.dataclass
class Compiled:
    """One backend's compiled copy of a model, its batch (the model returns its loss) and, for
    storm, the transfer ops in each graph it rewrote."""

    backend: str
    model: nn.Module
    run: Callable[..., torch.Tensor]
    inputs: tuple[torch.Tensor, ...]
    transfers: list[int]

    def zero_grad(self) -> None:
        for p in self.model.parameters():
            p.grad = None

    def step(self) -> None:
        """One fw+bw step, its gradients fresh (``zero_grad(set_to_none=True)``)."""
        self.zero_grad()
        self.run(*self.inputs).backward()


def compile_model(backend: str, build: Callable[[], tuple[nn.Module, tuple]]) -> Compiled:
    """A fresh model from :data:`MODEL_SEED`, compiled by ``backend``: plain ``torch.compile``,
    or storm at its default options with an observer counting its transfer ops (counted as
    storm hands the graphs over: Inductor rewrites them in place as it compiles)."""
    torch.manual_seed(MODEL_SEED)
    model, inputs = build()
    transfers: list[int] = []
    if backend == REFERENCE:
        run = torch.compile(model)
    else:
        def observe(graphs: StormGraphs) -> None:
            transfers.append(sum(is_transfer(n) for gm in (graphs.forward, graphs.backward)
                                 for n in gm.graph.nodes))

        run = torch.compile(model, backend=StormBackend(StormConfig.from_options(),
                                                        observer=observe))
    return Compiled(backend, model, run, inputs, transfers)


def timed_rounds(compiled: list[Compiled], dev: _Device, rounds: int
                 ) -> dict[str, dict[str, list[float]]]:
    """Milliseconds of each backend's steps, one step of each per round, in turn: ``step`` to
    the synchronisation after it, ``host`` to the return of ``backward()`` (the launches)."""
    times = {c.backend: {"step": [], "host": []} for c in compiled}
    for _ in range(rounds):
        for c in compiled:
            dev.sync()
            begin = time.perf_counter()
            c.step()
            launched = time.perf_counter()
            dev.sync()
            times[c.backend]["host"].append((launched - begin) * MS)
            times[c.backend]["step"].append((time.perf_counter() - begin) * MS)
    return times


def saved_for_backward(loss: torch.Tensor, device: torch.device) -> dict:
    """Tensors the autograd graph behind ``loss`` holds for the backward, and the MiB of their
    distinct storages on ``device`` and on the host (offloaded). A compiled graph's node is its
    autograd.Function's context: it saves with ``save_for_backward``, and newer torch keeps the
    tensors it need not version-check beside them in ``_tensors_no_vc_check``."""
    seen, pending, count, storages = set(), [loss.grad_fn], 0, {}
    while pending:
        node = pending.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        tensors = (*getattr(node, "saved_tensors", ()),
                   *getattr(node, "_tensors_no_vc_check", ()))
        count += len(tensors)
        for t in tensors:
            storage = t.untyped_storage()
            storages[(t.device, storage.data_ptr())] = storage.nbytes()
        pending.extend(next_node for next_node, _ in node.next_functions)
    on_device = sum(n for (where, _), n in storages.items() if where == device)
    return {"saved_tensors": count, "saved_device_mib": on_device / MIB,
            "saved_host_mib": (sum(storages.values()) - on_device) / MIB}


def kernel_name(name: str) -> str:
    """A kernel's name without its return type, namespaces' anonymity, template arguments and
    parameters, or Inductor's index of the kernel in its graph (``triton_poi_fused_add_3``):
    the same kernel reads the same under both backends."""
    name = name.removeprefix("void ").replace("(anonymous namespace)::", "")
    name = re.split(r"[<(]", name, maxsplit=1)[0]
    return re.sub(r"_\d+$", "", name) if name.startswith("triton_") else name


def profiled_step(c: Compiled, dev: _Device, trace: Path) -> dict:
    """Launch counts of one step under ``torch.profiler``, whose Chrome trace goes to
    ``trace``: on CUDA kernels (with their summed device time, and both by
    :func:`kernel_name`) and memcpy and memset (None on the CPU); host aten and storm ops."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if dev.cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        c.step()
        dev.sync()
    prof.export_chrome_trace(str(trace))
    kernels: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    counts = {"copies": 0, **{key: 0 for key in OP_PREFIXES.values()}}
    for event in json.loads(trace.read_text())["traceEvents"]:
        kind = TRACE_CATEGORIES.get(event.get("cat"))
        if kind == "kernel":
            entry = kernels[kernel_name(event["name"])]
            entry[0] += 1
            entry[1] += event["dur"]
        elif kind == "copy":
            counts["copies"] += 1
        elif event.get("cat") == "cpu_op":
            for prefix, key in OP_PREFIXES.items():
                if event["name"].startswith(prefix):
                    counts[key] += 1
    if not dev.cuda:
        return {**counts, "kernels": None, "kernel_ms": None, "copies": None,
                "kernel_names": None, "trace": str(trace)}
    return {**counts, "kernels": sum(n for n, _ in kernels.values()),
            "kernel_ms": sum(us for _, us in kernels.values()) * MS / US,
            "kernel_names": {name: {"count": n, "us": us} for name, (n, us) in kernels.items()},
            "trace": str(trace)}


def _summary(values: list[float]) -> dict:
    """``median`` and ``mean`` of ``values``."""
    return {"median": statistics.median(values), "mean": statistics.fmean(values)}


def _figures(name: str, c: Compiled, times: dict[str, list[float]], dev: _Device,
             out_dir: Path) -> dict:
    """One backend's row of a model: its step and host times, what its forward saves, what a
    step launches."""
    c.zero_grad()
    device = torch.device("cuda", torch.cuda.current_device()) if dev.cuda \
        else torch.device("cpu")
    return {"model": name, "backend": c.backend, "steps": len(times["step"]),
            **{f"{key}_ms": value for key, value in _summary(times["step"]).items()},
            "host_median_ms": statistics.median(times["host"]),
            "times_ms": times["step"],
            **saved_for_backward(c.run(*c.inputs), device),
            "graph_transfers": sum(c.transfers) if c.backend != REFERENCE else None,
            **profiled_step(c, dev, out_dir / f"trace_{name}_{c.backend}.json")}


def measure_model(name: str, build: Callable[[], tuple[nn.Module, tuple]], dev: _Device,
                  args, out_dir: Path) -> list[dict]:
    """Section 1 and 4 for one model: a row per backend; a backend that fails to compile or run
    its warm-up gets its error in its row and the other is still measured."""
    compiled, rows = [], {}
    for backend in BACKENDS:
        try:
            c = compile_model(backend, build)
            for _ in range(args.warmup):
                c.step()
            compiled.append(c)
        except Exception as error:  # reported in the backend's row; the run goes on
            rows[backend] = {"model": name, "backend": backend, "error": error_line(error)}
    try:
        times = timed_rounds(compiled, dev, args.steps)
        for c in compiled:
            rows[c.backend] = _figures(name, c, times[c.backend], dev, out_dir)
    except Exception as error:  # reported in the rows not yet measured; the run goes on
        for c in compiled:
            rows.setdefault(c.backend, {"model": name, "backend": c.backend,
                                        "error": error_line(error)})
    for backend in BACKENDS:
        row = rows[backend]
        print(f"[{name}] {backend}: "
              f"{row.get('error') or '%.3f ms median' % row['median_ms']}", flush=True)
    return [rows[backend] for backend in BACKENDS]


def host_call_times(shape: LlamaShape, dev: _Device, args) -> list[dict]:
    """Section 2: host microseconds from calling the compiled forward of a tiny Llama to its
    return, and of its backward, per backend, the backends alternating batch by batch."""
    device = "cuda" if dev.cuda else "cpu"
    compiled = [compile_model(b, lambda: build_llama(shape, device)) for b in BACKENDS]
    for c in compiled:
        for _ in range(args.warmup):
            c.step()
    forward: dict[str, list[float]] = {c.backend: [] for c in compiled}
    backward: dict[str, list[float]] = {c.backend: [] for c in compiled}
    for _ in range(args.host_batches):
        for c in compiled:
            dev.sync()
            for _ in range(HOST_CALLS_PER_BATCH):
                c.zero_grad()
                begin = time.perf_counter()
                loss = c.run(*c.inputs)
                launched = time.perf_counter()
                loss.backward()
                forward[c.backend].append((launched - begin) * US)
                backward[c.backend].append((time.perf_counter() - launched) * US)
            dev.sync()
    rows = []
    for c in compiled:
        fw, bw = _summary(forward[c.backend]), _summary(backward[c.backend])
        rows.append({"backend": c.backend, "calls": len(forward[c.backend]),
                     "forward_median_us": fw["median"], "forward_mean_us": fw["mean"],
                     "backward_median_us": bw["median"], "backward_mean_us": bw["mean"]})
        print(f"[host call] {c.backend}: forward {fw['mean']:.1f} µs, backward "
              f"{bw['mean']:.1f} µs", flush=True)
    return rows


class _OpTimer:
    """Calls an op and keeps the host microseconds of the call, by the op's name."""

    def __init__(self) -> None:
        self.us: dict[str, list[float]] = collections.defaultdict(list)

    def __call__(self, op: torch._ops.OpOverload, *args):
        begin = time.perf_counter()
        out = op(*args)
        self.us[op.name()].append((time.perf_counter() - begin) * US)
        return out


def _op_round(call: _OpTimer, x: torch.Tensor, g: torch.Tensor, w: torch.Tensor,
              device: torch.device, limit: int) -> None:
    """Each op once, chained as storm's graphs chain them (``storm_compile.runtime.ops``): an
    activation home and back, a gradient home into a host weight's ``.grad``, a streamed
    weight fetched and read resident, and a gradient sent home the eager way."""
    call(torch.ops.aten.add.Tensor, x, x)
    host = call(ops.wait_event, call(ops.record_event, call(ops.offload, x, limit)), x)
    call(ops.wait_event, call(ops.record_event, call(ops.prefetch, host, device)), host)
    sent = call(ops.wait_event, call(ops.record_event, call(ops.send_grad, g, limit)), g)
    call(ops.wait_host, [call(ops.accumulate_grad, sent, w)])
    call(ops.fetch_weight, w, device)
    call(ops.resident_weight, w, device)
    call(ops.grad_to_host, g, w)


def op_call_times(dev: _Device, dtype: torch.dtype, args) -> list[dict]:
    """Section 3: host microseconds per call of each transfer op and of ``aten::add``, on
    :data:`OP_NUMEL`-element tensors: ``x`` and ``g`` on the device, ``w`` a (pinned, on CUDA)
    host weight; storm's default pinned-memory limit."""
    device = torch.device("cuda" if dev.cuda else "cpu")
    x = torch.randn(OP_NUMEL, device=device, dtype=dtype)
    g = torch.randn(OP_NUMEL, device=device, dtype=dtype)
    w = torch.randn(OP_NUMEL, dtype=dtype, pin_memory=dev.cuda)
    limit = StormConfig.from_options().host_memory_limit
    call = _OpTimer()
    _op_round(call, x, g, w, device, limit)
    call.us.clear()
    for _ in range(args.op_batches):
        dev.sync()
        for _ in range(OP_CALLS_PER_BATCH):
            _op_round(call, x, g, w, device, limit)
        dev.sync()
    rows = [{"op": name, "calls": len(us), **{f"{key}_us": value
                                              for key, value in _summary(us).items()}}
            for name, us in call.us.items()]
    print("[ops] " + ", ".join(f"{r['op']} {r['mean_us']:.1f} µs" for r in rows), flush=True)
    return rows


# --- report ------------------------------------------------------------------------------------

def _paired_ratio(row: dict, ref: dict) -> float | None:
    """Median over rounds of the round's storm / inductor step time."""
    if "times_ms" not in row or "times_ms" not in ref or row is ref:
        return None
    return statistics.median(a / b for a, b in zip(row["times_ms"], ref["times_ms"]))


def _kernel_differences(rows: list[dict]) -> list[str]:
    """Per model, the kernels one backend launches a different number of times per step than
    the other, the largest difference in device time first."""
    lines = []
    by_model: dict[str, dict[str, dict]] = collections.defaultdict(dict)
    for r in rows:
        if r.get("kernel_names") is not None:
            by_model[r["model"]][r["backend"]] = r["kernel_names"]
    empty = {"count": 0, "us": 0.0}
    for model, names in by_model.items():
        if len(names) < len(BACKENDS):
            continue
        ref, ours = names[REFERENCE], names["storm"]
        differing = sorted((k for k in ref.keys() | ours.keys()
                            if ref.get(k, empty)["count"] != ours.get(k, empty)["count"]),
                           key=lambda k: -abs(ref.get(k, empty)["us"] - ours.get(k, empty)["us"]))
        lines.append(f"\n{model}: {len(differing)} kernels launched a different number of times "
                     f"per step (inductor → storm: launches, device µs)\n")
        lines += [f"- `{k}`: {ref.get(k, empty)['count']} → {ours.get(k, empty)['count']}, "
                  f"{ref.get(k, empty)['us']:.0f} → {ours.get(k, empty)['us']:.0f} µs"
                  for k in differing[:KERNEL_DIFFS_SHOWN]]
    return lines


def _table(rows: list[dict], floatfmt: str = ".3g") -> str:
    return tabulate(rows, headers="keys", tablefmt="github", floatfmt=floatfmt,
                    missingval="") + "\n"


def _steps_table(rows: list[dict]) -> str:
    references = {r["model"]: r for r in rows if r["backend"] == REFERENCE}
    table = []
    for r in rows:
        ref = references.get(r["model"], {})
        if "error" in r:
            table.append({"model": r["model"], "backend": r["backend"], "error": r["error"]})
            continue
        table.append({
            "model": r["model"], "backend": r["backend"],
            "median ms": r["median_ms"], "mean ms": r["mean_ms"],
            "median ×": _ratio(r["median_ms"], ref.get("median_ms")),
            "mean ×": _ratio(r["mean_ms"], ref.get("mean_ms")),
            "paired ×": _paired_ratio(r, ref), "host ms": r["host_median_ms"],
            "kernels": r["kernels"], "kernel ms": r["kernel_ms"],
            "memcpy+memset": r["copies"], "aten ops": r["aten_ops"],
            "storm ops": r["storm_ops"], "saved tensors": r["saved_tensors"],
            "saved MiB device": r["saved_device_mib"], "saved MiB host": r["saved_host_mib"],
            "transfers in graphs": r["graph_transfers"],
        })
    return ("Training steps (fw+bw; × inductor; host ms: to the return of backward(); "
            "launches and saved tensors per step):\n\n"
            + _table(table, ".4g") + "\n".join(_kernel_differences(rows)))


def _host_calls_table(rows: list[dict]) -> str:
    ref = next((r for r in rows if r.get("backend") == REFERENCE), {})
    table = [r if "error" in r else {
        "backend": r["backend"], "calls": r["calls"],
        "forward µs median": r["forward_median_us"], "forward µs mean": r["forward_mean_us"],
        "forward ×": _ratio(r["forward_mean_us"], ref.get("forward_mean_us")),
        "backward µs median": r["backward_median_us"], "backward µs mean": r["backward_mean_us"],
        "backward ×": _ratio(r["backward_mean_us"], ref.get("backward_mean_us")),
    } for r in rows]
    return ("Host time per compiled call (tiny Llama, not synchronised; × inductor of the "
            "means):\n\n" + _table(table))


def _ops_table(rows: list[dict]) -> str:
    add = next((r for r in rows if r.get("op", "").startswith("aten::add")), {})
    table = [r if "error" in r else {
        "op": r["op"], "calls": r["calls"], "median µs": r["median_us"], "mean µs": r["mean_us"],
        "mean × aten::add": _ratio(r["mean_us"], add.get("mean_us")),
    } for r in rows]
    return f"Host time per op call ({OP_NUMEL} elements):\n\n" + _table(table)


def markdown(results: dict) -> str:
    parts = [table(results[key]) for key, table in (("steps", _steps_table),
                                                      ("host_calls", _host_calls_table),
                                                      ("ops", _ops_table)) if results[key]]
    return "\n".join(parts)


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS, help="timed steps per backend")
    parser.add_argument("--warmup", type=int, default=WARMUP)
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, tiny sizes, fp32, a few steps and calls: the harness itself")
    parser.add_argument("--out", type=Path, default=Path("bench-out/step-overhead"))
    args = parser.parse_args(argv)
    args.host_batches, args.op_batches = HOST_BATCHES, OP_BATCHES
    if args.smoke:
        for name, value in SMOKE_COUNTS.items():
            setattr(args, name, value)
    return args


def _fresh(dev: _Device) -> None:
    """Before each model: Dynamo's caches, the last model's memory and its cached blocks gone,
    so neither Dynamo's recompilation of a known frame nor the allocator's state carries over."""
    torch._dynamo.reset()
    gc.collect()
    if dev.cuda:
        torch.cuda.empty_cache()


def _section(measure: Callable[[], list[dict]]) -> list[dict]:
    """A section's rows, or one row with its error (the run goes on)."""
    try:
        return measure()
    except Exception as error:  # reported in the section's table; the run goes on
        print(f"failed: {error_line(error)}", flush=True)
        return [{"error": error_line(error)}]


@contextlib.contextmanager
def smoke_threads(smoke: bool) -> Iterator[None]:
    """:data:`SMOKE_THREADS` intra-op threads inside, for a ``--smoke`` run; restored after."""
    threads = torch.get_num_threads()
    if smoke:
        torch.set_num_threads(SMOKE_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def run_benchmark(benchmark: str, args: argparse.Namespace,
                  run: Callable[[argparse.Namespace], None]) -> int:
    """A benchmark's ``main`` once its arguments are parsed: :data:`EXIT_NO_CUDA` where it
    needs CUDA and has none (``cuda_missing``), else ``run(args)`` under :func:`smoke_threads`
    and 0."""
    if cuda_missing(benchmark, args.smoke):
        return EXIT_NO_CUDA
    with smoke_threads(args.smoke):
        run(args)
    return 0


def main(argv=None) -> int:
    return run_benchmark("step_overhead", _parse(argv), _run)


def _run(args) -> None:
    dev = _Device("cpu" if args.smoke else "cuda")
    dtype = "float32" if args.smoke else "bfloat16"
    device = "cuda" if dev.cuda else "cpu"
    llama = TINY_LLAMA if args.smoke else LLAMA_SHAPE
    t5 = SMOKE_T5 if args.smoke else T5_SHAPE
    host_llama = dataclasses.replace(TINY_LLAMA, dtype=dtype)
    models = {
        f"llama-L{llama.layers}-d{llama.d_model}": lambda: build_llama(llama, device),
        f"t5-L{t5.layers}-{t5.layers}-d{t5.d_model}":
            lambda: build_t5(t5, device, getattr(torch, dtype)),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    environment = {"torch": torch.__version__, "python": platform.python_version(),
                   "device": torch.cuda.get_device_name() if dev.cuda else platform.processor(),
                   "dtype": dtype, "llama": dataclasses.asdict(llama),
                   "t5": dataclasses.asdict(t5), "host_call_llama": dataclasses.asdict(host_llama),
                   "steps": args.steps, "warmup": args.warmup, "threads": torch.get_num_threads()}
    results = {"environment": environment, "steps": [], "host_calls": [], "ops": []}
    for name, build in models.items():
        _fresh(dev)
        results["steps"] += measure_model(name, build, dev, args, args.out)
        write(args.out, results, markdown(results))
    _fresh(dev)
    results["host_calls"] = _section(lambda: host_call_times(host_llama, dev, args))
    write(args.out, results, markdown(results))
    results["ops"] = _section(lambda: op_call_times(dev, getattr(torch, dtype), args))
    print(write(args.out, results, markdown(results)))


if __name__ == "__main__":
    sys.exit(main())
