"""How long a node computes and a tensor takes to cross the link, from a device profile.

Compute time is a roofline: the larger of FLOPs over the dtype's peak rate, bytes moved over
memory bandwidth, and a launch floor. Bytes moved follow Inductor's fusion: a chain of pointwise
ops and reductions reads its inputs once and writes only what leaves the chain, and pays one
launch. FLOPs come from
``torch.utils.flop_counter``'s formulas. Transfer time is a fixed latency plus bytes over the
direction's bandwidth; when both directions run at once they share ``duplex_bandwidth``.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

import torch
from torch import fx
from torch.utils.flop_counter import flop_registry

from storm_compile.cost.profiles import DeviceProfile
from storm_compile.fx.torch_private import OpOverload, unset_fake_temporarily
from storm_compile.fx.vocabulary import (
    MS,
    Lane,
    hint,
    hint_shape,
    is_compute,
    is_view,
    leaves,
    storage_owner,
    tensor_bytes,
)
from storm_compile.runtime import ops

aten = torch.ops.aten
log = logging.getLogger("storm_compile")

FLOP_ALIASES = {
    aten._scaled_dot_product_flash_attention_for_cpu: aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_flash_attention_for_cpu_backward:
        aten._scaled_dot_product_flash_attention_backward,
}
"""Ops priced with another op's FLOP formula: the CPU flash-attention kernels do the same work
as the CUDA ones, so a schedule traced on a CPU is priced as it would run on the GPU."""

CAUSAL_WORK_FRACTION = 0.5
"""Share of the full attention FLOPs a causal flash-attention kernel does: it skips the blocks
above the diagonal."""

ATTENTION_OPS = frozenset({
    aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_flash_attention_backward,
    aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_efficient_attention_backward,
    aten._scaled_dot_product_cudnn_attention, aten._scaled_dot_product_cudnn_attention_backward,
})
ATTENTION_EFFICIENCY = 0.6
"""Fraction of the dense-matmul rate fused attention kernels reach. Measured on the gpt stack
(d2048, T2048, bf16, H200 trace): 4.2 ms of flash-attention kernels where the matmul rate
predicts 2.6 ms, i.e. 0.61."""

HALF_PRECISION = (torch.bfloat16, torch.float16)


FUSIBLE_REDUCTIONS = frozenset({
    aten.sum.default, aten.sum.dim_IntList, aten.mean.dim, aten.mean.default, aten.amax.default,
    aten.amin.default, aten.var_mean.correction, aten.prod.dim_int,
})
"""Reductions Inductor fuses with the pointwise ops around them."""
FUSIBLE_CASTS = frozenset({aten._to_copy.default})
FUSIBLE_DECOMPOSED = frozenset({
    aten._softmax.default, aten._softmax_backward_data.default, aten._log_softmax.default,
    aten._log_softmax_backward_data.default, aten.nll_loss_forward.default,
    aten.nll_loss_backward.default,
})
"""Ops Inductor decomposes into pointwise ops, gathers and reductions (its decomposition
table), which it fuses like them: a cross-entropy over a large vocabulary writes the logits'
gradient in the logits' dtype, never the float32 log-probabilities or a float32 gradient."""
FUSIBLE_GATHERS = frozenset({aten.index.Tensor, aten.gather.default})
"""Gathers Inductor lowers to an indirect load inside a pointwise kernel, which computes a fused
value only at the gathered indices: rebuilding an nf4 weight (a code book indexed by its 4-bit
codes, scaled, cast) compiles to a kernel splitting the bytes into codes and one gathering,
scaling and casting them, which writes only the rebuilt weight, never the int64 codes or the
float32 values of the code book (12 bytes per element, 4.4 GiB at a 3B model's embedding); a
cross-entropy loss gathers the targets' log-probabilities without writing the float32
log-probabilities of the whole vocabulary (7.8 GiB at 16384 tokens of a 128256-word
vocabulary: the streamed 3B Llama's step at 16384 tokens peaked at 9.33 GiB on the H100, where
writing them would take its loss alone to 11.7 GiB)."""
FUSIBLE_CONSTANTS = frozenset({
    aten.full.default, aten.scalar_tensor.default, torch.ops.prims.iota.default,
    aten.zeros.default, aten.ones.default, aten.full_like.default, aten.zeros_like.default,
    aten.ones_like.default, aten.arange.default, aten.arange.start,
    aten.arange.start_step,
})
"""Constant tensors Inductor lowers to an expression of the index (a fill value, a range), which
it inlines into the kernels that read them like any pointwise value: no buffer read, nothing
written unless an extern kernel or the graph's output takes them. A cross-entropy's backward
compares its labels with an ``iota`` over the vocabulary and selects between two
``scalar_tensor`` values; counted as buffers, those reads made the float32 (tokens ×
vocabulary) one-hot product look written (8 GiB at 16384 tokens of a 128256-word vocabulary)."""


def is_fusible(node: fx.Node) -> bool:
    """Whether Inductor folds ``node`` into a neighbouring kernel: pointwise ops, constants,
    dtype casts and simple reductions. Chains of them run as one kernel that reads the chain's
    inputs once and writes only what leaves the chain."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, OpOverload):
        return False
    return _fusible_op(target)


@functools.cache
def _fusible_op(target: OpOverload) -> bool:
    """:func:`is_fusible` of a call of ``target``: asked for every node by each cost query and
    simulation, and fixed per op (its tags never change), so answered once per op."""
    return (torch.Tag.pointwise in target.tags or target in FUSIBLE_REDUCTIONS
            or target in FUSIBLE_CASTS or target in FUSIBLE_DECOMPOSED
            or target in FUSIBLE_GATHERS or target in FUSIBLE_CONSTANTS)


def materialized(node: fx.Node) -> bool:
    """Whether ``node``'s output is written to device memory (False inside a fused chain).
    Views of it are seen through: Inductor indexes into a fused value as into a buffer."""
    if not is_fusible(node):
        return True
    frontier = [node]
    while frontier:
        current = frontier.pop()
        for user in current.users:
            if is_view(user) and user.args and user.args[0] is current:
                frontier.append(user)
            elif user.op == "output" or not is_fusible(user):
                return True
    return False


CONV_BACKWARD_WORKSPACE = 1.0
"""A half-precision convolution's backward over tensors in (N, C, H, W) order allocates a
workspace of its input's and its output gradient's bytes while it runs (cuDNN on an H200, bf16:
515 MiB for a 384 MiB input and a 128 MiB gradient, 258 MiB for two of 128 MiB); over
channels-last tensors a few MiB."""
ATTENTION_BACKWARD = frozenset({
    aten._scaled_dot_product_flash_attention_backward,
    aten._scaled_dot_product_efficient_attention_backward,
    aten._scaled_dot_product_cudnn_attention_backward,
})
ATTENTION_BACKWARD_ACCUMULATOR = 2.0
"""An attention backward accumulates the query's gradient in float32 while it runs: twice a
half-precision query's bytes (cuDNN on an H200: 37.5 MiB for an 18.5 MiB query)."""


NODES_PER_CONVOLUTION = 300
"""Inductor lays a training graph's convolutions out channels-last unless the graph has this
many nodes per convolution or more (``GraphLowering.decide_layout_opt``, torch 2.11 and 2.13)."""
SMALL_CHANNELS = 64
"""... nor when every convolution has at most this many channels in and out."""


def channels_last_graph(graph: fx.Graph) -> bool:
    """Whether Inductor lays ``graph``'s convolutions out channels-last at its default settings
    (``layout_optimization`` on, not forced): its training heuristic, which declines for few
    convolutions among many nodes, for dynamic shapes, for grouped convolutions, for
    convolutions with twice as many channels in as out (a U-Net's decoder), and for small
    channel counts only."""
    convolutions = graph.find_nodes(op="call_function", target=aten.convolution.default)
    if not convolutions or len(graph.nodes) >= NODES_PER_CONVOLUTION * len(convolutions):
        return False
    if any(isinstance(size, torch.SymInt) for node in convolutions
           for value in (_value(node.args[0]), _value(node.args[1])) for size in value.shape):
        return False
    weights = [(node, _value(node.args[1])) for node in convolutions]
    if any(node.args[-1] > 1 and w.size(1) > 1 for node, w in weights):
        return False
    if any(w.size(0) * 2 <= w.size(1) and w.size(2) > 1 for _, w in weights):
        return False
    return not all(w.size(0) <= SMALL_CHANNELS and w.size(1) <= SMALL_CHANNELS
                   for _, w in weights)


REUSE_READS = 4
"""Inductor's ``realize_reads_threshold`` (torch 2.11 and 2.13): a fused value read by several
nodes is written to memory once its inlined expression reads more than this many buffers. A
group norm's normalized value (its input, mean, inverse deviation, weight and bias) is one: a
recomputed U-Net decoder's float32 value of 768 MiB, written beside its bfloat16 copy."""
REUSE_OPS = 30
"""Inductor's ``realize_opcount_threshold``: a fused value read by several nodes is also written
once its inlined expression holds more than this many ops."""
INLINE_OPS = 100
"""Inductor writes any fused value whose inlined expression holds more than this many ops."""


def realized_values(graph: fx.Graph) -> set[fx.Node]:
    """The call nodes of ``graph`` whose outputs Inductor writes to memory: every
    :func:`materialized` node, and the fused values its lowering writes because several nodes
    read an expression that reads many buffers (:data:`REUSE_READS`) or holds many ops
    (:data:`REUSE_OPS`, :data:`INLINE_OPS`). Reductions count as buffers their readers read.
    One walk in graph order; views read what their base reads."""
    realized: set[fx.Node] = set()
    reads: dict[fx.Node, frozenset[fx.Node]] = {}
    inlined_ops: dict[fx.Node, int] = {}
    for node in graph.nodes:
        if is_view(node):
            base = node.args[0]
            reads[node] = reads.get(base, frozenset((base,)))
            inlined_ops[node] = inlined_ops.get(base, 0)
            continue
        if node.op != "call_function" or not is_fusible(node) or materialized(node):
            if node.op == "call_function":
                realized.add(node)
            reads[node], inlined_ops[node] = frozenset((node,)), 0
            continue
        inputs = node.all_input_nodes
        expression = frozenset().union(*(reads.get(a, frozenset((a,))) for a in inputs))
        count = 1 + sum(inlined_ops.get(a, 0) for a in inputs)
        if node.target in FUSIBLE_REDUCTIONS or count > INLINE_OPS or (
                _reused(node) and (len(expression) > REUSE_READS or count > REUSE_OPS)):
            realized.add(node)
            reads[node], inlined_ops[node] = frozenset((node,)), 0
        else:
            reads[node], inlined_ops[node] = expression, count
    return realized


def _reused(node: fx.Node) -> bool:
    """Whether several nodes read ``node``'s value, directly or through one of its views (each
    view's readers count on their own, as Inductor's lowering counts them)."""
    return len(node.users) > 1 or any(
        is_view(user) and user.args and user.args[0] is node and _reused(user)
        for user in node.users)


def _value(arg):
    return arg.meta.get("val") if isinstance(arg, fx.Node) else arg


def _is_causal(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    for index, argument in enumerate(schema.arguments if schema else ()):
        if argument.name == "is_causal":
            value = node.kwargs.get("is_causal", node.args[index] if index < len(node.args)
                                    else argument.default_value)
            return bool(value)
    return False


HEAD_DIM = 1
"""The heads dimension of an attention op's 4-D (batch, heads, tokens, head size) tensors."""


def _ungrouped(args: list) -> list:
    """An attention op's tensor arguments with grouped key/value heads (grouped-query attention:
    fewer key/value heads than query heads) repeated to the query's, as meta tensors: the work
    each query head does is the same, and torch 2.11's formulas reject unequal heads."""
    heads = max((a.shape[HEAD_DIM] for a in args
                 if isinstance(a, torch.Tensor) and a.dim() == 4), default=0)
    return [torch.empty((*a.shape[:HEAD_DIM], heads, *a.shape[HEAD_DIM + 1:]), dtype=a.dtype,
                        device="meta")
            if isinstance(a, torch.Tensor) and a.dim() == 4 and a.shape[HEAD_DIM] != heads else a
            for a in args]


def node_flops(node: fx.Node) -> int:
    """FLOPs of ``node`` by torch's flop-counter formulas (0 for ops without one)."""
    packet = getattr(node.target, "overloadpacket", None)
    packet = FLOP_ALIASES.get(packet, packet)
    formula = flop_registry.get(packet)
    if formula is None:
        return 0
    args = [_value(a) for a in node.args]
    if packet in ATTENTION_OPS:
        args = _ungrouped(args)
    kwargs = {k: _value(v) for k, v in node.kwargs.items()}
    flops = hint(formula(*args, **kwargs, out_val=node.meta.get("val")))
    return int(flops * CAUSAL_WORK_FRACTION) if _is_causal(node) else int(flops)


MEASURE_REPEATS = 5
"""Timed runs per distinct node in measured mode (after one warm-up); the median is kept."""

MEASURED_MIN_S = 50e-6
"""Ops the roofline prices below this keep the roofline's price under ``cost="measured"``. Timed
alone, a small op's events also hold the host's dispatch of it, tens of µs with the GPU idle,
which a compiled graph, launched ahead of the GPU, does not pay: on the 70B Llama shape's 8
layers (nf4 base, H200) the timed prices of the NF4 code book's copies (``lift_fresh_copy`` of
16 floats, which Inductor folds into the dequantization) came to 18.6 ms of the step, against
0.8 ms by the roofline."""


class MeasuredCosts:
    """A ``CostModel`` override that times each distinct non-fusible op once on ``device`` (the
    GPU; the CPU for ``benchmarks.op_costs``' smoke run).

    It runs inside AOTAutograd's partitioner, where a fake-tensor mode is active; the timing
    steps out of it so the op really runs.

    Inputs are random tensors of the node's shapes, strides and dtypes (integer tensors are
    zeros, so index arguments stay in range). Fusible ops return None: alone they would be
    timed unfused, so the fusion-aware roofline prices them. With a ``roofline``, so do the ops
    it prices below :data:`MEASURED_MIN_S`. An op that cannot be run from its fake arguments is
    logged and priced by the roofline.
    """

    def __init__(self, device: torch.device | str = "cuda",
                 roofline: CostModel | None = None) -> None:
        self.device = torch.device(device)
        self.roofline = roofline
        self._cache: dict[tuple, float | None] = {}

    def _real(self, value):
        if not isinstance(value, torch.Tensor):
            return value
        out = torch.empty_strided(*hint_shape(value), dtype=value.dtype, device=self.device)
        return out.normal_() if out.is_floating_point() else out.zero_()

    def __call__(self, node: fx.Node) -> float | None:
        if is_fusible(node) or not isinstance(node.target, OpOverload):
            return None
        if self.roofline is not None and self.roofline.compute_seconds(node) < MEASURED_MIN_S:
            return None
        key = CostModel.describe(node)
        if key not in self._cache:
            self._cache[key] = self._time(node)
        return self._cache[key]

    def _time(self, node: fx.Node) -> float | None:
        with unset_fake_temporarily():
            return self._run(node)

    def _run(self, node: fx.Node) -> float | None:
        args = [self._real(_value(a)) for a in node.args]
        kwargs = {k: self._real(_value(v)) for k, v in node.kwargs.items()}
        try:
            node.target(*args, **kwargs)
            times = [self._elapsed(node.target, args, kwargs) for _ in range(MEASURE_REPEATS)]
        except (RuntimeError, TypeError, ValueError) as error:
            log.debug("storm: could not time %s (%s); using the roofline", node.target, error)
            return None
        return sorted(times)[len(times) // 2]

    def _elapsed(self, target: Callable, args: list, kwargs: dict) -> float:
        """Seconds of one call: between CUDA events on a GPU, by the host's clock on the CPU
        (where a call returns when its work is done)."""
        if self.device.type != "cuda":
            begin = time.perf_counter()
            target(*args, **kwargs)
            return time.perf_counter() - begin
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        target(*args, **kwargs)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / MS


DESCRIBED_KEY = "storm_described"
"""``node.meta`` key of a node's :meth:`CostModel.describe` and the values it describes."""

DEVICE_ADD_TRAFFIC = 3
"""An in-place addition reads both operands and writes one of them."""


class CostModel:
    """Per-node compute time and per-copy transfer time under one :class:`DeviceProfile`.

    ``override(node)`` may return seconds for a node (e.g. a measured time) or None to use the
    roofline. Estimates are cached by op, input/output shapes, strides and dtypes.
    """

    def __init__(self, profile: DeviceProfile,
                 override: Callable[[fx.Node], float | None] | None = None) -> None:
        self.profile = profile
        self.override = override
        self._cache: dict[tuple, float] = {}

    def _traffic(self, node: fx.Node) -> tuple[int, int]:
        """Bytes ``node`` reads and writes in device memory, counting fusion: a fusible node
        reads only the inputs produced outside its chain and writes only if it ends the chain."""
        out = node.meta.get("val")
        if not is_fusible(node):
            return tensor_bytes([_value(a) for a in node.args]), tensor_bytes(out)
        reads = sum(tensor_bytes(a.meta.get("val")) for a in node.all_input_nodes
                    if not is_fusible(storage_owner(a)))
        return reads, tensor_bytes(out) if materialized(node) else 0

    @staticmethod
    def describe(node: fx.Node) -> tuple:
        """Op, and shapes, strides and dtypes of its arguments and outputs."""
        def describe(value):
            if isinstance(value, torch.Tensor):
                return (*hint_shape(value), value.dtype)
            value = hint(value)
            return value if isinstance(value, (int, float, bool, str, type(None))) else type(value)

        args = tuple(describe(v) for v in leaves([_value(a) for a in node.args]))
        kwargs = tuple((k, describe(v)) for k, v in node.kwargs.items())
        return (node.target, args, kwargs,
                tuple(describe(v) for v in leaves(node.meta.get("val"))))

    def _key(self, node: fx.Node) -> tuple:
        return (*self._described(node), self._traffic(node), materialized(node))

    def _described(self, node: fx.Node) -> tuple:
        """:meth:`describe` of ``node``, kept in its ``meta`` with the values it was made from
        (its own and its inputs'). A copy of a graph shares its nodes' values, and the planner
        prices every copy of the split it searches over; a value that changed, or an input
        replaced by another value, describes the node anew."""
        values = (node.meta.get("val"), *(a.meta.get("val") for a in node.all_input_nodes))
        kept = node.meta.get(DESCRIBED_KEY)
        if kept is not None and len(kept[0]) == len(values) \
                and all(a is b for a, b in zip(kept[0], values)):
            return kept[1]
        described = self.describe(node)
        node.meta[DESCRIBED_KEY] = (values, described)
        return described

    def compute_seconds(self, node: fx.Node) -> float:
        """Seconds ``node`` keeps the compute stream busy (0 for views and graph plumbing). Left
        as traced, a streamed weight's fetch and its gradient's copy home run in program order
        on the compute stream's queue: they cost their link time there, and the gradient also
        its addition on the host, which the copy home waits for."""
        if not is_compute(node) or not hasattr(node.target, "_schema"):
            return 0.0
        if node.target is ops.fetch_weight:
            return self.transfer_seconds(tensor_bytes(node.meta.get("val")), Lane.H2D)
        if node.target is ops.grad_to_host:
            nbytes = tensor_bytes(node.args[0].meta.get("val"))
            return self.transfer_seconds(nbytes, Lane.D2H) + self.host_add_seconds(nbytes)
        if self.override is not None:
            measured = self.override(node)
            if measured is not None:
                return measured
        key = self._key(node)
        if key not in self._cache:
            self._cache[key] = self._roofline(node)
        return self._cache[key]

    def _roofline(self, node: fx.Node) -> float:
        out = node.meta.get("val")
        dtypes = [v.dtype for v in leaves(out) if isinstance(v, torch.Tensor)]
        rate = self.profile.matmul_flops if dtypes and dtypes[0] in HALF_PRECISION \
            else self.profile.fp32_flops
        packet = getattr(node.target, "overloadpacket", None)
        if FLOP_ALIASES.get(packet, packet) in ATTENTION_OPS:
            rate *= ATTENTION_EFFICIENCY
        reads, writes = self._traffic(node)
        launch = self.profile.launch_s if materialized(node) else 0.0
        return max(node_flops(node) / rate, (reads + writes) / self.profile.memory_bandwidth,
                   launch)

    def workspace_bytes(self, node: fx.Node, channels_last: bool) -> int:
        """Device bytes ``node`` allocates for itself while it runs, beside its outputs: a
        half-precision 2-D convolution's backward in a pair Inductor does not lay out channels-last
        (``channels_last``: :func:`channels_last_graph` of its forward;
        :data:`CONV_BACKWARD_WORKSPACE`), and an attention backward's float32 accumulator of the
        query's gradient (:data:`ATTENTION_BACKWARD_ACCUMULATOR`)."""
        packet = getattr(node.target, "overloadpacket", None)
        packet = FLOP_ALIASES.get(packet, packet)
        if packet is aten.convolution_backward:
            grad, value = _value(node.args[0]), _value(node.args[1])
            if value.dim() == 4 and value.dtype in HALF_PRECISION and not channels_last:
                return int(CONV_BACKWARD_WORKSPACE * (tensor_bytes(value) + tensor_bytes(grad)))
            return 0
        if packet in ATTENTION_BACKWARD:
            query = _value(node.args[1])
            return int(ATTENTION_BACKWARD_ACCUMULATOR * tensor_bytes(query))
        return 0

    def device_add_seconds(self, nbytes: int) -> float:
        """Seconds the compute stream takes to add a gradient of ``nbytes`` into its sum on the
        device: :data:`DEVICE_ADD_TRAFFIC` times its bytes through device memory."""
        return max(self.profile.launch_s,
                   DEVICE_ADD_TRAFFIC * nbytes / self.profile.memory_bandwidth)

    def host_add_seconds(self, nbytes: int) -> float:
        """Seconds the host takes to add a gradient of ``nbytes`` into its parameter's grad."""
        return nbytes / self.profile.host_add_bandwidth

    def folds_faster(self, nbytes: int) -> bool:
        """Whether a gradient of ``nbytes`` joins its host sum sooner folded on the device (the
        sum copied in over the link, beside the gradient's own copy home) than added on the
        host: on the H100 the link moves 55 GB/s toward the device, the host adds 16-22 GB/s."""
        return self.transfer_seconds(nbytes, Lane.H2D) < self.host_add_seconds(nbytes)

    def host_step_seconds(self, nbytes: int) -> float:
        """Seconds fused AdamW takes on the host to step a parameter of ``nbytes``."""
        return nbytes / self.profile.host_adamw_bandwidth

    def transfer_seconds(self, nbytes: int, lane: Lane) -> float:
        """Seconds to copy ``nbytes`` alone on ``lane`` (``Lane.H2D`` or ``Lane.D2H``)."""
        return self.profile.copy_latency_s + nbytes / self.bandwidth(lane)

    def bandwidth(self, lane: Lane, shared: bool = False) -> float:
        """Bytes/s of one direction, alone or sharing the link with the other direction."""
        alone = self.profile.h2d_bandwidth if lane is Lane.H2D else self.profile.d2h_bandwidth
        if not shared:
            return alone
        total = self.profile.h2d_bandwidth + self.profile.d2h_bandwidth
        return self.profile.duplex_bandwidth * alone / total
