"""The Hugging Face ``Trainer`` with storm against Inductor and the Trainer's own memory savers,
and storm on a small LoRA step: one GPU, one process.

A. ``transformers.Trainer`` trains a ``LlamaForCausalLM`` built from a config with random
   weights (:data:`TRAINER_LLAMA`: ≈1.0B parameters, bf16) on 2 samples of 2048 random tokens
   per step (labels = input ids; one dataset, in one order, for every variant), AdamW at
   :data:`LEARNING_RATE`, the Trainer's default gradient clipping, a log line every step.
   Variants (``--variants``; each model is compiled in place before the Trainer is built, so
   the Trainer sees the same module whatever the backend):

   - ``inductor``: ``model.compile()``; ``storm``: ``model.compile(backend=storm())``;
     ``storm-<x>``: ``storm(memory_budget=x)`` for x in :data:`STORM_BUDGETS`;
   - ``gc``: ``TrainingArguments(gradient_checkpointing=True)``, compiled by Inductor;
   - ``gc-offload``: the same with ``gradient_checkpointing_kwargs={"offload": True}``, which
     runs each checkpointed layer under ``torch.autograd.graph.save_on_cpu(pin_memory=True)``
     (where the installed transformers' checkpointing takes no ``offload``, the row says so);
     a checkpointing variant that fails with Inductor runs again in eager mode, its note saying
     so;
   - ``inductor-lora``: peft LoRA on every projection of the resident model, Inductor;
     ``storm-streamed-lora``: the same adapters on a base whose weights are streamed from
     pinned host memory (``stream_parameters``), storm under :data:`STREAMED_LORA_BUDGET`;
   - ``storm-streamed``: every parameter trained and streamed, storm under the same budget, the
     Trainer's own AdamW and clipping; ``storm-streamed-overlapped``: the same, the Trainer
     handed :func:`overlapped_adamw` with ``max_grad_norm=0`` (docs/trainers.md's fast loop);
     ``storm-streamed-plain``: the same model and optimizer in a plain loop
     (:func:`plain_loop`), the speed the fast loop is held against (:data:`FAST_LOOP`);
     ``storm-streamed-plain-autocast``: that loop with its forward under bfloat16 autocast, as
     the Trainer runs it; ``storm-streamed-overlapped-bf16-model``: the fast loop with
     ``bf16=False``, so the Trainer runs the bfloat16 model without autocast;
     ``storm-resident-overlapped`` and ``storm-resident-plain``: the same two loops over the
     model resident under ``storm(memory_budget=0.5)``, what the Trainer itself costs a step.

   Per variant: each optimizer step's wall time (forward, backward, clipping, optimizer step),
   from a ``TrainerCallback``'s ``on_step_begin`` to its ``on_step_end``, synchronised at both;
   the median after the warm-up steps (:data:`WARMUP`); the first step's seconds (the compile);
   peak allocated and reserved device memory over the steps after the warm-up, the allocated
   peak also per phase of the step (:data:`PHASES`), and the most allocated as a step begins;
   with ``--peak-history``, what is live at the peak of the variant's last step (the allocator's
   recorded history, grouped by the frames that allocated it); every step's
   loss from the Trainer's log history; the graphs Dynamo compiled and its graph breaks.
   ``inductor`` and ``storm`` run ``--loss-steps`` steps, the others ``--steps``. Derived: step
   and peak × ``inductor``; for storm rows the largest |Δloss| against their reference
   (``inductor``; ``inductor-lora`` for the LoRA row; none for the rows that clip nothing)
   over the steps both ran. A summary takes, at ``gc``'s peak and at ``gc-offload``'s, the
   fastest ``storm-<x>`` row whose peak is at most that peak and divides its step by theirs
   (the goals, :data:`GOALS`, are reported, not asserted), says whether storm's peak is
   non-increasing as its budget falls, and divides the Trainer's fast loop over streamed
   weights by the plain loop's step, also after taking away the Trainer's own cost a step (the
   resident pair's difference, where it ran). Each step is the mean of its variant's rows where
   ``--variants`` names it more than once, as in ``--variants storm-streamed-plain,
   storm-streamed-overlapped,storm-streamed-plain,storm-streamed-overlapped``: alternated, so
   that drift falls on both.
B. A plain loop (no Trainer): peft LoRA on every projection of a 2-layer d1024
   ``LlamaForCausalLM`` (:data:`LORA_STEP_LLAMA`), 4 × 1024 tokens, bf16, AdamW over the
   adapters. Variants (``--lora-variants``): ``inductor``, ``storm`` (defaults), ``storm-0.5``
   and ``inductor-amb-0.5`` (Inductor with ``torch._functorch.config.activation_memory_budget``
   at 0.5, patched around the compile and the warm-up steps, as the partitioner runs at the
   first call). Each variant is compiled and warmed up, one step's peak above the memory
   allocated before it is taken, then the steps are timed in alternating rounds
   (``benchmarks.step_overhead.timed_rounds``) so that drift falls on every variant alike:
   median step, × inductor, and the median of the rounds' own ratios.

    python -m benchmarks.trainer --out DIR          # cuda, bf16
    python -m benchmarks.trainer --smoke --out DIR  # CPU, tiny sizes, fp32: the harness

Every model, adapter set and dataset comes from :data:`SEED` (nothing is downloaded). Before
each variant Dynamo is reset and the device's cached blocks and peak statistics are cleared.
Inductor's caches go to ``TORCHINDUCTOR_CACHE_DIR`` where it is set. The caching allocator runs
with expandable segments unless ``PYTORCH_CUDA_ALLOC_CONF`` is set
(``benchmarks.streaming.ALLOCATOR``: the streamed row needs them, so every row has them).
``--smoke`` runs storm with ``transfer_cpu_tensors`` and its graphs without code generation,
the ``inductor`` rows with :data:`SMOKE_COMPILER`, and skips ``gc-offload`` (its pinned memory
needs an accelerator). Writes ``results.md`` (tabulate) and ``results.json`` after every
variant, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import inspect
import os
import platform
import statistics
import sys
import textwrap
import time
from pathlib import Path

import accelerate
import peft
import torch
import transformers
from tabulate import tabulate
from torch import nn
from torch._dynamo.utils import counters
from transformers import (LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback,
                          TrainingArguments)

from benchmarks.activation_memory import CPU_STORM_OPTIONS, _Device, _ratio
from benchmarks.compile_time import error_line, write
from benchmarks.peak_history import HISTORY_ENTRIES, peak_owners
from benchmarks.step_overhead import _paired_ratio, run_benchmark, timed_rounds
from benchmarks.streaming import ALLOCATOR, SMOKE_RESIDENT_BYTES
from storm_compile import overlap_optimizer, storm
from storm_compile.fx.vocabulary import GIB, MS
from storm_compile.weights.streaming import DEFAULT_RESIDENT_BYTES, stream_parameters

TRAINER_LLAMA = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 8,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128_256,
                 "tie_word_embeddings": False, "max_position_embeddings": 4096}
"""Llama 3.2 1B's width, MLP, heads and vocabulary with 8 of its 16 layers and an untied head:
≈1.0B parameters, whose step fits the device whole, so every saver can be set beside
Inductor."""
LORA_STEP_LLAMA = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 2,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "vocab_size": 32_000,
                   "max_position_embeddings": 1024}
"""Part B's model: a step of milliseconds, where a fixed cost per step shows."""
SMOKE_LLAMA = {"hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
               "tie_word_embeddings": False, "max_position_embeddings": 64}
"""Both parts' model under ``--smoke``."""


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What a part trains: the ``LlamaConfig`` fields, tokens per sample, samples per step, and
    the dtype of the weights."""

    llama: dict
    seq: int
    batch: int
    dtype: str


SIZES = {"trainer": Sizes(TRAINER_LLAMA, seq=2048, batch=2, dtype="bfloat16"),
         "lora_step": Sizes(LORA_STEP_LLAMA, seq=1024, batch=4, dtype="bfloat16")}
SMOKE_SIZES = {"trainer": Sizes(SMOKE_LLAMA, seq=32, batch=2, dtype="float32"),
               "lora_step": Sizes(SMOKE_LLAMA, seq=32, batch=4, dtype="float32")}

SEED = 0
"""Seed of every model, adapter set and dataset: all variants train the same weights on the
same tokens in the same order."""
LEARNING_RATE = 1e-4
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""Every projection of a Llama block, as LoRA recipes commonly adapt them."""
LORA_RANK = 16
LORA_ALPHA = 32
STORM_BUDGETS = (0.7, 0.5, 0.3, 0.15, 0.05)
"""storm's ``memory_budget`` fractions in part A, falling: the sweep the summary reads."""
STREAMED_LORA_BUDGET = 0.5
"""storm's budget of the streamed rows: a fraction bounds activations only and keeps no
streamed weight on the device, so every base weight crosses the link at every step. The
resident pair runs under it too, so that the two pairs differ only in where weights live."""
GOALS = {"gc": 0.95, "gc-offload": 0.75}
"""The issue's goals: storm's step at most this fraction of the saver's, at the saver's peak."""
CHECKPOINTING = {"gradient_checkpointing": True}
OFFLOAD = {**CHECKPOINTING, "gradient_checkpointing_kwargs": {"offload": True}}
"""The ``TrainingArguments`` of ``gc`` and ``gc-offload``."""
STEPS = 12
LOSS_STEPS = 50
"""Steps of the rows whose losses are compared over a run (``inductor``, ``storm``)."""
WARMUP = 3
"""Steps before timing: the first compiles, the next ones settle the allocator and make the
optimizer's state."""
LORA_STEP_ROUNDS = 30
PHASES = ("forward-backward", "optimizer")
"""The phases of a Trainer step whose peaks are taken apart: up to ``on_pre_optimizer_step``
(forward, backward, clipping), then the optimizer step and ``zero_grad``."""
SMOKE_COUNTS = {"steps": 3, "loss_steps": 3, "warmup": 1, "rounds": 3}
"""``--smoke``: enough steps to time one after the warm-up."""
SMOKE_COMPILER = "aot_eager_decomp_partition"
"""The ``inductor`` rows' backend under ``--smoke``: AOTAutograd with Inductor's decompositions
and min-cut partitioner (which reads ``activation_memory_budget``), without code generation,
whose C++ compile takes some 45 s per graph on a 2-core CPU. storm runs its graphs the same
way there (``inner="eager"``)."""
SMOKE_STORM_OPTIONS = {**CPU_STORM_OPTIONS, "inner": "eager"}
TEXT_WIDTH = 100
"""Width of the prose and notes of ``results.md``: its lines stay readable in a terminal."""


@dataclasses.dataclass(frozen=True)
class Variant:
    """One Trainer run: the backend that compiles the model in place (``"inductor"`` or
    ``"storm"``, with storm's ``budget``), the ``TrainingArguments`` it adds, LoRA adapters,
    a streamed base, whether it runs the loss comparison's steps, and what the row's note says
    of it."""

    name: str
    backend: str
    note: str
    budget: float | None = None
    training: dict = dataclasses.field(default_factory=dict)
    lora: bool = False
    streamed: bool = False
    loss_run: bool = False
    overlapped: bool = False
    """The Trainer is handed :func:`overlapped_adamw` and clips nothing (``max_grad_norm=0``)."""
    plain: bool = False
    """A plain loop over the same model and :func:`overlapped_adamw`, instead of the Trainer."""
    autocast: bool = False
    """The plain loop's forward under bfloat16 autocast, as the Trainer runs it with
    ``bf16=True`` (on CUDA)."""

    @property
    def reference(self) -> str | None:
        """The row whose losses this one's are compared with: None for the rows that clip
        nothing or decay no learning rate, unlike every Trainer row with its defaults."""
        if self.overlapped or self.plain:
            return None
        return "inductor-lora" if self.lora else "inductor"


VARIANTS = (
    Variant("inductor", "inductor", "model.compile() in place", loss_run=True),
    Variant("storm", "storm", "model.compile(backend=storm()) in place", loss_run=True),
    *(Variant(f"storm-{b}", "storm", f"storm(memory_budget={b})", budget=b)
      for b in STORM_BUDGETS),
    Variant("gc", "inductor", "TrainingArguments(gradient_checkpointing=True), Inductor in place",
            training=CHECKPOINTING),
    Variant("gc-offload", "inductor",
            'TrainingArguments(gradient_checkpointing=True, gradient_checkpointing_kwargs='
            '{"offload": True}): each checkpointed layer under torch.autograd.graph.'
            'save_on_cpu(pin_memory=True), Inductor in place', training=OFFLOAD),
    Variant("inductor-lora", "inductor",
            f"peft LoRA r={LORA_RANK} on {', '.join(LORA_TARGETS)}; base resident", lora=True),
    Variant("storm-streamed-lora", "storm",
            f"the same adapters; base streamed (stream_parameters), "
            f"storm(memory_budget={STREAMED_LORA_BUDGET})",
            budget=STREAMED_LORA_BUDGET, lora=True, streamed=True),
    Variant("storm-streamed", "storm",
            f"every parameter trained, streamed (stream_parameters), "
            f"storm(memory_budget={STREAMED_LORA_BUDGET}); the Trainer's own AdamW and clipping",
            budget=STREAMED_LORA_BUDGET, streamed=True),
    Variant("storm-streamed-overlapped", "storm",
            "the same; the Trainer handed overlap_optimizer(AdamW(fused=True), "
            "backwards_per_step=1), max_grad_norm=0 (docs/trainers.md)",
            budget=STREAMED_LORA_BUDGET, streamed=True, overlapped=True),
    Variant("storm-streamed-overlapped-bf16-model", "storm",
            "the same fast loop with bf16=False: the model is already bfloat16, so the "
            "Trainer runs its forward without autocast", budget=STREAMED_LORA_BUDGET,
            training={"bf16": False}, streamed=True, overlapped=True),
    Variant("storm-resident-overlapped", "storm",
            f"storm(memory_budget={STREAMED_LORA_BUDGET}), weights resident; the Trainer handed "
            f"the fast loop's optimizer, max_grad_norm=0: the Trainer's own cost per step, "
            f"beside its plain loop", budget=STREAMED_LORA_BUDGET, overlapped=True),
    Variant("storm-resident-plain", "storm",
            "the same resident model and optimizer in a plain loop",
            budget=STREAMED_LORA_BUDGET, plain=True),
    Variant("storm-streamed-plain", "storm",
            "the same model and AdamW(fused=True) in a plain loop: backward(), step(), "
            "zero_grad(), a constant learning rate", budget=STREAMED_LORA_BUDGET,
            streamed=True, plain=True),
    Variant("storm-streamed-plain-autocast", "storm",
            "the same plain loop, its forward under bfloat16 autocast as the Trainer's "
            "(bf16=True)", budget=STREAMED_LORA_BUDGET, streamed=True, plain=True,
            autocast=True),
)
FAST_LOOP = ("storm-streamed-overlapped", "storm-streamed-plain")
"""The Trainer's fast loop over streamed weights and the plain loop it is held against."""
RESIDENT_LOOP = ("storm-resident-overlapped", "storm-resident-plain")
"""The same two loops over resident weights: their difference is what the Trainer itself costs
a step, whatever the weights."""

REFERENCES = {v.name: v.reference for v in VARIANTS}


@dataclasses.dataclass(frozen=True)
class StepVariant:
    """One compiled copy of part B's step: its backend, storm's budget, and Inductor's
    ``activation_memory_budget`` (None: the partitioner's default)."""

    name: str
    backend: str
    budget: float | None = None
    activation_memory_budget: float | None = None

    def context(self) -> contextlib.AbstractContextManager:
        if self.activation_memory_budget is None:
            return contextlib.nullcontext()
        return torch._functorch.config.patch(
            activation_memory_budget=self.activation_memory_budget)


STEP_VARIANTS = (StepVariant("inductor", "inductor"), StepVariant("storm", "storm"),
                 StepVariant("storm-0.5", "storm", budget=0.5),
                 StepVariant("inductor-amb-0.5", "inductor", activation_memory_budget=0.5))


@dataclasses.dataclass
class Run:
    """The settings every variant of a run shares."""

    dev: _Device
    sizes: dict[str, Sizes]
    steps: int
    loss_steps: int
    warmup: int
    rounds: int
    out: Path
    history: tuple[str, ...] = ()

    @property
    def device(self) -> str:
        return "cuda" if self.dev.cuda else "cpu"

    def backend(self, name: str, budget: float | None):
        """The compiler of a variant: Inductor (:data:`SMOKE_COMPILER` on the CPU) or storm
        with ``budget``."""
        if name == "inductor":
            return "inductor" if self.dev.cuda else SMOKE_COMPILER
        options = {} if self.dev.cuda else dict(SMOKE_STORM_OPTIONS)
        if budget is not None:
            options["memory_budget"] = budget
        return storm(**options)


# --- models ------------------------------------------------------------------------------------

def build_llama(sizes: Sizes, device: str) -> nn.Module:
    """A ``LlamaForCausalLM`` from ``sizes``, random weights from :data:`SEED`, built on
    ``device`` in ``sizes.dtype``."""
    torch.manual_seed(SEED)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**sizes.llama))
    return model.to(device, getattr(torch, sizes.dtype))


def with_lora(model: nn.Module) -> nn.Module:
    """peft LoRA adapters on every projection, initialised from :data:`SEED`."""
    torch.manual_seed(SEED)
    config = peft.LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules=LORA_TARGETS,
                             lora_dropout=0.0)
    return peft.get_peft_model(model, config)


def parameters_of(sizes: Sizes) -> int:
    """Parameters of ``sizes``' model, built on the meta device (no memory, no init)."""
    with torch.device("meta"):
        return parameter_count(LlamaForCausalLM(LlamaConfig(**sizes.llama)))


def token_rows(sizes: Sizes, count: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(SEED)
    return torch.randint(sizes.llama["vocab_size"], (count, sizes.seq), generator=generator)


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# --- part A: the Trainer -----------------------------------------------------------------------

class StepTimer(TrainerCallback):
    """Milliseconds of each optimizer step, synchronised at both ends, and, over the steps from
    ``warmup`` on, the device's peak in each :data:`PHASES` of a step (the peak statistics are
    reset where a phase begins) and the most allocated when a step begins (weights, gradients,
    optimizer state). With ``history``, the allocator records the last step (``last``) and
    :attr:`owners` is :func:`peak_owners` of it."""

    def __init__(self, dev: _Device, warmup: int, last: int, history: bool) -> None:
        self.dev, self.warmup, self.last, self.history = dev, warmup, last, history
        self.ms: list[float] = []
        self.begin = 0.0
        self.peaks = dict.fromkeys(PHASES, 0)
        self.step_begin = 0
        self.before = 0
        self.owners: dict | None = None
        self.timing = self.recording = False

    def _phase(self, phase: str) -> None:
        if self.timing:
            self.peaks[phase] = max(self.peaks[phase], self.dev.peak())
            self.dev.reset_peak()

    def on_step_begin(self, args, state, control, **kwargs):
        self.dev.sync()
        self.timing = self.dev.cuda and state.global_step >= self.warmup
        self.recording = self.timing and self.history and state.global_step == self.last
        if self.timing:
            self.dev.reset_peak()
            self.step_begin = max(self.step_begin, self.dev.allocated())
        if self.recording:
            self.before = self.dev.allocated()
            torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES, stacks="python")
        self.begin = time.perf_counter()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.dev.sync()
        self._phase(PHASES[0])

    def on_step_end(self, args, state, control, **kwargs):
        self.dev.sync()
        self.ms.append((time.perf_counter() - self.begin) * MS)
        self._phase(PHASES[1])
        if self.recording:
            trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
            self.owners = peak_owners(trace, self.before)
            torch.cuda.memory._record_memory_history(enabled=None)

    def peak(self) -> int | None:
        return max(self.peaks.values()) if self.dev.cuda else None


def offload_available() -> bool:
    """Whether the installed transformers' checkpointing takes ``offload``."""
    methods = (getattr(transformers.PreTrainedModel, name, None)
               for name in ("activation_checkpointing_enable", "gradient_checkpointing_enable"))
    return any(m is not None and "offload" in inspect.signature(m).parameters for m in methods)


def skipped(variant: Variant, dev: _Device) -> str | None:
    """Why ``variant`` cannot run here, or None."""
    if variant.training != OFFLOAD:
        return None
    if not offload_available():
        return f"not available in transformers {transformers.__version__}"
    if not dev.cuda:
        return "skipped on the CPU: its pinned host memory needs an accelerator"
    return None


def trainer_model(variant: Variant, run: Run) -> tuple[nn.Module, str]:
    """The variant's model, uncompiled, and what streaming did (for the note)."""
    sizes = run.sizes["trainer"]
    model = build_llama(sizes, run.device)
    streamed = ""
    if variant.streamed:
        resident = DEFAULT_RESIDENT_BYTES if run.dev.cuda else SMOKE_RESIDENT_BYTES
        done = stream_parameters(model.cpu(), run.device, resident_bytes=resident)
        streamed = (f"; {len(done.names)} parameters streamed "
                    f"({done.host_bytes / GIB:.2f} GiB in host memory)")
    if variant.lora:
        model = with_lora(model)
    return model, streamed


def overlapped_adamw(model: nn.Module) -> torch.optim.Optimizer:
    """Fused AdamW over ``model`` at :data:`LEARNING_RATE` without weight decay (the Trainer's
    defaults), one backward per step stated to storm (:func:`overlap_optimizer`)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.0,
                                  fused=True)
    return overlap_optimizer(optimizer, backwards_per_step=1)


def plain_loop(variant: Variant, run: Run, steps: int) -> dict:
    """``steps`` steps of ``variant``'s compiled model in a plain loop with
    :func:`overlapped_adamw`, each timed and synchronised as a Trainer step: its row."""
    fresh(run.dev)
    model, streamed = trainer_model(variant, run)
    model.compile(backend=run.backend(variant.backend, variant.budget))
    optimizer = overlapped_adamw(model)
    sizes = run.sizes["trainer"]
    rows = token_rows(sizes, steps * sizes.batch).to(run.device)
    warmup = min(run.warmup, steps - 1)
    times, losses = [], []
    for step in range(steps):
        batch = rows[step * sizes.batch:(step + 1) * sizes.batch]
        run.dev.sync()
        if step == warmup:
            run.dev.reset_peak()
        begin = time.perf_counter()
        precision = torch.autocast(run.device, dtype=torch.bfloat16) \
            if variant.autocast and run.dev.cuda else contextlib.nullcontext()
        with precision:
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        run.dev.sync()
        times.append((time.perf_counter() - begin) * MS)
        losses.append(loss.item())
    return {"variant": variant.name, "note": variant.note + streamed, "steps": steps,
            "parameters": parameter_count(model),
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "step_ms": statistics.median(times[warmup:]), "first_step_s": times[0] / MS,
            "peak_gib": gib(run.dev.peak() if run.dev.cuda else None),
            "reserved_gib": gib(torch.cuda.max_memory_reserved() if run.dev.cuda else None),
            "losses": losses, "times_ms": times, "graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values())}


def train(variant: Variant, run: Run, steps: int, compiled: bool) -> dict:
    """Train ``variant`` for ``steps`` steps (its model compiled in place when ``compiled``,
    else eager): its row."""
    if variant.plain:
        return plain_loop(variant, run, steps)
    fresh(run.dev)
    model, streamed = trainer_model(variant, run)
    if compiled:
        model.compile(backend=run.backend(variant.backend, variant.budget))
    sizes = run.sizes["trainer"]
    warmup = min(run.warmup, steps - 1)
    timer = StepTimer(run.dev, warmup, last=steps - 1,
                      history=variant.name in run.history and run.dev.cuda)
    clipping = {"max_grad_norm": 0.0} if variant.overlapped else {}
    args = TrainingArguments(**{
        "output_dir": str(run.out / "trainer-output"), "max_steps": steps,
        "per_device_train_batch_size": sizes.batch, "logging_steps": 1, "report_to": [],
        "save_strategy": "no", "learning_rate": LEARNING_RATE, "bf16": run.dev.cuda,
        "use_cpu": not run.dev.cuda, "disable_tqdm": True, "seed": SEED, **clipping,
        **variant.training})
    rows = token_rows(sizes, max(run.steps, run.loss_steps) * sizes.batch)
    data = [{"input_ids": row, "labels": row} for row in rows]
    optimizer = overlapped_adamw(model) if variant.overlapped else None
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[timer],
                      optimizers=(optimizer, None))
    trainer.train()
    return {"variant": variant.name, "note": variant.note + streamed, "steps": steps,
            "parameters": parameter_count(model),
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "step_ms": statistics.median(timer.ms[warmup:]), "first_step_s": timer.ms[0] / MS,
            "peak_gib": gib(timer.peak()),
            "phase_peaks_gib": {phase: gib(peak) for phase, peak in timer.peaks.items()}
            if run.dev.cuda else None, "step_begin_gib": gib(timer.step_begin or None),
            "peak_owners": timer.owners,
            "reserved_gib": gib(torch.cuda.max_memory_reserved() if run.dev.cuda else None),
            "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
            "times_ms": timer.ms, "graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values())}


def trainer_row(variant: Variant, run: Run) -> dict:
    """``variant``'s row: measured, skipped with the reason, or its error; a checkpointing
    variant that fails with Inductor is measured in eager mode, its note saying why."""
    reason = skipped(variant, run.dev)
    if reason is not None:
        return {"variant": variant.name, "note": f"{variant.note}; {reason}"}
    steps = run.loss_steps if variant.loss_run else run.steps
    try:
        return train(variant, run, steps, compiled=True)
    except Exception as error:  # reported in the row; a checkpointing variant tries eager
        failure = error_line(error)
    if not variant.training:
        return {"variant": variant.name, "note": variant.note, "error": failure}
    try:
        row = train(variant, run, steps, compiled=False)
    except Exception as error:  # reported in the row; the run goes on
        return {"variant": variant.name, "note": variant.note,
                "error": f"Inductor: {failure}; eager: {error_line(error)}"}
    row["note"] += f"; failed with Inductor ({failure}), so run in eager mode"
    return row


def gib(value: int | None) -> float | None:
    return None if value is None else value / GIB


def fresh(dev: _Device) -> None:
    """Before each variant: Dynamo's caches and counters, the last model's memory, the cached
    blocks and the peak statistics gone."""
    torch._dynamo.reset()
    counters.clear()
    gc.collect()
    if dev.cuda:
        torch.cuda.empty_cache()
    dev.reset_peak()


def max_loss_difference(row: dict, reference: dict) -> float | None:
    """Largest |Δloss| over the steps both rows ran."""
    if "losses" not in row or "losses" not in reference or row is reference:
        return None
    return max(abs(a - b) for a, b in zip(row["losses"], reference["losses"]))


def summary(rows: list[dict]) -> dict:
    """For each saver of :data:`GOALS`, the fastest ``storm-<x>`` row at most at its peak and
    its step ÷ the saver's; whether the ``storm-<x>`` peaks fall or stay as the budget falls."""
    measured = {r["variant"]: r for r in rows if r.get("peak_gib") is not None}
    budgets = [measured[f"storm-{b}"] for b in STORM_BUDGETS if f"storm-{b}" in measured]
    result: dict = {}
    for saver, goal in GOALS.items():
        if saver not in measured:
            continue
        ref = measured[saver]
        fitting = [r for r in budgets if r["peak_gib"] <= ref["peak_gib"]]
        best = min(fitting, key=lambda r: r["step_ms"], default=None)
        result[saver] = {"peak_gib": ref["peak_gib"], "step_ms": ref["step_ms"], "goal": goal,
                         "storm": best["variant"] if best else "none",
                         "storm_step_ms": best["step_ms"] if best else None,
                         "storm_peak_gib": best["peak_gib"] if best else None,
                         "step_ratio": _ratio(best["step_ms"], ref["step_ms"]) if best else None}
    fast, plain, resident_trainer, resident_plain = (
        [r["step_ms"] for r in rows if r["variant"] == name and "step_ms" in r]
        for name in (*FAST_LOOP, *RESIDENT_LOOP))
    if fast and plain:
        result["fast_loop"] = {"trainer_ms": statistics.mean(fast),
                               "plain_ms": statistics.mean(plain), "runs": len(fast),
                               "ratio": _ratio(statistics.mean(fast), statistics.mean(plain))}
        if resident_trainer and resident_plain:
            cost = statistics.mean(resident_trainer) - statistics.mean(resident_plain)
            result["fast_loop"].update(
                trainer_cost_ms=cost,
                ratio_less_trainer_cost=_ratio(statistics.mean(fast) - cost,
                                               statistics.mean(plain)))
    if len(budgets) == len(STORM_BUDGETS):
        peaks = [r["peak_gib"] for r in budgets]
        result["budget_peaks_gib"] = peaks
        result["peak_non_increasing"] = all(a >= b for a, b in zip(peaks, peaks[1:]))
    return result


# --- part B: the LoRA step ---------------------------------------------------------------------

@dataclasses.dataclass
class LoraStep:
    """One variant's compiled LoRA model, its optimizer over the adapters and its batch;
    ``backend`` names the variant (``timed_rounds`` reads it)."""

    backend: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    tokens: torch.Tensor

    def step(self) -> None:
        self.model(input_ids=self.tokens, labels=self.tokens).loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def lora_step(variant: StepVariant, run: Run) -> LoraStep:
    """``variant``'s model compiled in place and warmed up (under its partitioner budget)."""
    sizes = run.sizes["lora_step"]
    model = with_lora(build_llama(sizes, run.device))
    model.compile(backend=run.backend(variant.backend, variant.budget))
    adapters = [p for p in model.parameters() if p.requires_grad]
    step = LoraStep(variant.name, model, torch.optim.AdamW(adapters, lr=LEARNING_RATE),
                    token_rows(sizes, sizes.batch).to(run.device))
    with variant.context():
        for _ in range(run.warmup):
            step.step()
    return step


def step_peak(step: LoraStep, dev: _Device) -> float | None:
    """GiB of one step's peak above what was allocated before it (the other variants' models
    stay on the device)."""
    dev.sync()
    before = dev.allocated()
    dev.reset_peak()
    step.step()
    dev.sync()
    return None if before is None else gib(dev.peak() - before)


def lora_step_rows(chosen: list[StepVariant], run: Run) -> list[dict]:
    """Part B: a row per variant; one that fails to compile or warm up gets its error and the
    others are still timed."""
    fresh(run.dev)
    steps, rows = [], {}
    for variant in chosen:
        try:
            steps.append(lora_step(variant, run))
        except Exception as error:  # reported in the variant's row; the others go on
            rows[variant.name] = {"variant": variant.name, "error": error_line(error)}
    try:
        peaks = {s.backend: step_peak(s, run.dev) for s in steps}
        times = timed_rounds(steps, run.dev, run.rounds)
    except Exception as error:  # reported in the rows of the variants timed together
        peaks, times = {}, {}
        rows.update({s.backend: {"variant": s.backend, "error": error_line(error)}
                     for s in steps})
    for name, figures in times.items():
        rows[name] = {"variant": name, "steps": len(figures["step"]),
                      "median_ms": statistics.median(figures["step"]), "peak_gib": peaks[name],
                      "times_ms": figures["step"]}
    for variant in chosen:
        row = rows[variant.name]
        print(f"[lora step] {variant.name}: "
              f"{row.get('error') or '%.3f ms median' % row['median_ms']}", flush=True)
    return [rows[variant.name] for variant in chosen]


# --- report ------------------------------------------------------------------------------------

def table(rows: list[dict]) -> str:
    return tabulate(rows, headers="keys", tablefmt="github", floatfmt=".4g",
                    missingval="") + "\n"


def trainer_table(rows: list[dict]) -> str:
    measured = {r["variant"]: r for r in rows if "step_ms" in r}
    ref = measured.get("inductor", {})
    lines = []
    for r in rows:
        if "step_ms" not in r:
            lines.append({"variant": r["variant"]})
            continue
        lines.append({
            "variant": r["variant"], "steps": r["steps"], "step ms": r["step_ms"],
            "step ×": _ratio(r["step_ms"], ref.get("step_ms")),
            "1st s": r["first_step_s"], "peak GiB": r["peak_gib"],
            "peak ×": _ratio(r["peak_gib"], ref.get("peak_gib")),
            **{f"{phase} GiB": (r.get("phase_peaks_gib") or {}).get(phase) for phase in PHASES},
            "step begins GiB": r.get("step_begin_gib"), "resv GiB": r["reserved_gib"],
            "max Δloss": max_loss_difference(r, measured.get(REFERENCES[r["variant"]], {}))
            if r["variant"].startswith("storm") else None})
    return table(lines) + "\n" + "\n".join(wrapped(note(r)) for r in rows) + "\n"


def note(row: dict) -> str:
    """A row's list item under the table: how it ran, its error, Dynamo's graph breaks."""
    text = f"- {row['variant']}: {row['note']}"
    if "error" in row:
        text += f"; error: {row['error']}"
    if row.get("graph_breaks"):
        text += f"; Dynamo: {row['graphs']} graphs, {row['graph_breaks']} graph breaks"
    return text


def wrapped(text: str) -> str:
    """``text`` in lines of :data:`TEXT_WIDTH`, continuing a list item where it is one."""
    return textwrap.fill(text, TEXT_WIDTH, subsequent_indent="  " if text[:2] == "- " else "")


def summary_lines(result: dict) -> str:
    lines = []
    for saver, goal in GOALS.items():
        if saver not in result:
            lines.append(f"- {saver}: no peak measured")
            continue
        s = result[saver]
        head = f"- {saver}: {s['step_ms']:.1f} ms at {s['peak_gib']:.2f} GiB peak; "
        if s["storm"] == "none":
            lines.append(head + "no storm budget row fits under that peak")
            continue
        lines.append(head + f"fastest storm row at most at that peak: {s['storm']} "
                            f"({s['storm_step_ms']:.1f} ms, {s['storm_peak_gib']:.2f} GiB), "
                            f"step ÷ {saver}'s = {s['step_ratio']:.3f} (goal ≤ {goal})")
    if "fast_loop" in result:
        fast = result["fast_loop"]
        lines.append(f"- streamed weights: the Trainer's fast loop ({FAST_LOOP[0]}) "
                     f"{fast['trainer_ms']:.1f} ms against the plain loop's "
                     f"{fast['plain_ms']:.1f} ms ({fast['ratio']:.3f}×"
                     + (f", means of {fast['runs']} runs each)" if fast["runs"] > 1 else ")"))
        if "trainer_cost_ms" in fast:
            lines.append(f"- the Trainer's own cost a step ({RESIDENT_LOOP[0]} less "
                         f"{RESIDENT_LOOP[1]}): {fast['trainer_cost_ms']:.1f} ms; the fast loop "
                         f"less it: {fast['ratio_less_trainer_cost']:.3f}× the plain loop")
    lines = [wrapped(line) for line in lines]
    if "peak_non_increasing" in result:
        peaks = " → ".join(f"{p:.2f}" for p in result["budget_peaks_gib"])
        lines.append(f"- storm's peak as its budget falls ({STORM_BUDGETS[0]} → "
                     f"{STORM_BUDGETS[-1]}): {peaks} GiB; non-increasing: "
                     f"{'yes' if result['peak_non_increasing'] else 'no'}")
    return "\n".join(lines) + "\n"


def lora_step_table(rows: list[dict]) -> str:
    ref = next((r for r in rows if r["variant"] == "inductor" and "median_ms" in r), {})
    lines = [r if "error" in r else {
        "variant": r["variant"], "steps": r["steps"], "median ms": r["median_ms"],
        "×": _ratio(r["median_ms"], ref.get("median_ms")),
        "paired ×": _paired_ratio(r, ref), "step peak GiB": r["peak_gib"],
    } for r in rows]
    return table(lines)


def trainer_section(part: dict, env: dict) -> str:
    sizes = part["sizes"]
    return "\n".join([
        f"## Hugging Face Trainer: LlamaForCausalLM, {part['parameters']:,} parameters\n",
        wrapped(f"{sizes['batch']} × {sizes['seq']} tokens per step, {sizes['dtype']}; "
                f"{env['device']}, torch {env['torch']}, transformers {env['transformers']}, "
                f"peft {env['peft']}. Step: median over the steps after the first "
                f"{env['warmup']} (warm-up); peak: allocated and reserved memory (weights, "
                f"optimizer state, activations) over the same steps; ×: against inductor; "
                f"max Δloss: largest |Δloss| of a storm row against inductor (inductor-lora for "
                f"the LoRA row) over the steps both ran.") + "\n",
        trainer_table(part["rows"]), "Summary:\n", summary_lines(part["summary"]),
        *(owners_section(r) for r in part["rows"] if r.get("peak_owners"))])


def owners_section(row: dict) -> str:
    owners = row["peak_owners"]
    return "\n".join([
        f"### What is live at {row['variant']}'s peak (its last step)\n",
        wrapped(f"{owners['peak_gib']:.2f} GiB at the peak, {owners['before_gib']:.2f} GiB when "
                f"the step began; reached by {owners['reached_by']}") + "\n",
        table(owners["owners"])])


def lora_step_section(part: dict) -> str:
    sizes, llama = part["sizes"], part["sizes"]["llama"]
    return "\n".join([
        f"## LoRA step, plain loop: {llama['num_hidden_layers']} layers, "
        f"d{llama['hidden_size']}, {sizes['batch']} × {sizes['seq']} tokens\n",
        wrapped(f"peft LoRA r={LORA_RANK} on every projection, {sizes['dtype']}, AdamW over the "
                f"adapters. Alternating rounds; ×: against inductor's median; paired ×: median "
                f"of each round's ratio to inductor; step peak: above what was allocated before "
                f"the step.") + "\n",
        lora_step_table(part["rows"])])


def markdown(results: dict) -> str:
    parts = []
    if results["trainer"]["rows"]:
        parts.append(trainer_section(results["trainer"], results["environment"]))
    if results["lora_step"]["rows"]:
        parts.append(lora_step_section(results["lora_step"]))
    return "\n".join(parts)


# --- main --------------------------------------------------------------------------------------

def _names(text: str, known: list[str], option: str, parser) -> list[str]:
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"{option}: unknown {unknown}; known: {', '.join(known)}")
    return names


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    trainer_names = [v.name for v in VARIANTS]
    step_names = [v.name for v in STEP_VARIANTS]
    parser.add_argument("--variants", default=",".join(trainer_names),
                        help="part A's, comma-separated, run in that order, a name given "
                             "twice run twice (default: all; empty: none)")
    parser.add_argument("--lora-variants", default=",".join(step_names),
                        help="part B's, comma-separated (default: all; empty: none)")
    parser.add_argument("--steps", type=int, default=STEPS, help="Trainer steps per variant")
    parser.add_argument("--loss-steps", type=int, default=LOSS_STEPS,
                        help="Trainer steps of inductor and storm")
    parser.add_argument("--warmup", type=int, default=WARMUP)
    parser.add_argument("--rounds", type=int, default=LORA_STEP_ROUNDS,
                        help="part B's timed rounds")
    parser.add_argument("--peak-history", default="",
                        help="part A's variants whose last step runs under the allocator's "
                             "recorded history, to list what is live at its peak")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, tiny sizes, fp32, a few steps: the harness itself")
    parser.add_argument("--out", type=Path, default=Path("bench-out/trainer"))
    args = parser.parse_args(argv)
    args.variants = _names(args.variants, trainer_names, "--variants", parser)
    args.lora_variants = _names(args.lora_variants, step_names, "--lora-variants", parser)
    args.peak_history = tuple(_names(args.peak_history, trainer_names, "--peak-history", parser))
    if args.smoke:
        for name, value in SMOKE_COUNTS.items():
            setattr(args, name, value)
    return args


def status(row: dict) -> str:
    """A row in a few words, for the progress lines."""
    if "step_ms" not in row:
        return row.get("error") or row["note"]
    peak = "" if row["peak_gib"] is None else f", peak {row['peak_gib']:.2f} GiB"
    return f"{row['step_ms']:.1f} ms median{peak}"


def environment(run: Run) -> dict:
    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "peft": peft.__version__, "accelerate": accelerate.__version__,
            "python": platform.python_version(),
            "device": torch.cuda.get_device_name() if run.dev.cuda
            else platform.processor() or platform.machine(),
            "inductor_rows": run.backend("inductor", None),
            "inductor_cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
            "allocator": os.environ.get(ALLOCATOR[0]), "seed": SEED, "warmup": run.warmup,
            "steps": run.steps, "loss_steps": run.loss_steps, "rounds": run.rounds}


def main(argv=None) -> int:
    args = _parse(argv)
    os.environ.setdefault(*ALLOCATOR)
    return run_benchmark("trainer", args, _run)


def _run(args) -> None:
    dev = _Device("cpu" if args.smoke else "cuda")
    run = Run(dev, SMOKE_SIZES if args.smoke else SIZES, args.steps, args.loss_steps,
              args.warmup, args.rounds, args.out, args.peak_history)
    args.out.mkdir(parents=True, exist_ok=True)
    sizes = {part: dataclasses.asdict(s) for part, s in run.sizes.items()}
    results = {"environment": environment(run),
               "trainer": {"sizes": sizes["trainer"],
                           "parameters": parameters_of(run.sizes["trainer"]), "rows": [],
                           "summary": {}},
               "lora_step": {"sizes": sizes["lora_step"], "rows": []}}
    part_a = results["trainer"]
    by_name = {v.name: v for v in VARIANTS}
    for variant in (by_name[name] for name in args.variants):
        row = trainer_row(variant, run)
        part_a["rows"].append(row)
        part_a["summary"] = summary(part_a["rows"])
        print(f"[trainer] {variant.name}: {status(row)}", flush=True)
        write(args.out, results, markdown(results))
    chosen = [v for v in STEP_VARIANTS if v.name in args.lora_variants]
    if chosen:
        results["lora_step"]["rows"] = lora_step_rows(chosen, run)
    print(write(args.out, results, markdown(results)))


if __name__ == "__main__":
    sys.exit(main())
