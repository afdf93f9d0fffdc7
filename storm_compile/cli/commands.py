"""What each ``storm`` command does, once :func:`storm_compile.cli.main` has parsed it: trace
the model with fake tensors, plan it with storm's passes and print or write what they predict
(``schedule``, ``pareto``, ``throughput``), or measure the present GPU (``calibrate``). This is
where the command line loads torch; :mod:`storm_compile.cli.arguments`, its parser, does not.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from tabulate import tabulate
from torch import fx, nn

from storm_compile.cli.arguments import (
    DEFAULT_LLAMA_PRESET,
    GPT_KNOBS,
    LLAMA_KNOBS,
    PARETO_FRACTIONS,
)
from storm_compile.cli.models import add_lora, build_gpt, build_llama, load_factory
from storm_compile.cli.report import (
    annotate,
    chrome_trace,
    format_pareto,
    format_stages,
    format_storages,
    format_table,
    format_throughput,
    pareto_points,
    pareto_svg,
    throughput_row,
)
from storm_compile.cli.shapes import LLAMA_PRESETS, GPTShape, LlamaShape, ModelSpecError
from storm_compile.compiler.backend import StormPartitioner, inductor_joint_graph
from storm_compile.config import CPU_PLANNING, MemoryBudget, StormConfig, StormOptionError
from storm_compile.cost.calibrate import cache_path, calibrate, profile_for
from storm_compile.cost.cost_model import CostModel
from storm_compile.cost.profiles import GPU_PLANNING_PROFILE
from storm_compile.cost.simulate import predict_step
from storm_compile.fx.graphs import PassContext, PassRecord, StormGraphs
from storm_compile.fx.torch_private import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    aot_module_simplified,
    boxed_nop,
    tree_leaves,
    use_lazy_graph_module,
)
from storm_compile.passes import StormBudgetError
from storm_compile.planner.step_budget import StepBudget
from storm_compile.weights.streaming import stream_parameters

USER_MODEL_ERRORS = (TypeError, ValueError, RuntimeError, LookupError, AttributeError)
"""What a user's forward raises on example inputs it cannot take (a signature mismatch, a shape
error, an op fake tensors cannot run). Caught only around the call of the user's model, where
no storm code runs, so a bug in storm keeps its traceback."""

FAKE_TENSOR_LOGGER = "torch._subclasses.fake_tensor"
"""Logs the traceback of an op that fails on fake tensors, then raises the error; inside a user's
forward the CLI reports that error in one line, so the log is muted there."""


class UsageError(ValueError):
    """A command-line argument that is not a storm option is unusable (an output path)."""


def _is_dataclass_instance(value: object) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _tensors(output: object) -> list[torch.Tensor]:
    """Every tensor in ``output``, in order: pytree walks dicts, tuples, lists and namedtuples;
    dataclasses (Hugging Face's ``ModelOutput`` among them) are walked by their fields."""
    found = []
    for leaf in tree_leaves(output, is_leaf=_is_dataclass_instance):
        if _is_dataclass_instance(leaf):
            found += _tensors([getattr(leaf, f.name) for f in dataclasses.fields(leaf)])
        elif isinstance(leaf, torch.Tensor):
            found.append(leaf)
    return found


def differentiated(output: object, name: str) -> tuple[torch.Tensor, ...]:
    """The outputs whose backward ``storm schedule`` plans, by
    :data:`~storm_compile.cli.arguments.OUTPUT_RULE`."""
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return (loss,)
    outputs = tuple(t for t in _tensors(output) if t.is_floating_point())
    if not outputs:
        raise ModelSpecError(f"model {name!r}: its output holds no floating-point tensor to "
                             f"differentiate")
    return outputs


class _TupleOutput(nn.Module):
    """AOTAutograd traces modules whose forward returns a flat tuple of tensors: the model's
    output as :func:`differentiated` reduces it. ``tied`` holds the names of each parameter the
    model registers under several, first name first."""

    def __init__(self, model: nn.Module, name: str) -> None:
        super().__init__()
        self.model = model
        self.name = name
        names: dict[int, list[str]] = {}
        for param_name, param in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), []).append(param_name)
        self.tied = tuple(tuple(group) for group in names.values() if len(group) > 1)

    def forward(self, *inputs):
        """AOTAutograd swaps in its graph input for each parameter's first name only; a weight
        registered under several (a tied embedding) is read through all of them as that input,
        as it is under torch.compile, so each use's gradient reaches it."""
        if not self.tied:
            return differentiated(self.model(*inputs), self.name)
        swapped = {}
        for first, *others in self.tied:
            owner, _, leaf = first.rpartition(".")
            swapped.update(dict.fromkeys(others, getattr(self.model.get_submodule(owner), leaf)))
        return differentiated(torch.func.functional_call(self.model, swapped, inputs,
                                                         tie_weights=False), self.name)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True):
        """Each parameter once, as torch.compile passes them to AOTAutograd: asked for
        duplicates, a tied weight would be two graph inputs, two copies and two gradients."""
        return super().named_parameters(prefix, recurse, remove_duplicate=True)


def _described(error: BaseException) -> str:
    """The error's type and the first line of its message."""
    return f"{type(error).__name__}: {next(iter(str(error).splitlines()), '')}"


class _UserModel(nn.Module):
    """A model of the user's: an error of its forward on the example inputs becomes a one-line
    :class:`ModelSpecError` naming the model."""

    def __init__(self, model: nn.Module, spec: str) -> None:
        super().__init__()
        self.model = model
        self.spec = spec

    def forward(self, *inputs):
        fake_log = logging.getLogger(FAKE_TENSOR_LOGGER)
        level = fake_log.level
        fake_log.setLevel(logging.CRITICAL)
        try:
            return self.model(*inputs)
        except DataDependentOutputException as error:
            raise ModelSpecError(f"model {self.spec!r}: its forward has a data-dependent branch "
                                 f"(Python control flow on a tensor's value, or .item()), which "
                                 f"cannot be traced with fake tensors: {_described(error)}") \
                from error
        except DynamicOutputShapeException as error:
            raise ModelSpecError(f"model {self.spec!r}: its forward calls an op whose output "
                                 f"shape depends on tensor values, which cannot be traced with "
                                 f"fake tensors: {_described(error)}") from error
        except USER_MODEL_ERRORS as error:
            raise ModelSpecError(f"model {self.spec!r}: its forward failed on the example "
                                 f"inputs: {_described(error)}") from error
        finally:
            fake_log.setLevel(level)


def builtin_shape(model: str, shape: dict[str, object]) -> GPTShape | LlamaShape | None:
    """The shape of built-in ``model`` with the fields ``shape`` overrides; None for a factory.
    Raises :class:`ModelSpecError` for a field the model does not take."""
    shape = dict(shape)
    if model == "gpt":
        if "preset" in shape:
            raise ModelSpecError("--preset applies to the built-in llama only")
        return dataclasses.replace(GPTShape(), **shape)
    if model == "llama":
        wrong = [k for k in shape if k not in LLAMA_KNOBS]
        if wrong:
            raise ModelSpecError(f"--{wrong[0].replace('_', '-')} applies to the built-in gpt "
                                 f"only; llama takes --preset and overrides of its "
                                 f"{', '.join(k for k in LLAMA_KNOBS if k != 'preset')}")
        preset = LLAMA_PRESETS[shape.pop("preset", DEFAULT_LLAMA_PRESET)]
        return dataclasses.replace(preset, **shape)
    if shape:
        raise ModelSpecError(f"--{next(iter(shape)).replace('_', '-')} applies to the built-in "
                             f"gpt model only")
    return None


def _build(model: str, shape: dict[str, object], fake_mode: FakeTensorMode
           ) -> tuple[nn.Module, tuple[object, ...]]:
    builtin = builtin_shape(model, shape)
    if builtin is not None:
        with fake_mode:
            return (build_gpt if model == "gpt" else build_llama)(builtin)
    module, inputs = load_factory(model)
    return _UserModel(module, model), tuple(
        fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in inputs)


def _tokens(model: str, shape: dict[str, object]) -> int | None:
    """Tokens per micro-batch of a built-in model; None for a factory."""
    builtin = builtin_shape(model, shape)
    return None if builtin is None else builtin.batch * builtin.seq


def planning_context(stages: bool = False, **options: object) -> PassContext:
    """What ``storm schedule`` and ``storm pareto`` plan with: the storm ``options`` on top of
    :data:`~storm_compile.config.CPU_PLANNING` (graphs are traced, never run), and the cost model of
    their ``profile``, resolved by :func:`~storm_compile.cost.calibrate.profile_for` as the backend
    resolves it, except that ``auto`` without CUDA is the GPU it plans for,
    :data:`~storm_compile.cost.profiles.GPU_PLANNING_PROFILE`; with ``stages``, each pass record
    keeps the code of the graphs it left. Raises :class:`StormOptionError` for a bad option or
    profile."""
    config = StormConfig.from_options(**{**CPU_PLANNING, "inner": "eager", **options})
    return PassContext(config, CostModel(profile_for(config.profile,
                                                     without_cuda=GPU_PLANNING_PROFILE)),
                       stages=stages)


def plan_model(model: str, ctx: PassContext, stream: bool = False, lora: int | None = None,
               host_format: str | None = None, **shape: object) -> StormGraphs:
    """Trace ``model`` (``"gpt"`` or ``"llama"``, with the shape fields ``shape`` gives, or
    ``path/to/file.py:factory``) forward and backward with fake tensors, as Inductor sees the
    joint graph (its decompositions and joint-graph passes, :func:`inductor_joint_graph`; the
    parameters and buffers static inputs, as Dynamo marks them), and run storm's passes on its
    one graph pair with ``ctx``; with ``stream``, its parameters are streamed from host memory
    first (:func:`~storm_compile.weights.streaming.stream_parameters`), the frozen ones held
    in ``host_format``; with ``lora``, the model is frozen and given adapters of that rank on every
    linear layer first (:func:`~storm_compile.cli.models.add_lora`). Each pass run is in the
    result's ``records``. The graphs are lazy graph modules: their Python code, which nothing here
    runs, is generated only if read. Raises :class:`ModelSpecError` for a model that cannot be built
    or traced."""
    captured: list[StormGraphs] = []
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    module, inputs = _build(model, shape, fake_mode)
    if lora is not None:
        with fake_mode:
            add_lora(module, lora)
    if stream:
        with fake_mode:
            stream_parameters(module, "cpu", host_check=False, host_format=host_format)
    decompositions, joint_passes = inductor_joint_graph(
        stream or ctx.config.memory_budget.given)
    partitioner = StormPartitioner(ctx, StepBudget(), observer=captured.append)
    static = list(range(sum(1 for _ in module.parameters()) + sum(1 for _ in module.buffers())))

    def partition(joint: fx.GraphModule, joint_inputs, **kwargs):
        joint_passes(joint)
        return partitioner(joint, joint_inputs,
                           **{**kwargs, "static_lifetime_input_indices": static})

    with fake_mode, use_lazy_graph_module(True):    # the graphs are planned, never run
        aot_module_simplified(_TupleOutput(module, model), inputs, fw_compiler=boxed_nop,
                              bw_compiler=boxed_nop, partition_fn=partition,
                              decompositions=decompositions)
    if not captured:
        raise ModelSpecError("no input or parameter of the model requires grad, so there is "
                             "no backward to schedule")
    return captured[0]


def _weights(args: argparse.Namespace) -> dict[str, object]:
    """How the command line asks for the weights to be held: streamed, with adapters, in a host
    format."""
    if args.host_format is not None and not (args.stream and args.lora):
        raise UsageError(f"--host-format {args.host_format} holds frozen streamed weights: it "
                         f"needs --stream and --lora RANK (the base weights frozen)")
    if args.lora is not None and args.lora < 1:
        raise UsageError(f"--lora {args.lora}: expected a rank of 1 or more")
    return {"stream": args.stream, "lora": args.lora, "host_format": args.host_format}


def _shape(args: argparse.Namespace) -> dict[str, object]:
    """The gpt shape fields given on the command line."""
    return {k: getattr(args, k) for k in (*GPT_KNOBS, "preset") if getattr(args, k) is not None}


def _context(args: argparse.Namespace, **options: object) -> PassContext:
    """:func:`planning_context` of the storm options given on the command line and ``options``."""
    for name in ("profile", "offload", "offload_format", "min_offload_bytes", "recompute",
                 "max_overhead", "host_memory_limit"):
        if getattr(args, name, None) is not None:
            options[name] = getattr(args, name)
    return planning_context(**options)


def format_passes(records: Sequence[PassRecord]) -> str:
    """One row per pass run, in the order they ran: its name, seconds and what it changed."""
    return tabulate([(r.name, f"{r.seconds:.3f}", r.changed or "-") for r in records],
                    headers=["pass", "seconds", "changed"], disable_numparse=True)


def _check_folder(path: Path | None, option: str) -> None:
    """Fail before tracing when ``path`` cannot be written: its folder must exist."""
    if path is not None and not path.parent.is_dir():
        raise UsageError(f"{option} {str(path)!r}: no such folder {str(path.parent)!r}")


def _write(path: Path, text: str, option: str) -> None:
    try:
        path.write_text(text)
    except OSError as error:
        raise UsageError(f"{option} {str(path)!r}: cannot write: {error.strerror or error}") \
            from error


def _print(args: argparse.Namespace, document, as_table) -> None:
    print(json.dumps(document, indent=1) if args.format == "json" else as_table(document))


def _schedule(args: argparse.Namespace) -> int:
    _check_folder(args.trace, "--trace")
    budget = {} if args.memory_budget is None else {"memory_budget": args.memory_budget}
    ctx = dataclasses.replace(_context(args, **budget), stages=args.stages)
    graphs = plan_model(args.model, ctx, **_weights(args), **_shape(args))
    annotated = annotate(graphs, ctx.cost, tokens=_tokens(args.model, _shape(args)),
                         host_format=args.host_format)
    prediction = annotated.pop("prediction")
    if args.trace is not None:
        _write(args.trace, json.dumps(chrome_trace(prediction)), "--trace")
    if args.timings:
        annotated["passes"] = [{k: v for k, v in dataclasses.asdict(r).items() if k != "code"}
                               for r in graphs.records]
    if args.stages:
        annotated["stages"] = [{**dataclasses.asdict(r), "code": dict(r.code)}
                               for r in graphs.records]

    def as_table(doc: dict[str, object]) -> str:
        text = format_table(doc) if args.nodes else format_storages(doc, title=args.model)
        if args.timings:
            text += f"\n\n{format_passes(graphs.records)}"
        if args.stages:
            text += f"\n\n{format_stages(graphs.records)}"
        return text

    _print(args, annotated, as_table)
    return 0


def _asked_bytes(budget: MemoryBudget, summary: dict[str, object]) -> int | None:
    """Activation bytes a fraction asks for, a byte budget's device peak (None for
    ``"auto"``)."""
    if budget.fraction is not None:
        return int(budget.fraction * summary["baseline_activation_bytes"])
    return budget.nbytes


def _pareto(args: argparse.Namespace) -> int:
    _check_folder(args.plot, "--plot")
    budgets = args.budgets.split(",") if args.budgets else list(PARETO_FRACTIONS)
    contexts = [_context(args, memory_budget=budget) for budget in budgets]
    rows, summaries, infeasible = [], [], None
    for budget, ctx in zip(budgets, contexts):
        try:
            summaries.append(annotate(plan_model(args.model, ctx, **_shape(args)),
                                      ctx.cost)["summary"])
        except StormBudgetError as error:
            summaries.append(None)
            infeasible = error
    planned = [s for s in summaries if s is not None]
    if not planned:
        raise infeasible
    minimum = planned[0]["minimum_activation_bytes"]
    for budget, ctx, summary in zip(budgets, contexts, summaries):
        asked = _asked_bytes(ctx.config.memory_budget, summary or planned[0])
        if summary is None:
            print(f"storm: note: budget {budget} ({asked} bytes) skipped: below the minimum for "
                  f"this model ({infeasible})", file=sys.stderr)
        elif asked is not None and asked < minimum:
            print(f"storm: note: budget {budget} ({asked} bytes) skipped: below the minimum of "
                  f"{minimum} bytes for this model", file=sys.stderr)
        else:
            rows.append(summary)
    if not args.budgets and all(r["budget_bytes"] != minimum for r in rows):
        least = max(minimum, 1) / planned[0]["baseline_activation_bytes"]
        ctx = _context(args, memory_budget=least)
        rows.append(annotate(plan_model(args.model, ctx, **_shape(args)), ctx.cost)["summary"])
    if not rows:
        raise UsageError(f"--budgets {args.budgets}: every budget is below the minimum of "
                         f"{minimum} bytes for this model")
    points = pareto_points(rows)
    if args.plot is not None:
        _write(args.plot, pareto_svg(points, title=args.model), "--plot")
    _print(args, points, format_pareto)
    return 0


def _throughput(args: argparse.Namespace) -> int:
    shape = _shape(args)
    base = builtin_shape(args.model, shape)
    if base is None:
        raise UsageError("throughput needs a built-in model (gpt or llama): it sets the batch "
                         "from the tokens per micro-batch")
    counts = [int(t) for t in args.tokens.split(",") if t.strip().isdigit()]
    if not counts or len(counts) != len(args.tokens.split(",")) or min(counts) < base.seq \
            or any(t % base.seq for t in counts):
        raise UsageError(f"--tokens {args.tokens}: expected comma-separated multiples of the "
                         f"sequence length {base.seq}")
    micro_batches = [int(m) for m in args.micro_batches.split(",") if m.strip().isdigit()]
    if not micro_batches or len(micro_batches) != len(args.micro_batches.split(",")) \
            or min(micro_batches) < 1:
        raise UsageError(f"--micro-batches {args.micro_batches}: expected comma-separated "
                         f"positive integers")
    budget = {} if args.memory_budget is None else {"memory_budget": args.memory_budget}
    rows = []
    for tokens in counts:
        ctx = _context(args, **budget)               # each size is a step of its own
        graphs = plan_model(args.model, ctx, **_weights(args),
                            **{**shape, "batch": tokens // base.seq})
        summary = annotate(graphs, ctx.cost, tokens=tokens,
                           host_format=args.host_format)["summary"]
        rows += [throughput_row(summary, predict_step(graphs, ctx.cost, count,
                                                      args.overlap_optimizer, args.accumulate))
                 for count in micro_batches]
    _print(args, rows, format_throughput)
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


COMMANDS = {"schedule": _schedule, "pareto": _pareto, "throughput": _throughput,
            "calibrate": _calibrate}
"""Each command's implementation, by the name the parser gives it; it returns the exit status."""

USER_ERRORS = (ModelSpecError, StormOptionError, StormBudgetError, UsageError)
"""Errors of bad input, which the command line reports in one line with exit status
:data:`~storm_compile.cli.arguments.EXIT_USAGE`; any other error is storm's and keeps its
traceback."""
