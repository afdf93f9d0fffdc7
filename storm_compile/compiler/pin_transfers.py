"""Keep Inductor's peak-memory reordering in graphs with storm's transfers, copies pinned.

Inductor's ``reorder_for_peak_memory`` moves allocating kernels late and freeing kernels early.
Left alone in a graph with storm's transfers it puts a prefetch (it allocates) next to its wait
and an offload's wait (it frees) next to its offload, so the copies no longer overlap compute
(measured on the gpt benchmark: copy overlap 0.93 → 0.48, step +8 %). Turning it off for those
graphs gives up what it saves elsewhere (a U-Net's peak +3.5 % over torch.compile's).

:func:`pin_transfers` runs after that reordering, as the one pass of Inductor's
``reorder_for_compute_comm_overlap_passes`` hook (see :func:`inductor_patches`), and puts each
transfer kernel back right after its *anchor*: the last compute node before it in the FX graph
that storm's ``insert_transfers`` wrote. Compute kernels keep the order Inductor chose. The
``wait_event`` of a copy home (an offload or a gradient's send) also keeps the compute storm
put between its copy and it: when Inductor runs that compute before the copy's anchor (it moves
a weight's gradient matmul after the next matmul, which is what storm hid the gradient's copy
home under), the wait goes after the kernels past the copy whose predicted compute time (the
cost model's, on their FX nodes) reaches that of the compute between them in the FX graph,
instead of right after the copy, where the compute stream would stall for the whole copy.

Assumes: the scheduler nodes are in a legal order, and each node's ``unmet_dependencies`` name
every buffer or operation it must follow (Inductor's own reorderings rely on the same).
Guarantees: the result is a topological order of the same nodes; compute kernels (other than
:func:`weight_work`'s and those that read it) appear in their input order; a kernel that reads
weight work goes right after it, among the transfers placed there in FX order, unless Inductor
ran it earlier; each transfer kernel appears as soon after
its anchor's kernel (for a copy home's wait, and after the kernels that keep its copy's
overlap) as its dependencies allow
(never before a kernel it reads, never after a kernel that reads it), or right before the
first compute kernel that reads it (directly or through other transfers) or, but for a copy
home's wait, the kernel of its *successor* (the first compute node after it in the FX graph),
when Inductor put that kernel before the anchor's. Inductor fuses a gate's activation into the
kernel that multiplies it by the up projection, after that matmul: a prefetch storm put
between the activation and the matmul, anchored after the fused kernel, started its copy only
when the matmul ended. A prefetch's wait anchored after a node that Inductor ran
late (one only saved for the backward) would otherwise hold back its reader and every kernel
after it, and the prefetches of later layers would run first (Inductor's CPU kernels of the
built-in gpt have such waits). Inductor's ``MultiOutput`` that hands out what a transfer's
fallback kernel returned moves with that transfer and reads nothing: under Inductor's
breadth-first order, which runs every prefetch and its hand-out first, it is what would
otherwise pin each prefetch to the top (the tiny streamed Llama's forward then held 23
prefetched weights unread where its FX graph holds 3).

Two more kinds of kernel move like transfers (:func:`weight_work`): the copy of a streamed
weight kept on the device (``storm.resident_weight``), and a kernel that computes only on what
storm's copies return and on constants (a quantized weight's dequantization). Such a kernel
reads no activation, so Inductor is free to run it first; left there, it held its weight's
bf16 copy from the graph's top, and as the FX anchor of the next prefetch it pulled that
prefetch to the top with it. An anchor is a node that one kernel computes, in a kernel that
reads more than constants (see :func:`placed`). The kernel that reads such work (the matmul
on a dequantized weight) follows it back, where storm's FX graph has it: at the 70B shape's
LM head Inductor ran the LoRA adapter's product first and the base product after it, so the
dequantized vocabulary matrix (1.96 GiB) was live beside both products' logits (1.96 GiB each),
where storm planned the base product right after the dequantization.
"""

from __future__ import annotations

import bisect
import heapq
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

from torch import fx

from storm_compile.fx.graphs import COST_KEY
from storm_compile.fx.vocabulary import is_view
from storm_compile.runtime import ops
from storm_compile.runtime.ops import TRANSFER_OPS

log = logging.getLogger("storm_compile")

_START = -1
"""Anchor index of a transfer with no compute node before it: it goes first."""

COVER_FRACTION = 1 - 1e-9
"""Compute time summed in another order differs in its last bits: a wait whose kernels reach
the FX graph's time up to rounding keeps its place."""

OUTGOING = (ops.offload, ops.send_grad)
"""The copies home, which a ``wait_event`` waits on through its ``record_event`` only to free
their source: nothing computes on what the wait returns, so it can go later without moving a
compute kernel (a prefetch's wait stays right before the kernel that reads the copy)."""


def _transfer_node(snode: Any) -> fx.Node | None:
    """The FX node of a scheduler node that runs one storm transfer op or only hands out what
    one returned (Inductor's ``MultiOutput`` after a fallback kernel, whose origins are that
    op alone), else None."""
    kernel = getattr(snode, "node", None)
    if kernel is None:
        return None
    origins = list(kernel.get_origins())
    transfers = [n for n in origins if n.target in TRANSFER_OPS]
    runs_one = getattr(kernel, "op_overload", None) in TRANSFER_OPS
    return transfers[0] if transfers and (runs_one or len(transfers) == len(origins)) else None


def _origins(snode: Any) -> list[fx.Node]:
    return [origin for inner in snode.get_nodes() if inner.node is not None
            for origin in inner.node.get_origins()]


def weight_work(graph: fx.Graph) -> tuple[set[fx.Node], set[fx.Node]]:
    """Two sets of FX nodes of ``graph`` that read no graph input, so that Inductor may run
    them anywhere before their first reader: the *work* on storm's copies (the copy of a
    streamed weight kept on the device, ``storm.resident_weight``, and what computes only on
    what storm's copies return and on constants: a quantized weight's dequantization, views
    of a prefetched tensor), and the *free* nodes, which compute from nothing but constants (a
    rotary embedding's table from ``iota``, the copy of a code book that ``lift_fresh_copy``
    makes)."""
    work: set[fx.Node] = set()
    free: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op != "call_function" or node.target in TRANSFER_OPS:
            continue
        inputs = node.all_input_nodes
        if node.target is ops.resident_weight:
            work.add(node)
        elif all(i in free or i.op == "get_attr" for i in inputs):
            free.add(node)
        elif all(i in work or i in free or i.op == "get_attr" or i.target in TRANSFER_OPS
                 for i in inputs):
            work.add(node)
    return work, free


def _pinned_node(snode: Any, work: set[fx.Node], free: set[fx.Node],
                 order: dict[fx.Node, int]) -> fx.Node | None:
    """The FX node by which a scheduler node is placed like a transfer: its transfer op's
    (:func:`_transfer_node`), or, for a kernel that computes :func:`weight_work`'s work and
    nothing but work and free nodes (on the GPU Inductor inlines the code book's copy into
    the dequantization), its last work origin in FX order; None for any other kernel."""
    transfer = _transfer_node(snode)
    if transfer is not None:
        return transfer
    origins = _origins(snode)
    moved = [o for o in origins if o in work]
    return max(moved, key=order.__getitem__) if moved and all(
        o in work or o in free for o in origins) else None


def _is_compute(node: fx.Node, kernel_of: dict[fx.Node, int]) -> bool:
    return node.target not in TRANSFER_OPS and not is_view(node) and node in kernel_of


def _anchor_node(node: fx.Node, kernel_of: dict[fx.Node, int]) -> fx.Node | None:
    """The last compute node before ``node`` in its FX graph (None if there is none)."""
    previous = node.prev
    while previous.op != "root":
        if _is_compute(previous, kernel_of):
            return previous
        previous = previous.prev
    return None


def _anchor(node: fx.Node, kernel_of: dict[fx.Node, int]) -> int:
    """Index of the kernel of the last compute node before ``node`` in its FX graph."""
    anchor = _anchor_node(node, kernel_of)
    return _START if anchor is None else kernel_of[anchor]


def _successor(node: fx.Node, kernel_of: dict[fx.Node, int], end: int) -> int:
    """Index of the kernel of the first compute node after ``node`` in its FX graph (``end``
    if there is none)."""
    following = node.next
    while following.op != "root":
        if _is_compute(following, kernel_of):
            return kernel_of[following]
        following = following.next
    return end


def _copy_of(wait: fx.Node) -> fx.Node | None:
    """The copy home ``wait`` waits on, through its ``record_event``; None if it is not one."""
    record = wait.args[0] if wait.target is ops.wait_event else None
    if isinstance(record, fx.Node) and record.target is ops.record_event:
        copy = record.args[0]
        if isinstance(copy, fx.Node) and copy.target in OUTGOING:
            return copy
    return None


def _seconds(node: fx.Node) -> float:
    """The compute time the cost model predicted for ``node`` (0 for nodes Inductor's own
    passes made)."""
    cost = node.meta.get(COST_KEY)
    return cost.compute_s if cost is not None else 0.0


def _overlap(wait: fx.Node, kernel_of: dict[fx.Node, int], kernels: list[int],
             seconds: dict[int, float]) -> int:
    """Index of the kernel after which ``wait`` keeps its copy's overlap: the first kernel past
    the copy's anchor by which the kernels' predicted compute time reaches that of the compute
    nodes between the copy and the wait in the FX graph (:data:`_START` when that is 0)."""
    copy = _copy_of(wait)
    if copy is None:
        return _START
    between, node = 0.0, copy.next
    while node is not wait and node.op != "root":
        if _is_compute(node, kernel_of):
            between += _seconds(node)
        node = node.next
    if between <= 0.0:
        return _START
    covered = 0.0
    position = bisect.bisect_right(kernels, _anchor(copy, kernel_of))
    for index in kernels[position:]:
        covered += seconds[index]
        if covered >= between * COVER_FRACTION:
            return index
    return kernels[-1]


def _earliest(kernel_of: dict[fx.Node, int]) -> Callable[[fx.Node], int]:
    """For a transfer's FX node, the index of the kernel it goes right after (its anchor's, or
    for a wait the one that keeps its copy's overlap), given each compute node's kernel."""
    kernels = sorted(set(kernel_of.values()))
    seconds = dict.fromkeys(kernels, 0.0)
    for origin, index in kernel_of.items():
        if _is_compute(origin, kernel_of):
            seconds[index] += _seconds(origin)

    def after(node: fx.Node) -> int:
        return max(_anchor(node, kernel_of), _overlap(node, kernel_of, kernels, seconds))
    return after


def _latest(kernel_of: dict[fx.Node, int], end: int) -> Callable[[fx.Node], int]:
    """For a transfer's FX node, the index of the kernel it goes right before at the latest:
    its successor's (:func:`_successor`), the first compute storm put after it, whose time it
    was placed to overlap; ``end`` for the wait of a copy home, which :func:`_earliest` may
    place past later compute to keep that copy's overlap."""
    def before(node: fx.Node) -> int:
        return end if _copy_of(node) is not None else _successor(node, kernel_of, end)
    return before


def dependencies(snodes: list[Any]) -> tuple[dict[int, list[Any]], dict[int, int]]:
    """Each scheduler node's successors (the nodes that depend on it) and the number of nodes
    it depends on, by ``id``, from their ``unmet_dependencies``."""
    producer: dict[str, Any] = {}
    for snode in snodes:
        for name in (*snode.get_buffer_names(), *snode.get_operation_names()):
            producer[name] = snode
    successors: dict[int, list[Any]] = {id(s): [] for s in snodes}
    waiting: dict[int, int] = {}
    for snode in snodes:
        before = {id(producer[d.name]): producer[d.name] for d in snode.unmet_dependencies
                  if d.name in producer and producer[d.name] is not snode}
        waiting[id(snode)] = len(before)
        for pred in before.values():
            successors[id(pred)].append(snode)
    return successors, waiting


def first_readers(snodes: list[Any], transfers: dict[int, fx.Node],
                   successors: dict[int, list[Any]]) -> dict[int, int]:
    """For each transfer kernel of ``snodes`` (a legal order), the index of the first compute
    kernel that reads it, directly or through other transfers (``len(snodes)`` when none)."""
    index = {id(s): i for i, s in enumerate(snodes)}
    first: dict[int, int] = {}
    for snode in reversed(snodes):
        if id(snode) in transfers:
            first[id(snode)] = min((first[id(u)] if id(u) in transfers else index[id(u)]
                                    for u in successors[id(snode)]), default=len(snodes))
    return first


class Placed(NamedTuple):
    """What :func:`placed` finds in one order of scheduler nodes."""

    pinned: dict[int, fx.Node]
    kernel_of: dict[fx.Node, int]
    order: dict[fx.Node, int]


def placed(snodes: list[Any]) -> Placed | None:
    """The scheduler nodes :func:`pin_transfers` places like transfers (by ``id``, with the FX
    node that places each: :func:`_pinned_node`), the index of the kernel that computes each
    FX node the others compute in one kernel, and each FX node's position in its graph; None
    when ``snodes`` runs no storm
    transfer. A kernel that computes only :func:`weight_work`'s free nodes floats (Inductor
    may run a rotary embedding's tables of every layer first) and anchors nothing; nor does a
    node computed in several kernels, which marks no one point of the order: Inductor inlines
    a pointwise node into each kernel that reads it (a cast of the embedding's output, into
    the first norm and the layer's last residual addition), and copies an input of a fallback
    kernel in a kernel of its own, with the fallback's node as its origin, which it may run
    long before the fallback. Inductor also lists among a fallback or extern kernel's origins
    what it inlined into that kernel's inputs: a matmul names the dequantization of the weight it
    reads, which a kernel placed like a transfer computes. Such a node is computed in two
    kernels too, and anchors nothing: as the matmul's, it put the next weight's prefetch, which
    storm placed before that matmul, after it (the copy then started only when the matmul
    ended)."""
    graph = next((t.graph for s in snodes if (t := _transfer_node(s)) is not None), None)
    if graph is None:
        return None
    order = {n: i for i, n in enumerate(graph.nodes)}
    work, free = weight_work(graph)
    pinned = {id(s): t for s in snodes
              if (t := _pinned_node(s, work, free, order)) is not None}
    kernels: dict[fx.Node, set[int]] = {}
    for index, snode in enumerate(snodes):
        origins = _origins(snode)
        if not all(o in free for o in origins):
            for origin in origins:
                kernels.setdefault(origin, set()).add(index)
    return Placed(pinned, {origin: min(found) for origin, found in kernels.items()
                           if len(found) == 1 and id(snodes[min(found)]) not in pinned},
                  order)


def _fx_position(snode: Any, order: dict[fx.Node, int]) -> int:
    """The position in its FX graph of the last node a scheduler node computes."""
    return max((order[o] for o in _origins(snode) if o in order), default=len(order))


def pin_transfers(snodes: list[Any]) -> list[Any]:
    """``snodes`` with every storm transfer kernel, and every kernel :func:`placed` moves with
    them, back after its anchor, and each kernel that reads weight work right after that work
    (see module doc)."""
    found = placed(snodes)
    if found is None:
        return snodes
    transfers, kernel_of, order = found
    successors, waiting = dependencies(snodes)
    after, readers = _earliest(kernel_of), first_readers(snodes, transfers, successors)
    before = _latest(kernel_of, len(snodes))
    key = {id(s): (min((after(t), 1), (readers[id(s)], -1), (before(t), -1)) + (order[t],)
                   if (t := transfers.get(id(s))) is not None else (index, 0, 0))
           for index, s in enumerate(snodes)}
    for snode in snodes:
        if id(snode) in transfers and _transfer_node(snode) is None:
            for reader in successors[id(snode)]:
                if id(reader) not in transfers:
                    follows = key[id(snode)][:2] + (_fx_position(reader, order),)
                    key[id(reader)] = min(key[id(reader)], follows)

    ready = [(key[id(s)], id(s), s) for s in snodes if waiting[id(s)] == 0]
    heapq.heapify(ready)
    result = []
    while ready:
        _, _, snode = heapq.heappop(ready)
        result.append(snode)
        for succ in successors[id(snode)]:
            waiting[id(succ)] -= 1
            if waiting[id(succ)] == 0:
                heapq.heappush(ready, (key[id(succ)], id(succ), succ))
    if len(result) != len(snodes):
        raise RuntimeError(f"storm: pinning transfers found a dependency cycle among "
                           f"{len(snodes) - len(result)} scheduler nodes")
    if log.isEnabledFor(logging.DEBUG):
        _log_placements(snodes, result, transfers, kernel_of, after, before, readers)
    return result


def _log_placements(given: list[Any], result: list[Any], transfers: dict[int, fx.Node],
                    kernel_of: dict[fx.Node, int], after: Callable[[fx.Node], int],
                    before: Callable[[fx.Node], int], readers: dict[int, int]) -> None:
    """One debug line per placed kernel: its FX node, its anchor and that anchor's kernel, the
    kernel it goes before at the latest, its first reader, and where it is and was (the
    anchor's, the successor's, the reader's and where it was index Inductor's order; where it
    is, the result)."""
    now = {id(s): i for i, s in enumerate(result)}
    for was, snode in enumerate(given):
        if id(snode) in transfers:
            node = transfers[id(snode)]
            anchor = _anchor_node(node, kernel_of)
            log.debug("pin_transfers: %s after %s (kernel %d, %d with its overlap), before "
                      "kernel %d, first reader kernel %d: kernel %d of %d, was %d", node.name,
                      anchor.name if anchor is not None else "the start",
                      _START if anchor is None else kernel_of[anchor], after(node),
                      before(node), readers[id(snode)], now[id(snode)], len(result), was)


def inductor_patches() -> dict[str, Any]:
    """Inductor config for a graph with storm's transfers: its peak-memory reordering on,
    then :func:`pin_transfers` (after the user's own comm-overlap passes, if they run any)."""
    from storm_compile.fx.torch_private import inductor_config

    user = (list(inductor_config.reorder_for_compute_comm_overlap_passes)
            if inductor_config.reorder_for_compute_comm_overlap else [])
    return {"reorder_for_compute_comm_overlap": True,
            "reorder_for_compute_comm_overlap_passes": [*user, pin_transfers]}
