"""A real training loop under storm and under torch.compile: losses, device memory, pinned pool.

The zoo's ``llama`` (``bench`` size) with fp32 weights, ``torch.autocast`` to bf16, fused
AdamW, two micro-batches accumulated per optimizer step, sequence lengths cycling through
768, 1024 and 896 tokens (dynamic padding: Dynamo recompiles the model with a symbolic
length), an evaluation forward (``model.eval()``, ``torch.no_grad()``) every ``--eval-every``
steps, and a save and load of the model's and the optimizer's ``state_dict`` (``torch.save``
to an in-memory buffer) half-way. Every method starts from the same weights and sees the same
batches. Recorded per method: the loss of every optimizer step, the step's wall time,
``torch.cuda.memory_allocated()`` after every optimizer step, and the reserved bytes of storm's
pinned pool after every step; the summary gives the largest loss difference against
``compile`` over the first 100 steps and the memory and pool figures at steps 10, 100, the last,
and their maximum from step 10 on.

    python -m benchmarks.training_loop --out DIR [--steps 1000] [--methods compile,storm]

Writes ``results.md`` (tabulate) and ``results.json`` (every step's figures).
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tabulate import tabulate
from torch import nn

from benchmarks import model_zoo
from benchmarks.activation_memory import EXIT_NO_CUDA, _Device, _gib
from benchmarks.compile_time import error_line, write
from benchmarks.zoo_memory import METHODS, REFERENCE, wrap
from storm_compile.runtime.streams import get_runtime

MODEL = "llama"
SIZE = "bench"
SEQ_LENGTHS = (768, 1024, 896)
"""Token counts the micro-batches cycle through: padded to the longest of each batch, real
data changes length from batch to batch; three lengths make Dynamo go symbolic."""
ACCUMULATION = 2
"""Micro-batches per optimizer step."""
LEARNING_RATE = 3e-4
"""A usual AdamW rate for a model of this size: the loss moves visibly within 100 steps."""
WEIGHT_DECAY = 0.1
MODEL_SEED = 0
"""Seed of the weights, the same for every method."""
DATA_SEED = 1_000
"""Micro-batch ``i`` of a run is ``case.batch(DATA_SEED + i)``: the same data for every method."""
EVAL_SEED = 7
"""Seed of the one held-out batch every evaluation forward runs."""
LOSS_STEPS = 100
"""Steps whose losses are compared against ``compile``: before chaos amplifies rounding."""
SETTLED_STEP = 10
"""By this step the training graphs are compiled (the first length static, then symbolic) and
every length has run under the symbolic one: memory and pool figures should be flat from here."""


@dataclasses.dataclass(frozen=True)
class LoopSettings:
    """What one training run does; the GPU tests run the same loop, shorter and smaller."""

    steps: int = 1000
    size: str = SIZE
    seq_lengths: tuple[int, ...] = SEQ_LENGTHS
    accumulation: int = ACCUMULATION
    eval_every: int = 50
    save_at: int | None = None
    """The optimizer step after which the state is saved and loaded; None: half-way."""
    device: str = "cuda"
    storm_options: dict = dataclasses.field(default_factory=dict)
    """Options on top of each storm method's preset (the tests plan tiny tensors too)."""


@dataclasses.dataclass
class Record:
    """One method's figures, step by step; a run that fails keeps what it recorded."""

    method: str
    loss: list[float] = dataclasses.field(default_factory=list)
    step_s: list[float] = dataclasses.field(default_factory=list)
    allocated: list[int | None] = dataclasses.field(default_factory=list)
    pool_reserved: list[int] = dataclasses.field(default_factory=list)
    eval_loss: list[float] = dataclasses.field(default_factory=list)
    error: str | None = None


def sliced(inputs: tuple, seq: int) -> tuple:
    """The zoo batch cut to ``seq`` tokens along the sequence dimension (dim 1), contiguous as
    a batch padded to that length would be."""
    return tuple(t[:, :seq].contiguous() if isinstance(t, torch.Tensor) and t.dim() > 1 else t
                 for t in inputs)


def micro_batch(case: model_zoo.ZooCase, index: int, settings: LoopSettings) -> tuple:
    seq = settings.seq_lengths[index % len(settings.seq_lengths)]
    return sliced(case.batch(DATA_SEED + index), seq)


def _optimizer_step(run: Callable, case: model_zoo.ZooCase, optimizer: torch.optim.Optimizer,
                    step: int, settings: LoopSettings) -> torch.Tensor:
    """Accumulate the micro-batches' gradients, step and clear them; the step's mean loss."""
    total = torch.zeros((), device=settings.device)
    for micro in range(settings.accumulation):
        inputs = micro_batch(case, step * settings.accumulation + micro, settings)
        with torch.autocast(settings.device, dtype=torch.bfloat16):
            loss = case.loss(run(*inputs)) / settings.accumulation
        loss.backward()
        total += loss.detach()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def _evaluate(run: Callable, case: model_zoo.ZooCase, settings: LoopSettings) -> float:
    inputs = sliced(case.batch(EVAL_SEED), max(settings.seq_lengths))
    case.model.eval()
    with torch.no_grad(), torch.autocast(settings.device, dtype=torch.bfloat16):
        loss = case.loss(run(*inputs)).item()
    case.model.train()
    return loss


def _save_and_load(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Round-trip model and optimizer state through ``torch.save``/``torch.load`` in memory."""
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    state = torch.load(buffer)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])


def train(method: str, settings: LoopSettings, record: Record) -> None:
    """Run ``settings.steps`` optimizer steps of ``method``, appending figures to ``record``."""
    dev = _Device(settings.device)
    torch._dynamo.reset()
    get_runtime().pool.clear()
    torch.manual_seed(MODEL_SEED)
    case = model_zoo.build(MODEL, settings.size, device=settings.device, dtype=torch.float32)
    case.model.train()
    run = wrap(method, case.model, settings.storm_options)
    optimizer = torch.optim.AdamW(case.model.parameters(), lr=LEARNING_RATE,
                                  weight_decay=WEIGHT_DECAY, fused=True)
    save_at = settings.save_at or settings.steps // 2
    for step in range(1, settings.steps + 1):
        begin = time.perf_counter()
        record.loss.append(_optimizer_step(run, case, optimizer, step - 1, settings).item())
        record.step_s.append(time.perf_counter() - begin)
        record.allocated.append(dev.allocated())
        record.pool_reserved.append(get_runtime().pool.reserved_bytes)
        if step % settings.eval_every == 0:
            record.eval_loss.append(_evaluate(run, case, settings))
        if step == save_at:
            _save_and_load(case.model, optimizer)


def run_method(method: str, settings: LoopSettings) -> Record:
    record = Record(method)
    try:
        train(method, settings, record)
    except Exception as error:  # a failing method is reported with its step; the run goes on
        record.error = f"step {len(record.loss) + 1}: {error_line(error)}"
    finally:
        if settings.device == "cuda":
            torch.cuda.empty_cache()
    print(f"{method}: {record.error or 'final loss %.4f' % record.loss[-1]}", flush=True)
    return record


def loss_difference(losses: list[float], reference: list[float]) -> dict:
    """Largest absolute and relative loss difference over the first :data:`LOSS_STEPS`."""
    pairs = list(zip(losses, reference))[:LOSS_STEPS]
    if not pairs:
        return {"loss_max_abs_diff": None, "loss_max_rel_diff": None}
    return {"loss_max_abs_diff": max(abs(a - b) for a, b in pairs),
            "loss_max_rel_diff": max(abs(a - b) / abs(b) for a, b in pairs)}


def _at(values: list, step: int) -> float | int | None:
    return values[step - 1] if 0 < step <= len(values) else None


def flatness(values: list[int | None]) -> dict:
    """A per-step byte series at steps 10 and 100, the last step, and its maximum from 10 on."""
    settled = [v for v in values[SETTLED_STEP - 1:] if v is not None]
    return {f"step_{SETTLED_STEP}": _at(values, SETTLED_STEP),
            f"step_{LOSS_STEPS}": _at(values, LOSS_STEPS),
            "last": values[-1] if values else None, "max": max(settled) if settled else None}


def summarise(records: list[Record]) -> list[dict]:
    reference = next((r.loss for r in records if r.method == REFERENCE), [])
    rows = []
    for r in records:
        settled = r.step_s[SETTLED_STEP:]
        rows.append({"method": r.method, "steps": len(r.loss), "error": r.error,
                     **loss_difference(r.loss, reference),
                     "final_loss": r.loss[-1] if r.loss else None,
                     "final_eval_loss": r.eval_loss[-1] if r.eval_loss else None,
                     "median_step_ms": statistics.median(settled) * 1e3 if settled else None,
                     "allocated": flatness(r.allocated),
                     "pool_reserved": flatness(r.pool_reserved)})
    return rows


def markdown(rows: list[dict]) -> str:
    table = []
    for r in rows:
        entry = {"method": r["method"], "steps": r["steps"],
                 f"max |Δloss| (first {LOSS_STEPS})": r["loss_max_abs_diff"],
                 "max rel Δloss": r["loss_max_rel_diff"], "final loss": r["final_loss"],
                 "final eval loss": r["final_eval_loss"], "step ms": r["median_step_ms"]}
        for series, label in (("allocated", "alloc GiB"), ("pool_reserved", "pool GiB")):
            for point, value in r[series].items():
                entry[f"{label} {point.replace('_', ' ')}"] = _gib(value)
        entry["error"] = r["error"]
        table.append(entry)
    return tabulate(table, headers="keys", tablefmt="github", floatfmt=".4g",
                    missingval="") + "\n"


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=LoopSettings.steps)
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"comma-separated, from {', '.join(METHODS)} ({REFERENCE} always "
                             f"runs: the losses are compared against it)")
    parser.add_argument("--eval-every", type=int, default=LoopSettings.eval_every)
    parser.add_argument("--out", type=Path, default=Path("bench-out/training-loop"))
    args = parser.parse_args(argv)
    args.methods = args.methods.split(",")
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        parser.error(f"unknown method(s) {unknown}; known: {', '.join(METHODS)}")
    return args


def main(argv=None) -> int:
    args = _parse(argv)
    if not torch.cuda.is_available():
        print("training_loop: no CUDA device; the training-loop benchmark needs one",
              file=sys.stderr)
        return EXIT_NO_CUDA
    settings = LoopSettings(steps=args.steps, eval_every=args.eval_every)
    args.out.mkdir(parents=True, exist_ok=True)
    environment = {"torch": torch.__version__, "python": platform.python_version(),
                   "device": torch.cuda.get_device_name(),
                   "settings": dataclasses.asdict(settings), "model": MODEL,
                   "learning_rate": LEARNING_RATE}
    records = []
    for method in [REFERENCE] + [m for m in args.methods if m != REFERENCE]:
        records.append(run_method(method, settings))
        rows = summarise(records)
        table = write(args.out, {"environment": environment, "summary": rows,
                                 "records": [dataclasses.asdict(r) for r in records]},
                      markdown(rows))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
