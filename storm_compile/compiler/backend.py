"""The ``torch.compile`` backend: options in, compiled forward and backward out.

``torch.compile(model, backend="storm")`` uses :data:`storm_backend` (default options, found
through the ``torch_dynamo_backends`` entry point); ``storm(**options)`` builds a configured one.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
import warnings
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from uuid import uuid4

import torch
from torch import fx

import storm_compile
from storm_compile import passes
from storm_compile.compiler.pin_transfers import inductor_patches
from storm_compile.compiler.pipeline import storm_partition
from storm_compile.compiler.upcasts import cast_after, move_upcasts
from storm_compile.config import MemoryBudget, StormConfig, StormOptionError
from storm_compile.cost.calibrate import profile_for
from storm_compile.cost.cost_model import CostModel, MeasuredCosts
from storm_compile.fx.graphs import Limits, PassContext, StormGraphs
from storm_compile.fx.torch_private import (
    CustomPartitionerFn,
    TracingContext,
    aot_autograd,
    boxed_nop,
    compile_fx,
    compile_fx_inner,
    get_hash_for_files,
    inductor_config,
    inductor_lowering,
    joint_graph_passes,
    list_mode_options,
    optional,
    select_decomp_table,
    tracing,
    tree_leaves,
)
from storm_compile.fx.vocabulary import is_transfer
from storm_compile.planner import plan_cache
from storm_compile.planner.step_budget import (
    GraphId,
    GraphShare,
    RunRoom,
    StepBudget,
    StormBudgetError,
    runs_over,
)
from storm_compile.runtime import ops
from storm_compile.runtime.ranks import rank_key
from storm_compile.runtime.streams import get_runtime

log = logging.getLogger("storm_compile")

KEPT_WHOLE = frozenset({torch.ops.aten.embedding_dense_backward.default})
"""Ops storm leaves out of Inductor's decomposition table, so that they run as aten's kernels,
in a graph whose memory storm bounds (a ``memory_budget``, or weights streamed); elsewhere the
table is Inductor's, and the graph's kernels are the ones ``torch.compile`` launches (aten's
embedding backward sorts its indices: 20 more kernels in a 6-layer Llama's step on the H100,
+1 % of a launch-bound step).
Inductor decomposes an embedding's backward into a scatter-add into a float32 zero table of
the whole vocabulary, converted to the weight's dtype at the end, and its scheduler may
allocate that table at the start of the backward: in the 8B Llama's streamed step on the H100
a 2 GiB float32 table (128256 × 4096) was live at the backward's first kernels, taking the
step 2.5 GiB over its predicted peak. Aten's kernel accumulates the touched rows in float32
and allocates only the gradient, in its dtype, when it runs, which is where the simulator puts
it."""

BOUNDED_INDUCTOR_CONFIG = {"allow_buffer_reuse": False}
"""Inductor config for a graph whose memory storm bounds. Inductor keeps a freed buffer in a
pool until a later allocation of its size takes it over, as long as its own estimate of the
graph's peak allows, which is not the peak storm plans for. In the 70B shape's step the
buffers a layer's backward freed stayed live across the next layer's attention backward,
where the peak was, until the next layer's feed-forward backward took them over. Without
the pool each buffer is freed after its last use, as the simulator frees it, and the caching
allocator serves the next allocation of its size: on the H200, the 70B shape's 8 layers under
a 7 GiB budget peaked at 8.33 GiB with it and 6.99 GiB without (6.86 GiB predicted), at 12920
and 12896 tokens/s."""

STREAMED_READS = (ops.fetch_weight, ops.fetch_weight.overloadpacket)
"""How a traced graph reads a streamed weight: dynamo records the parametrization's call of
``torch.ops.storm.fetch_weight`` as the op's packet; AOTAutograd's graphs as its overload."""

_SOURCE_FILES = tuple(sorted(str(p) for d in (Path(__file__).parent.parent,
                                               Path(passes.__file__).parent)
                             for p in d.rglob("*.py")))
"""storm's sources, wherever the build put them: the cache key of its plans."""


@functools.cache
def _sources_hash() -> str:
    return get_hash_for_files(_SOURCE_FILES).hex()


class StormPartitioner(CustomPartitionerFn):
    """AOTAutograd partition function: the default min-cut split, then storm's passes."""

    def __init__(self, ctx: PassContext, step: StepBudget,
                 observer: Callable[[StormGraphs], None] | None = None) -> None:
        self.ctx = ctx
        self.step = step
        """The ledger of the step the graphs it plans belong to."""
        self.observer = observer
        self.ledger = ""
        """The step's ledger the next graph is planned against (:meth:`StepBudget.ledger_key`),
        set by the backend before each compile; empty without a budget."""
        self.record_key: str | None = None
        """Where the next graph's :class:`~storm_compile.planner.plan_cache.PlanRecord` goes, set by
        the backend before each compile; None when the graph cannot be cached."""
        self._uncached = f"storm-uncached-{uuid4()}"

    def __call__(self, joint: fx.GraphModule, joint_inputs, **kwargs: Any):
        """Plan and rewrite the graph; store its plan record before AOTAutograd stores the
        compiled graphs (so a cache entry never lacks its record)."""
        step = self.step
        recorded = step.last
        with warnings.catch_warnings(record=True) as raised:
            graphs = storm_partition(joint, joint_inputs, ctx=self.ctx, step=step,
                                     observer=self.observer, **kwargs)
        if self.record_key is not None:
            share = step.share(step.last) if step.last != recorded else None
            plan_cache.store(self.record_key, plan_cache.PlanRecord(
                share, tuple(str(w.message) for w in raised if _is_storm_warning(w))))
        for warning in raised:
            warnings.warn_explicit(warning.message, warning.category, warning.filename,
                                   warning.lineno, source=warning.source)
        return graphs

    def key(self) -> str | None:
        """What a plan depends on besides the graph: storm's version and sources, the options,
        the device profile, the rank (in a process group each rank plans, and checks with the
        others, :mod:`storm_compile.runtime.ranks`, every graph itself) and the step's ledger. None
        with an observer or a cost override, whose effects no key can capture."""
        if self.observer is not None or self.ctx.cost.override is not None:
            return None
        return repr((storm_compile.__version__, _sources_hash(), self.ctx.config,
                     self.ctx.limits, self.ctx.cost.profile, rank_key(), self.ledger))

    def uuid(self) -> Any:
        """AOTAutograd's and Inductor's cache key of the partitioner: :meth:`key`, or None
        (no cache entry is reused)."""
        return self.key()

    def __reduce__(self):
        """Torch's caches pickle the Inductor config, which holds this partitioner: it pickles
        as its :meth:`uuid`, or, when it has none, as a key of its own that no other process
        shares (AOTAutograd's cache then misses instead of reusing another plan)."""
        key = self.uuid()
        return str, (self._uncached if key is None else f"storm-{key}",)


class StormCacheError(RuntimeError):
    """torch's cache holds a compiled graph of storm's without the plan record beside it."""


def _is_storm_warning(warning: warnings.WarningMessage) -> bool:
    return issubclass(warning.category, RuntimeWarning) and str(warning.message).startswith(
        "storm:")


def _needs_backward(example_inputs: list[Any]) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs)


class StormBackend:
    """A configured storm backend; call it as ``torch.compile`` calls backends.

    ``observer`` receives the rewritten graphs of every compiled region (the CLI and tests use
    it); ``cost_override(node)`` may return measured seconds for a node, or None for the model.
    """

    def __init__(self, config: StormConfig,
                 observer: Callable[[StormGraphs], None] | None = None,
                 cost_override: Callable[[fx.Node], float | None] | None = None) -> None:
        self.config = config
        self.observer = observer
        self.cost_override = cost_override
        profile = profile_for(config.profile)
        if config.cost == "measured":
            if not torch.cuda.is_available():
                raise StormOptionError("storm option 'cost': 'measured' times ops on a CUDA "
                                       "device, and none is available")
            cost_override = cost_override or MeasuredCosts(roofline=CostModel(profile))
        self.ctx = PassContext(config, CostModel(profile, cost_override))
        self.step = StepBudget()
        """The step's ledger: what each graph compiled so far planned (budgets are the
        step's)."""
        self.partitioner = StormPartitioner(self.ctx, self.step, observer)
        self._warned_split = False
        self._variants: dict[tuple, StormBackend] = {}

    def __repr__(self) -> str:
        return f"StormBackend({self.config})"

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any],
                 mode: str | None = None, options: dict[str, Any] | None = None):
        """Compile ``gm``. ``mode`` and ``options`` are ``torch.compile``'s: they override this
        backend's ``mode`` and options (:meth:`variant`). Outputs upcast to float32 around the
        model are cast after the compiled graph (:mod:`storm_compile.compiler.upcasts`)."""
        if mode is not None or options:
            return self.variant(mode, options)(gm, example_inputs)
        moved = move_upcasts(gm)
        return cast_after(self._compile_counted(gm, example_inputs), moved)

    def _compile_counted(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        """``gm`` planned and compiled, its runs counted under a budget (:func:`_counting_runs`)."""
        if not _needs_backward(example_inputs):
            log.debug("storm: inference graph (grad mode off or no input requires grad): "
                      "nothing is saved for a backward; compiling unchanged")
        step = self.step
        graph, recorded = step.peek_graph(), step.last
        budget = self.config.memory_budget
        if _streams(gm) and _needs_backward(example_inputs):
            get_runtime().prepare_backward(_sent_home(gm, example_inputs),
                                           self.config.host_memory_limit)
        original = _graph_copy(gm) if budget.nbytes is not None else None
        self._prepare(gm, example_inputs, graph)
        compiled = self._compile(gm, example_inputs)
        if step.last == recorded and self.partitioner.record_key is not None:
            self._replay(self.partitioner.record_key)
        if step.last == recorded:
            return compiled
        if budget.given and step.last.position > 0:
            self._warn_split()
        if not budget.given:
            return compiled
        replan = None if original is None else functools.partial(
            self._planned_for, original, example_inputs, TracingContext.try_get())
        return _counting_runs(compiled, step, step.last, budget.planned.nbytes, replan)

    def _planned_for(self, gm: fx.GraphModule, example_inputs: list[Any], context: Any,
                     room: RunRoom) -> tuple[Callable, GraphShare]:
        """``gm`` (dynamo's graph, as it came) compiled for one run under a byte budget of
        ``room``'s device peak alone, its activations planned for ``room.plan_bytes``, and
        that plan's share of the step: a run :meth:`StepBudget.run_room` asked to plan
        again (a peak no plan fits is an error for a known run, a warning for one the step
        shows for the first time). It compiles in dynamo's tracing ``context`` of the first
        compile (its fake tensors' shape environment, which the caches key on), and its own
        ledger never joins the step's."""
        config = dataclasses.replace(self.config,
                                     memory_budget=MemoryBudget(nbytes=room.peak_bytes,
                                                                margin=0.0))
        backend = StormBackend(config, self.observer, self.cost_override)
        backend.partitioner.ctx = dataclasses.replace(backend.ctx, limits=Limits(
            budget_bytes=room.plan_bytes, peak_error=room.known))
        fresh = _graph_copy(gm)
        backend._prepare(fresh, example_inputs, backend.step.peek_graph())
        with contextlib.nullcontext() if context is None else tracing(context):
            compiled = backend._compile(fresh, example_inputs)
        if backend.step.last is None and backend.partitioner.record_key is not None:
            backend._replay(backend.partitioner.record_key)
        log.debug("storm: a graph planned again for a run peaking at %d bytes", room.peak_bytes)
        return compiled, backend.step.share(backend.step.last)

    def variant(self, mode: str | None, options: dict[str, Any] | None) -> StormBackend:
        """This backend with ``mode`` and ``options`` over its own, validated as ``storm(...)``
        validates them; made once per distinct pair, so all graphs of a compile share one
        step ledger."""
        key = (mode, tuple(sorted((options or {}).items())))
        if key not in self._variants:
            own = {f.name: getattr(self.config, f.name) for f in dataclasses.fields(self.config)}
            fields = {**own, **(options or {}),
                      **({} if mode is None else {"mode": mode})}
            self._variants[key] = StormBackend(StormConfig.from_options(**fields),
                                               self.observer, self.cost_override)
        return self._variants[key]

    def _prepare(self, gm: fx.GraphModule, example_inputs: list[Any], graph: GraphId) -> None:
        """Give the partitioner ``graph``'s cache key (the ledger it is planned against) and
        the key of its plan record (None when it cannot be cached or plans nothing)."""
        budgeted = self.config.memory_budget.given
        self.partitioner.ledger = self.step.ledger_key(graph) if budgeted else ""
        key = self.partitioner.key()
        cached = key is not None and self.config.inner != "eager" \
            and _needs_backward(example_inputs)
        self.partitioner.record_key = (plan_cache.record_key(key, gm, example_inputs)
                                       if cached else None)

    def _replay(self, record_key: str) -> None:
        """AOTAutograd's cache served the graph without planning it: record its share of the
        step's budget and raise its planning's warnings, as planning did."""
        record = plan_cache.load(record_key)
        if record is None:
            raise StormCacheError(
                f"storm: AOTAutograd's cache served a graph whose plan record "
                f"{plan_cache.record_dir() / record_key}.json is missing or unreadable; remove "
                f"the Inductor cache directory ({plan_cache.record_dir().parent}) or set "
                f"TORCHINDUCTOR_CACHE_DIR to a new one")
        if record.share is not None:
            self.step.record(self.step.next_graph(), record.share)
        for message in record.warnings:
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def _compile(self, gm: fx.GraphModule, example_inputs: list[Any]):
        if self.config.inner == "eager":
            return aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop,
                                partition_fn=self.partitioner,
                                keep_inference_input_mutations=True)(gm, example_inputs)
        bounds = self._bounds_memory(gm)
        return compile_fx(gm, example_inputs, inner_compile=_compile_graph,
                          config_patches={"custom_partitioner_fn": self.partitioner,
                                          **list_mode_options(self.config.mode),
                                          **(BOUNDED_INDUCTOR_CONFIG if bounds else {})},
                          decompositions=_decompositions() if bounds else None)

    def _bounds_memory(self, gm: fx.GraphModule) -> bool:
        """Whether storm bounds ``gm``'s device memory: a budget, or weights it streams."""
        return self.config.memory_budget.given or _streams(gm)

    def _warn_split(self) -> None:
        """Once: a frame made several graphs, so DDPOptimizer split it by gradient bucket, and
        a budget is met mostly by recomputation there (a piece's offloads must finish within
        the piece's own forward)."""
        if self._warned_split:
            return
        self._warned_split = True
        warnings.warn(
            "storm: dynamo split this model into one graph per DDP gradient bucket "
            "(torch._dynamo.config.optimize_ddp); a graph's offloads must finish within its own "
            "forward, so the memory budget is met mostly by recomputation. For one graph, set "
            "torch._dynamo.config.optimize_ddp = 'python_reducer' and "
            "torch._dynamo.config.compiled_autograd = True (docs/distributed.md)",
            RuntimeWarning, stacklevel=2)


def _counting_runs(compiled: Callable, step: StepBudget, graph: GraphId, budget: int | None,
                   replan: Callable[[RunRoom], tuple[Callable, GraphShare]] | None
                   ) -> Callable:
    """``compiled``, telling ``step`` of each run that autograd will take a backward through
    (:meth:`StepBudget.ran`: which graphs a step runs, and what each run holds) and releasing
    the run when its backward starts or its autograd graph is freed unused. Under a byte
    ``budget`` a run the ledger asks to plan again (:meth:`StepBudget.run_room`: the graph runs
    several times before a backward) runs a plan made for an earlier run for the same
    activations whose peak fits the room (:func:`_fitting`), or else ``replan(room)``'s graph,
    compiled once per room (the device peak the run may reach); a run no plan fits beside what
    the step holds raises :class:`StormBudgetError` saying so. A run also holds the device
    inputs the step's earlier runs of the graph did not pass (another block's weights, a siamese
    step's second batch): the graph's plan counts one run's inputs. Only a graph the last step
    ran several times records its first run's inputs (a graph run once per step pays nothing);
    in the step that first shows a second run, all of that run's device inputs count."""
    variants: dict[RunRoom, tuple[Callable, GraphShare]] = {}
    inputs_seen: set[int] = set()

    def run(*args: Any) -> Any:
        chosen, planned, fresh = compiled, step.share(graph).planned_bytes, 0
        measured = budget is not None and step.runs_expected(graph) > 1
        if budget is not None and torch.is_grad_enabled():
            room = step.run_room(graph, budget)
            if room is not None:
                if room not in variants:
                    variants[room] = _fitting(variants, room) or _replanned(replan, room,
                                                                            budget)
                    step.saw_peak(graph, variants[room][1].peak_bytes)
                chosen, planned = variants[room][0], variants[room][1].planned_bytes
            held = step.runs_held(graph)
            if measured:
                fresh = _new_inputs(_flat(args), inputs_seen, first=not held)
            elif held:                   # the first run's inputs were not recorded
                fresh = _new_inputs(_flat(args), set(), first=False)
        outputs = chosen(*args)
        if not torch.is_grad_enabled():
            return outputs
        node = next((t.grad_fn for t in tree_leaves(outputs)
                     if isinstance(t, torch.Tensor) and t.grad_fn is not None), None)
        if node is not None:
            release = step.ran(graph, planned, fresh, measured)
            node.register_prehook(lambda grad_outputs: release())
            weakref.finalize(node, release)
        return outputs

    if getattr(compiled, "_boxed_call", False):
        run._boxed_call = True
    return run


def _flat(args: tuple[Any, ...]) -> Sequence[Any]:
    """A compiled graph's inputs, called boxed (one list) or not."""
    return args[0] if len(args) == 1 and isinstance(args[0], list) else args


def _new_inputs(args: Sequence[Any], seen: set[int], first: bool) -> int:
    """Bytes of the device storages among ``args`` not in ``seen`` (which then holds them); a
    ``first`` run starts ``seen`` afresh and counts nothing (its graph's plan counts its
    inputs). With CUDA present, host tensors (streamed weights) are not device storages."""
    if first:
        seen.clear()
    host = "cpu" if torch.cuda.is_available() else None
    fresh = 0
    for arg in args:
        if not isinstance(arg, torch.Tensor) or arg.device.type == host:
            continue
        storage = arg.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            fresh += 0 if first else storage.nbytes()
    return fresh


def _fitting(variants: dict[RunRoom, tuple[Callable, GraphShare]], room: RunRoom
             ) -> tuple[Callable, GraphShare] | None:
    """A plan made for an earlier run of the graph for the same activations as ``room`` whose
    predicted peak fits ``room``; None when there is none.

    The runs of one graph before its backward (identical blocks compiled one by one, each block
    a run) get rooms that shrink by what each run holds, for the same activations but in the
    last run: a plan made for an earlier, larger room serves the later ones as long as its peak
    fits, where planning each run anew compiled the graph once per block."""
    return next((variant for planned_for, variant in variants.items()
                 if planned_for.plan_bytes == room.plan_bytes
                 and variant[1].peak_bytes <= room.peak_bytes), None)


def _replanned(replan: Callable[[RunRoom], tuple[Callable, GraphShare]], room: RunRoom,
               budget: int) -> tuple[Callable, GraphShare]:
    """``replan(room)``; a room no plan fits is the step's budget error, naming the runs that
    took the rest of the budget."""
    try:
        return replan(room)
    except StormBudgetError as error:
        raise StormBudgetError(
            f"{runs_over(budget, budget - room.peak_bytes)} {error}") from error


def _streams(gm: fx.GraphModule) -> bool:
    """Whether dynamo's graph ``gm`` reads weights storm streams."""
    return any(node.target in STREAMED_READS for node in gm.graph.nodes)


def _sent_home(gm: fx.GraphModule, example_inputs: list[Any]) -> list[torch.Tensor]:
    """The trainable weights ``gm`` streams (graph inputs, as Dynamo passes parameters), each
    once, last read first: the gradients its backward sends home, in the order it sends them.
    The backend has the runtime pin their
    buffers while the graph compiles or loads from torch's caches
    (:meth:`~storm_compile.runtime.streams.TransferRuntime.prepare_backward`): a streamed 3B
    Llama's first backward otherwise pinned 197 buffers (6.4 GB) for 2.1 s on the H200 host."""
    values = dict(zip(gm.graph.find_nodes(op="placeholder"), example_inputs))
    seen, weights = set(), []
    for node in gm.graph.nodes:
        weight = values.get(node.args[0]) if node.target in STREAMED_READS else None
        if isinstance(weight, torch.Tensor) and weight.requires_grad and id(weight) not in seen:
            seen.add(id(weight))
            weights.append(weight)
    return weights[::-1]


def _graph_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with a graph of its own (its attributes shared), for compiling once more: a
    compile may rewrite the graph it is given."""
    return fx.GraphModule(gm, copy.deepcopy(gm.graph), gm.__class__.__name__)


class _Decompositions(dict):
    """Inductor's decomposition table less :data:`KEPT_WHOLE`. torch's cache keys pickle it;
    its entries include C++ functions, which have no stable pickle, so it pickles as the call
    that makes it (the call's effect is covered by the key's torch version and storm's
    sources)."""

    def __reduce__(self):
        return _decompositions, ()


def _decompositions() -> _Decompositions:
    """Inductor's decomposition table (as its config selects it now) without
    :data:`KEPT_WHOLE`, whose ops get Inductor's fallback lowering (aten's kernel, contiguous
    inputs, as Inductor gives a backward's implicit fallbacks). Registered here rather than left
    to Inductor's implicit fallback, which torch 2.11 refuses for an op its default table
    decomposes; a graph compiled without storm still decomposes them before lowering."""
    for op in KEPT_WHOLE - inductor_lowering.lowerings.keys():
        inductor_lowering.make_fallback(op, inductor_lowering.require_contiguous, warn=False,
                                        override_decomp=True)
    return _Decompositions((op, fn) for op, fn in select_decomp_table().items()
                           if op not in KEPT_WHOLE)


def inductor_joint_graph(bounds_memory: bool) -> tuple[dict, Callable[[fx.GraphModule], None]]:
    """What Inductor makes of a joint graph before storm's partitioner sees it, for planning
    that does not compile (``storm schedule``): the decomposition table the backend hands
    Inductor (:func:`_decompositions` where storm ``bounds_memory``, else Inductor's own) and
    Inductor's joint-graph passes, which rewrite the joint graph in place. Planned without them,
    the CLI would plan another graph than the backend: an unfused loss gradient (a float32
    zero table of the vocabulary and its scatter) moves the streamed 3B Llama's predicted
    peak by over 2 GiB."""
    return (_decompositions() if bounds_memory else select_decomp_table()), joint_graph_passes


STORM_OPS = (*ops.TRANSFER_OPS, ops.fetch_weight, ops.resident_weight, ops.grad_to_host)
"""Every op storm puts in a graph Inductor compiles."""


@functools.cache
def register_fallbacks() -> None:
    """Give each of :data:`STORM_OPS` Inductor's fallback lowering (the op's own kernel called
    from the compiled graph) with the layout constraint Inductor's implicit fallback would give
    it (a custom op's default layout tag), before Inductor meets it: the lowering is the same,
    without the implicit path's log line. Torch 2.11's Inductor formats that line's arguments,
    the whole IR of the values the op reads, whether or not the line is logged: in the streamed
    8B Llama's backward on the H200 host, the three ops it first met there took 1.8 s of a
    profiled compile. Where this torch lacks either helper, Inductor's implicit fallback
    lowers the ops as before."""
    tag_of, constraint_of = optional("layout_constraint_tag"), optional("tag_to_layout_constraint")
    if tag_of is None or constraint_of is None:
        return
    for op in STORM_OPS:
        if op not in inductor_lowering.lowerings:
            inductor_lowering.make_fallback(op, layout_constraint=constraint_of(tag_of(op)),
                                            warn=False)


def _compile_graph(gm: fx.GraphModule, example_inputs: Any, **kwargs: Any):
    """Inductor's compile of one forward or backward graph, as ``torch.compile`` does it; in a
    graph with storm's transfers, Inductor's peak-memory reordering is followed by
    :func:`~storm_compile.compiler.pin_transfers.pin_transfers`, which puts the copies back where
    storm placed them, and storm's ops lower as :func:`register_fallbacks` registered them.
    Inductor's FX graph cache keys it on the graph and on the Inductor config, which holds
    storm's partitioner: its key covers storm's sources."""
    moves = any(is_transfer(n) for n in gm.graph.nodes)
    if moves and inductor_config.triton.cudagraphs:
        raise StormOptionError(
            "storm: CUDA graphs (mode='reduce-overhead' or 'max-autotune') cannot replay "
            "storm's copies, whose pinned host buffers are taken from a pool at each step; use "
            "mode='max-autotune-no-cudagraphs' or the default mode")
    register_fallbacks()
    with inductor_config.patch(inductor_patches() if moves else {}):
        return compile_fx_inner(gm, example_inputs, **kwargs)


def storm(**options: Any) -> StormBackend:
    """A storm backend with the given options (see :class:`StormConfig`).

    Raises ``ValueError`` naming a bad option and what it allows."""
    return StormBackend(StormConfig.from_options(**options))


def storm_backend(gm: fx.GraphModule, example_inputs: list[Any], mode: str | None = None,
                  options: dict[str, Any] | None = None):
    """The backend registered as ``"storm"``: storm with default options, or with
    ``torch.compile``'s ``mode`` and ``options`` (exactly ``storm(mode=mode, **options)``)."""
    return _default_backend()(gm, example_inputs, mode=mode, options=options)


@functools.cache
def _default_backend() -> StormBackend:
    return storm()
