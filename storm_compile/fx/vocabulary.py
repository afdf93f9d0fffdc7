"""The facts about FX nodes that every pass, the cost model and the simulator share: units,
lanes, sizes at the traced example sizes, views and the node owning a storage, and which nodes
run on the compute stream. It depends on nothing of storm's but its ops.
"""

from __future__ import annotations

import enum
import functools
import operator

import torch
from torch import fx
from torch.utils.flop_counter import flop_registry

from storm_compile.fx.torch_private import OpOverload
from storm_compile.runtime import ops

US = 1e6
"""Microseconds per second."""
MS = 1e3
"""Milliseconds per second."""
KIB, MIB, GIB, TIB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
GB = 1e9
"""Bytes per decimal gigabyte: link and host rates are quoted in GB/s."""


class Lane(str, enum.Enum):
    """Where a node's work runs: the compute stream, one of the two copy streams, or nowhere
    (views and graph plumbing)."""

    COMPUTE = "compute"
    D2H = "d2h"
    H2D = "h2d"
    NONE = "-"

    def __str__(self) -> str:
        return self.value


RECOMPUTE_TAG = "recompute"
"""The ``node.meta`` key AOTAutograd's partitioner reads checkpoint policies from."""

UNBACKED_SIZE_HINT = 8192
"""Size assumed for a data-dependent (unbacked) symbolic size, which has no example value:
Inductor's own default (``unbacked_symint_fallback``) for the same question."""


def hint(value):
    """A plain number for a possibly symbolic int, float or bool, at the example sizes the graph
    was traced with. Never adds a guard: plans made with hints hold for every size the guards
    admit (they change which storages move, never whether the graphs are correct)."""
    if not isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return value
    node = value.node
    if node.has_hint():
        concrete = node.hint
    else:
        concrete = node.shape_env.size_hint(node.expr, allow_none=True)
        if concrete is None:
            concrete = UNBACKED_SIZE_HINT
    kind = {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}[type(value)]
    return kind(concrete)


def hint_shape(value: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The tensor's sizes and strides at the traced example sizes."""
    return (tuple(s if type(s) is int else hint(s) for s in value.shape),
            tuple(s if type(s) is int else hint(s) for s in value.stride()))


def leaves(value) -> list:
    """The values in ``value`` that are not None, lists, tuples (named or not) or dicts, in
    order: ``torch.utils._pytree.tree_leaves`` for the containers a graph's arguments and
    example values are made of, at a fraction of its cost (the cost model asks for every node
    of every plan the search makes)."""
    if not isinstance(value, (list, tuple, dict)):
        return [] if value is None else [value]
    found, stack = [], [value]
    while stack:
        current = stack.pop()
        if isinstance(current, dict):
            stack.extend(reversed(list(current.values())))
        elif isinstance(current, (list, tuple)):
            stack.extend(reversed(current))
        elif current is not None:
            found.append(current)
    return found


def tensor_bytes(value) -> int:
    """Bytes of every tensor in ``value`` (a tensor, or nested lists/tuples/dicts of them), at
    the traced example sizes; non-tensors count 0."""
    if isinstance(value, torch.Tensor):
        return hint(value.numel()) * value.element_size()
    return sum(hint(v.numel()) * v.element_size() for v in leaves(value)
               if isinstance(v, torch.Tensor))


def is_dense(value: torch.Tensor) -> bool:
    """Whether the tensor's elements fill its storage span exactly, in some dimension order
    (judged at the traced example sizes)."""
    expected = 1
    shape, strides = hint_shape(value)
    for stride, size in sorted((st, sz) for sz, st in zip(shape, strides) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def node_order(gm: fx.GraphModule) -> dict[fx.Node, int]:
    """Each node's position in its graph."""
    return {n: i for i, n in enumerate(gm.graph.nodes)}


def is_transfer(node: fx.Node) -> bool:
    """Whether the node is one of storm's transfer ops (copies and their events)."""
    return node.op == "call_function" and node.target in ops.TRANSFER_OPS


COPY_LANES = {ops.offload: Lane.D2H, ops.send_grad: Lane.D2H, ops.prefetch: Lane.H2D}
"""Storm's copy ops and the copy stream each runs on."""

WEIGHT_ARG = 2
"""Where ``storm.send_grad``'s weight is, after the gradient and the host limit."""
SUMMED_ARG = 3
"""Where ``storm.send_grad``'s ``summed`` is, after the gradient, the host limit and the weight."""


def folds_on_device(node: fx.Node) -> bool:
    """Whether ``node`` is a ``storm.send_grad`` given its weight and not ``summed``: in a step's
    last backward its gradient is folded into the weight's host sum on the device."""
    return node.target is ops.send_grad and len(node.args) > WEIGHT_ARG \
        and not sums_on_device(node)


def sums_on_device(node: fx.Node) -> bool:
    """Whether ``node`` is a ``storm.send_grad`` given ``summed``: the gradients it sends are
    summed on the device across a step's backwards and go home once."""
    return node.target is ops.send_grad and len(node.args) > SUMMED_ARG \
        and bool(node.args[SUMMED_ARG])


UNANNOTATED_VIEWS = (torch.ops.aten._unsafe_view.default,)
"""Ops whose output shares its input's storage although their schema declares a fresh tensor."""


def is_view(node: fx.Node) -> bool:
    """Whether the node's output shares storage with its first input: view ops, items of a
    view op's list output, ``_unsafe_view``, and storm's ``record_event``/``wait_event``."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        source = node.args[0]
        return isinstance(source, fx.Node) and is_view(source)
    return _returns_view(node.target)


@functools.cache
def _returns_view(target) -> bool:
    """Whether a call of ``target`` returns a view of an input: one of
    :data:`UNANNOTATED_VIEWS`, or an op whose schema says an output aliases an input without
    writing it. Asked for every node by every pass and simulation, so answered once per op."""
    if target in UNANNOTATED_VIEWS:
        return True
    schema = getattr(target, "_schema", None)
    return schema is not None and any(r.alias_info is not None and not r.alias_info.is_write
                                      for r in schema.returns)


CHOICE_OPS = frozenset(packet for packet in (
    getattr(torch.ops.aten, name, None) for name in (
        "topk", "sort", "argsort", "argmax", "argmin", "max", "min", "kthvalue", "mode",
        "median", "nanmedian", "cummax", "cummin", "nonzero", "nonzero_static", "unique_dim",
        "_unique2", "unique_consecutive", "searchsorted", "bucketize"))
    if packet is not None)
"""Ops whose output is a choice made by comparing values: which entries (``topk``, ``sort``,
``argmax``, the indices of ``max.dim``, ``nonzero``), not only how much. Recomputed in the
backward from values that differ in the last bit (another kernel, another fusion, another
order of a sum), such a choice can flip: a router would send a token to other experts in the
backward than in the forward, and the gradients would belong to neither."""


def makes_choice(node: fx.Node) -> bool:
    """Whether ``node`` calls one of :data:`CHOICE_OPS` (any overload: ``max.dim`` chooses,
    and so is counted, as does plain ``max``, whose value is one of its inputs')."""
    packet = getattr(node.target, "overloadpacket", None)
    return node.op == "call_function" and packet in CHOICE_OPS


def is_compute(node: fx.Node) -> bool:
    """Whether the node launches work on the compute stream: a call that is not a view, an
    item of a tuple, or a storm transfer."""
    return (node.op == "call_function" and node.target is not operator.getitem
            and not is_view(node) and not is_transfer(node))


def view_chain(node: fx.Node) -> list[fx.Node]:
    """The view nodes from the storage owner (exclusive) down to ``node`` (inclusive), in order."""
    chain = []
    while is_view(node):
        chain.append(node)
        node = node.args[0]
    return chain[::-1]


def storage_owner(node: fx.Node) -> fx.Node:
    """The node that owns the storage ``node`` reads (``node`` itself unless it is a view)."""
    chain = view_chain(node)
    return chain[0].args[0] if chain else node


def view_closure(node: fx.Node, order: dict[fx.Node, int]) -> tuple[list[fx.Node], list[fx.Node]]:
    """The views of ``node`` reached through views only, and the non-view users of ``node`` and
    of those views (the nodes that read its data), both sorted by ``order`` (the graph's node
    positions)."""
    views, readers, frontier = [], set(), [node]
    while frontier:
        current = frontier.pop()
        for user in current.users:
            if is_view(user) and user.args and user.args[0] is current:
                views.append(user)
                frontier.append(user)
            else:
                readers.add(user)
    return sorted(views, key=order.__getitem__), sorted(readers, key=order.__getitem__)


def is_constant(node: fx.Node, constants: set[fx.Node]) -> bool:
    """Whether ``node`` is a constant of the graph (a ``get_attr``, such as a code book), or
    made from ``constants`` alone by an op that draws no random numbers."""
    if node.op == "get_attr":
        return True
    return (node.op == "call_function" and isinstance(node.target, OpOverload)
            and torch.Tag.nondeterministic_seeded not in node.target.tags
            and all(i in constants for i in node.all_input_nodes))


def graph_constants(graph: fx.Graph) -> set[fx.Node]:
    """The nodes of ``graph`` that are constants (:func:`is_constant`)."""
    constants: set[fx.Node] = set()
    for node in graph.nodes:
        if is_constant(node, constants):
            constants.add(node)
    return constants


def rebuilds_weight(node: fx.Node, fetched: set[fx.Node], constants: set[fx.Node]) -> bool:
    """Whether ``node`` computes only from ``fetched`` weights (at least one) and
    ``constants``, cheaply: an op without a FLOP formula (a copy, a view, a cast, the ops that
    rebuild a packed weight), never a matmul or what reads the batch."""
    inputs = node.all_input_nodes
    return (node.op == "call_function" and any(i in fetched for i in inputs)
            and all(i in fetched or i in constants for i in inputs)
            and getattr(node.target, "overloadpacket", None) not in flop_registry)
