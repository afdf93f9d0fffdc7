"""Decide, for every storage that may leave the device, whether it stays, is offloaded, or is
recomputed in the backward, to meet the activation-memory budget at the least predicted time.

The model. Removing storage ``i`` (``b_i`` bytes) from the device at the end of the forward costs
  * ``o_i`` if offloaded: the host time of its six transfer ops (``transfer_host_s``, measured by
    ``storm calibrate``: step time when the step is host-bound), plus, when ``place`` says its
    copies cannot hide beside all the others on the link, the D2H copy time (latency + ``b_i`` /
    bandwidth), by which a saturated link stretches the forward, and, where recomputation is
    being decided, for a storage the search names in ``ctx.limits.link_bound`` (its copies did
    not hide in a realised plan) the H2D copy time too, by which it stretches the backward;
  * ``r_i`` if recomputed: the predicted compute of its recompute chain (the forward nodes between
    it and the values that stay saved, or the graph inputs); impossible when the chain draws
    random numbers or makes a data-dependent choice (``topk``, ``argmax``, ``sort``, the
    indices of ``max``, ``nonzero``: ``vocabulary.CHOICE_OPS``, whose recomputation from
    values a last bit apart could choose differently in the backward), with
    ``recompute=False``, or after ``rematerialize``.
Each storage's cheap way is ``c_i = min(o_i, r_i)``, and storages are ranked by ``c_i / b_i``.
With a byte target the planner takes the shortest prefix of the ranking whose bytes reach it,
then drops, dearest first, the storages it can do without (so memory lands near the target);
with ``"auto"`` the longest prefix whose cost stays within ``max_overhead`` of the predicted
step; with ``offload="all"`` every storage; with no budget, only offloads whose copies hide,
largest first, while their host time stays within ``NO_BUDGET_SHARE`` of ``max_overhead``.
Whatever the goal, the offloads taken hold at most the host's room in pinned memory
(``host_memory_limit`` less the step's other graphs' offloads, in the pool's buckets): past
it, an offload is recomputed instead when it can be (``Figures.host_full``), else refused
(kept, ``Held.HOST_MEMORY``); when refusals leave a byte target unmet, the choice is made
again with the refused storages' room reserved, so that storages which can be recomputed make
way for them.

Why this is near-optimal: meeting a byte target at least cost is a covering knapsack; taking
items by cost per byte solves its fractional relaxation exactly, so the plan costs at most the
relaxation's optimum plus the cost of the last storage taken. ``"auto"`` is the dual knapsack
(most bytes within a cost), with the same one-item bound. The costs are additive because the
hiding test is made with every candidate on the link at once: any subset of the storages that
hide together still hides.

Assumes: ``plan_offload`` built ``graphs.storages`` (every storage that may move is movable);
``annotate_costs`` ran. On the first split ``graphs.plan`` is None; after ``rematerialize``
rebuilt the pair it holds the plan, and only offloads are chosen again, for the same
target.
Guarantees: ``graphs.plan`` is set (the no-storm baseline prediction, target, minimum, what is
recomputed); every movable storage's decision in ``graphs.storages`` is ``keep``, ``offload``
or ``recompute``, with the :class:`~storm_compile.fx.plan.Figures` that decided it, and for a
kept one why it was held (``Held``, or the ``Unplaced`` reason its copies cannot hide).
Predicted activation memory is at most the target when one is given; when the host's room
cannot take what must leave the device, ``StormBudgetError`` names ``host_memory_limit``.
``graphs.share`` is the graph's part of the step as planned (bytes held, minimum, time spent,
pinned host bytes); the pass reads the step's other graphs only through ``ctx.others``
(:class:`~storm_compile.planner.step_budget.StepView`), never writes the step's ledger, and
raises ``StormBudgetError`` (a ``ValueError``) only when a byte budget is below the step's
minimum. A byte budget bounds the device peak: it first pays for what the graph holds there
besides activations (:class:`~storm_compile.weights.streaming.DeviceWeights`: its inputs on
the device, and in a graph that streams weights the prefetch window and the largest streamed
weight), and the rest, less the baseline's peak above its saved activations (the backward's
working set: the loss's logits and their gradient, the gradients it returns), bounds
activations; a budget below those plus the step's activations that cannot move raises
``StormBudgetError`` naming them. ``graphs.share.fixed_bytes`` records the inputs and the
working set. Graphs with
no tensor where storm plans (CPU-only, without ``transfer_cpu_tensors``) are planned as without
a budget.
Emits: no nodes; only decisions change.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import operator
import warnings

import torch
from torch import fx

from storm_compile.cost.placement import place
from storm_compile.cost.simulate import simulate
from storm_compile.fx.graphs import COST_KEY, PassContext, StormGraphs, saved_values
from storm_compile.fx.plan import (
    Action,
    Decision,
    Figures,
    Held,
    MemoryPlan,
    Placement,
    Storage,
    Unplaced,
)
from storm_compile.fx.prediction import Prediction
from storm_compile.fx.torch_private import OpOverload
from storm_compile.fx.vocabulary import Lane, makes_choice, view_chain
from storm_compile.planner.step_budget import GraphShare, StormBudgetError
from storm_compile.runtime.streams import bucket_bytes
from storm_compile.weights.streaming import device_weights

NO_BUDGET_SHARE = 0.5
"""Without a budget, memory saved is welcome but not asked for: offloads may spend only this
share of ``max_overhead``, the rest being headroom for the model's error."""


@dataclasses.dataclass(frozen=True)
class _Item:
    """A movable storage with the figures it is ranked by."""

    storage: Storage
    figures: Figures
    chain: tuple[fx.Node, ...]
    """The forward nodes its recomputation reruns (empty when it cannot be recomputed)."""

    @property
    def root(self) -> fx.Node:
        return self.storage.root

    @property
    def nbytes(self) -> int:
        return self.storage.nbytes

    @property
    def action(self) -> Action:
        return self.figures.cheaper

    @property
    def cost_s(self) -> float:
        return self.figures.cost_s


def _multi_output(node: fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.meta.get("val"), (tuple, list))


def _recompute_chain(root: fx.Node, members: list[fx.Node], saved: set[fx.Node]
                     ) -> tuple[tuple[fx.Node, ...], str | None]:
    """The forward nodes the backward would run to rebuild ``root`` and its saved views
    ``members`` from the values that stay saved (``saved``, less ``root`` and ``members``) and
    graph inputs, with the reason it cannot be rebuilt (then no chain), or None.

    The chain holds the view nodes from ``root`` to each member, and a multi-output op in it
    (``native_layer_norm``, ``topk``, attention, ``unbind``) comes with all of its items: the
    partitioner can only recompute a tuple whole, so the storage cannot be recomputed when
    another item of the same op stays saved."""
    start = [root, *(v for m in members for v in view_chain(m))]
    own = {root, *members}
    chain, seen, stack = [], set(start), list(start)
    while stack:
        node = stack.pop()
        if node.op != "call_function":
            continue
        if isinstance(node.target, OpOverload) \
                and torch.Tag.nondeterministic_seeded in node.target.tags:
            return (), f"its recompute chain draws random numbers ({node.name})"
        if makes_choice(node):
            return (), (f"its recompute chain makes a data-dependent choice ({node.name}), "
                        f"which could differ in the backward")
        chain.append(node)
        items = list(node.users) if _multi_output(node) else []
        kept = [item.name for item in items if item in saved and item not in own]
        if kept:
            return (), (f"{node.name} also produces {', '.join(kept)}, which stays saved: a "
                        f"multi-output op is recomputed whole or not at all")
        for arg in (*node.all_input_nodes, *items):
            if arg not in seen and (arg not in saved or arg in own):
                seen.add(arg)
                stack.append(arg)
    return tuple(chain), None


def _items(graphs: StormGraphs, movable: tuple[Storage, ...],
           hiding: dict[fx.Node, Placement | Unplaced], ctx: PassContext,
           no_recompute: str | None) -> list[_Item]:
    """The storages, ranked by cost per byte; ``no_recompute`` says why none may be
    recomputed, None when they may."""
    saved = set(saved_values(graphs))
    host = ctx.cost.profile.transfer_host_s
    items = []
    for storage in movable:
        chain, why_not = ((), no_recompute) if no_recompute else _recompute_chain(
            storage.root, list(storage.members), saved)
        bound = not no_recompute and storage.root.name in ctx.limits.link_bound
        hides = isinstance(hiding[storage.root], Placement) and not bound
        lanes = (Lane.D2H, Lane.H2D) if bound else () if hides else (Lane.D2H,)
        items.append(_Item(storage, Figures(
            offload_s=host + sum(ctx.cost.transfer_seconds(storage.link_bytes, lane)
                                 for lane in lanes),
            recompute_s=None if why_not else sum(n.meta[COST_KEY].compute_s for n in chain),
            no_recompute=why_not or "", hides=hides), chain))
    return sorted(items, key=_rank)


def _rank(item: _Item) -> tuple[float, str]:
    return item.cost_s / item.nbytes, item.root.name


CHAINED = ("its recomputation would make a chain of two counted links (through a value read "
           "long after it is made): a chain of rebuilds runs at the first use of its last link "
           "and holds the rest until their own uses")
"""Why a storage the selection takes is offloaded instead of recomputed (:class:`_Rebuilds`)."""


def compact_storages(graphs: StormGraphs, movable: tuple[Storage, ...]) -> frozenset[fx.Node]:
    """Roots of the movable storages whose forward lifetime holds no other: no other movable
    storage's root is made between the storage's root and its last forward read, other items
    of the same multi-output op aside (the feed-forward's input norm, up projection and
    activation, each read right after it is made; not a residual sum, read again at the end of
    the next sub-block)."""
    order = {n: i for i, n in enumerate(graphs.forward.graph.nodes)}
    made: dict[fx.Node, list[int]] = {}
    for storage in movable:
        made.setdefault(_producer(storage.root), []).append(order[storage.root])
    every = sorted(p for positions in made.values() for p in positions)
    compact = set()
    for storage in movable:
        start = order[storage.root]
        last = max((order[u] for n in (storage.root, *storage.members) for u in n.users
                    if u.op != "output"), default=start)
        own = sorted(made[_producer(storage.root)])
        if _between(every, start, last) == _between(own, start, last):
            compact.add(storage.root)
    return frozenset(compact)


def _producer(root: fx.Node) -> fx.Node:
    """The op that makes ``root``: its multi-output op for an item of one."""
    return root.args[0] if root.target is operator.getitem else root


def _between(positions: list[int], start: int, end: int) -> int:
    """How many of the sorted ``positions`` lie strictly between ``start`` and ``end``."""
    return max(0, bisect.bisect_left(positions, end) - bisect.bisect_right(positions, start))


@dataclasses.dataclass(eq=False)
class _Rebuild:
    """A taken recomputation: its storage's root, the nodes it rebuilds and the nodes its chain
    reads; and the group it joined through free links (:class:`_Rebuilds`)."""

    root: fx.Node
    nodes: set[fx.Node]
    reads: set[fx.Node]
    group: "_Rebuild | None" = None
    """Another rebuild of its group, towards the one that stands for it (None: this one)."""
    reads_rebuilt: bool = False
    """The group's chains read another group's nodes through a counted link."""
    read_by_rebuild: bool = False
    """Another group's chain reads the group's nodes through a counted link."""

    def head(self) -> "_Rebuild":
        """The rebuild that stands for this one's group, and holds its flags."""
        head = self
        while head.group is not None:
            head = head.group
        return head


@dataclasses.dataclass(frozen=True)
class _Links:
    """How a new rebuild would join the taken ones: the groups it would merge with through
    free links, and those it reads and is read by through counted links."""

    merged: frozenset[_Rebuild]
    reads: frozenset[_Rebuild]
    read_by: frozenset[_Rebuild]

    @property
    def clashes(self) -> bool:
        """Whether the group it would make sits in a chain of two counted links."""
        if self.merged & (self.reads | self.read_by):
            return True
        reads = bool(self.reads) or any(g.reads_rebuilt for g in self.merged)
        read_by = bool(self.read_by) or any(g.read_by_rebuild for g in self.merged)
        return (reads and read_by) or any(g.reads_rebuilt for g in self.reads) \
            or any(g.read_by_rebuild for g in self.read_by)


class _Rebuilds:
    """The recomputations a selection has taken, no group two counted links from another.

    The partitioner rebuilds a chain at the first backward use of anything in it and keeps each
    rebuilt value for its own uses, so a recomputation that reads another one's value brings
    that rebuild forward to its own first use, and holds it from there. Between two
    :func:`compact_storages` that stretch holds no other saved value's use, so such a link is
    free: the feed-forward rebuilt from its input norm, up projection and activation runs at the
    activation's first use, as it would from kept inputs. Rebuilds joined by free links form a
    group; other links count, between groups. One counted link moves a group's rebuild by one
    step (the loss's log-softmax reading the final norm's output); longer counted chains (each
    layer's residual sum rebuilt from the one before, directly or through the sub-block between
    them) are rebuilt together at the top of the backward and held there: on a 1B Llama, a
    budget of 0.3 measured a higher peak than 0.5 before this rule.

    The taken rebuilds are indexed by the nodes they rebuild and the nodes they read, so a
    question costs the size of one chain, not the number taken (an 80-layer model takes
    thousands)."""

    def __init__(self, compact: frozenset[fx.Node] = frozenset()) -> None:
        self._compact = compact
        self._rebuilt_by: dict[fx.Node, list[_Rebuild]] = {}
        self._read_by: dict[fx.Node, list[_Rebuild]] = {}

    @staticmethod
    def _of(item: _Item) -> _Rebuild:
        nodes = {item.root, *item.storage.members, *item.chain}
        return _Rebuild(item.root, nodes,
                        {a for n in item.chain for a in n.all_input_nodes} - nodes)

    def _links(self, new: _Rebuild) -> _Links:
        reads = {id(t): t for n in new.reads for t in self._rebuilt_by.get(n, ())}
        read_by = {id(t): t for n in new.nodes for t in self._read_by.get(n, ())}
        free = new.root in self._compact
        merged = {t.head() for t in (*reads.values(), *read_by.values())
                  if free and t.root in self._compact}
        return _Links(frozenset(merged),
                      frozenset(t.head() for t in reads.values()) - merged,
                      frozenset(t.head() for t in read_by.values()) - merged)

    def clashes(self, item: _Item) -> bool:
        """Whether taking ``item``'s recomputation would put a group in a chain of two counted
        links."""
        return item.action is Action.RECOMPUTE and self._links(self._of(item)).clashes

    def take(self, item: _Item) -> None:
        if item.action is not Action.RECOMPUTE:
            return
        new = self._of(item)
        links = self._links(new)
        for group in links.merged:
            group.group = new
            new.reads_rebuilt |= group.reads_rebuilt
            new.read_by_rebuild |= group.read_by_rebuild
        for group in links.reads:
            group.read_by_rebuild = True
        for group in links.read_by:
            group.reads_rebuilt = True
        new.reads_rebuilt |= bool(links.reads)
        new.read_by_rebuild |= bool(links.read_by)
        for node in new.nodes:
            self._rebuilt_by.setdefault(node, []).append(new)
        for node in new.reads:
            self._read_by.setdefault(node, []).append(new)


def _offloaded(item: _Item) -> _Item:
    """``item`` with recomputation ruled out as :data:`CHAINED`."""
    return dataclasses.replace(item, chain=(), figures=dataclasses.replace(
        item.figures, recompute_s=None, no_recompute=CHAINED))


def _host_bytes(item: _Item) -> int:
    """Pinned host memory ``item``'s offload holds: its pool bucket."""
    return bucket_bytes(item.storage.link_bytes)


def _host_full(item: _Item) -> _Item:
    """``item`` with its offload ruled out: the host has no room left for it."""
    return dataclasses.replace(item, figures=dataclasses.replace(item.figures, host_full=True))


@dataclasses.dataclass(frozen=True)
class _Ways:
    """What a selection may take, in order: ``first``, then ``later``; and what it may not."""

    first: list[_Item]
    later: list[_Item]
    """Those whose recomputation would clash with an earlier one's, offloaded instead, ranked
    again."""
    refused: list[_Item]
    """Offloads past the host's room that cannot be recomputed instead."""


def _unchained(items: list[_Item], room: int, compact: frozenset[fx.Node],
               reserved: frozenset[fx.Node] = frozenset()) -> _Ways:
    """``items`` split into :class:`_Ways`, their offloads holding at most ``room`` bytes of
    pinned host memory together: an offload past it is recomputed instead when it can be (and
    its recomputation clashes with none taken, :class:`_Rebuilds` over ``compact``), else
    refused. The room of the storages ``reserved`` (roots) is kept for them until they come:
    no other offload takes it."""
    pending = sum(_host_bytes(i) for i in items if i.root in reserved)
    rebuilds, first, later, refused, held = _Rebuilds(compact), [], [], [], 0
    for item in items:
        own = _host_bytes(item) if item.root in reserved else 0
        pending -= own
        if item.action is Action.OFFLOAD and held + _host_bytes(item) + pending > room:
            if item.figures.recompute_s is None:
                refused.append(item)
                continue
            item = _host_full(item)
        if rebuilds.clashes(item):
            if item.figures.host_full:
                refused.append(item)
            else:
                later.append(_offloaded(item))
                pending += own
            continue
        rebuilds.take(item)
        first.append(item)
        held += _host_bytes(item) if item.action is Action.OFFLOAD else 0
    fitting = []
    for item in sorted(later, key=_rank):
        pending -= _host_bytes(item) if item.root in reserved else 0
        if held + _host_bytes(item) + pending > room:
            refused.append(item)
        else:
            fitting.append(item)
            held += _host_bytes(item)
    return _Ways(first, fitting, refused)


UNPLANNED_DEVICE = (
    "storm: memory_budget and offload='all' do nothing for a graph that saves no tensor on a "
    "CUDA device (a model on the CPU): storm plans device memory, and this graph compiles "
    "unchanged; move the model and its inputs to the GPU, or pass transfer_cpu_tensors=True "
    "to plan the CPU graph as if it ran on the device")
"""Warned when a budget or ``offload="all"`` meets a graph :func:`_plans_device` refuses whose
forward reads no tensor on a CUDA device (:func:`_reads_device`)."""


def _on_cuda(nodes) -> bool:
    """Whether any of ``nodes`` is a tensor on a CUDA device."""
    return any(isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].device.type == "cuda"
               for n in nodes)


def _plans_device(graphs: StormGraphs, ctx: PassContext) -> bool:
    """Whether any saved tensor lives where storm plans (a CUDA device, or any device with
    ``transfer_cpu_tensors``); CPU-only graphs compile unchanged, budget or not."""
    return ctx.config.transfer_cpu_tensors or _on_cuda(saved_values(graphs))


def _reads_device(graphs: StormGraphs) -> bool:
    """Whether the forward reads a tensor on a CUDA device: a graph of a model on the GPU that
    saves nothing there (a piece between graph breaks) is not a model on the CPU."""
    return _on_cuda(graphs.forward.graph.find_nodes(op="placeholder"))


class Goal(enum.Enum):
    """What the plan aims at."""

    HIDDEN = "hidden"
    """No budget: only offloads whose copies hide, within part of ``max_overhead``."""
    AUTO = "auto"
    """The most bytes whose cost stays within ``max_overhead``."""
    BYTES = "bytes"
    """A number of activation bytes, at the least cost."""


@dataclasses.dataclass(frozen=True)
class _Target:
    goal: Goal
    nbytes: int | None = None
    """Activation bytes to reach (``Goal.BYTES`` only)."""
    over_bytes: int = 0
    """How far a byte budget is then exceeded (:attr:`GraphShare.over_bytes`)."""


def _target(graphs: StormGraphs, ctx: PassContext, baseline: Prediction,
            minimum: int) -> _Target:
    budget = ctx.memory_budget
    if graphs.plan is not None:
        reached = graphs.plan.target_bytes
        return _Target(Goal.HIDDEN) if reached is None else _Target(Goal.BYTES, reached)
    if not _plans_device(graphs, ctx):
        if (budget.given or ctx.config.offload == "all") and not _reads_device(graphs):
            warnings.warn(UNPLANNED_DEVICE, RuntimeWarning, stacklevel=2)
        return _Target(Goal.HIDDEN)
    if not budget.given and ctx.config.offload != "all":
        return _Target(Goal.HIDDEN)
    if ctx.config.offload == "all":
        return _Target(Goal.BYTES, minimum)
    if budget.auto:
        return _Target(Goal.AUTO)
    if budget.nbytes is None:                        # a fraction bounds activations only
        aim = ctx.others.target_bytes(budget, baseline.activation_bytes, minimum)
        return _Target(Goal.BYTES, aim.nbytes, aim.over_bytes)
    weights = device_weights(graphs.forward, ctx.prefetch_window_bytes)
    aim = ctx.others.target_bytes(budget, baseline.activation_bytes, minimum, weights.nbytes,
                                  working_bytes(baseline), weights.describe())
    return _Target(Goal.BYTES, aim.nbytes, aim.over_bytes)


def working_bytes(baseline: Prediction) -> int:
    """The backward's working set: its predicted peak above the activations the forward saved
    (the loss's logits and their gradient, the gradients it returns, what it rebuilds)."""
    return max(0, baseline.peak_bytes - baseline.activation_bytes)


def _within(items: list[_Item], allowance: float, room: int, compact: frozenset[fx.Node]
            ) -> tuple[list[_Item], list[_Item]]:
    """The longest prefix of ``items`` (:func:`_unchained` with ``room``) whose summed cost
    stays within ``allowance``, and the items refused for the host's room."""
    ways = _unchained(items, room, compact)
    taken, spent = [], 0.0
    for item in (*ways.first, *ways.later):
        if spent + item.cost_s > allowance:
            break
        taken.append(item)
        spent += item.cost_s
    return taken, ways.refused


def _covering(items: list[_Item], need: int, room: int, compact: frozenset[fx.Node]
              ) -> tuple[list[_Item], list[_Item]]:
    """The shortest prefix of ``items`` (:func:`_unchained` with ``room``) whose bytes reach
    ``need``, less the items, dearest per byte first, that it still reaches ``need`` without
    (so memory lands close to the budget); and the items refused for the host's room.

    When the host's room refused storages that cannot be recomputed and the prefix falls
    short, the choice is made again with their room reserved, so that storages which can be
    recomputed are recomputed to make way for them, until it reaches ``need`` or refuses no
    new storage."""
    reserved: frozenset[fx.Node] = frozenset()
    while True:
        ways = _unchained(items, room, compact, reserved)
        taken, covered = [], 0
        for item in (*ways.first, *ways.later):
            if covered >= need:
                break
            taken.append(item)
            covered += item.nbytes
        refused = reserved | {i.root for i in ways.refused}
        if covered >= need or refused == reserved:
            break
        reserved = refused
    for item in reversed(list(taken)):
        if covered - item.nbytes >= need:
            taken.remove(item)
            covered -= item.nbytes
    return taken, ways.refused


MAX_PLAN_ROUNDS = 4
"""Rounds of ranking and choosing: storages chosen for recomputation leave the link, so more of
the others may hide, which makes offloading them cheaper; the plan is chosen again with that
until the set of hiding storages stops changing (two or three rounds on transformers)."""


def _select(ranked: list[_Item], target: _Target, need: int, allowance: float,
            room: int, compact: frozenset[fx.Node]) -> tuple[list[_Item], list[_Item]]:
    """The items taken, and those refused for the host's ``room``."""
    if target.goal is Goal.HIDDEN:
        hidden = sorted((i for i in ranked if i.figures.hides), key=lambda i: -i.nbytes)
        return _within([dataclasses.replace(i, figures=dataclasses.replace(
            i.figures, recompute_s=None, no_recompute="no budget set")) for i in hidden],
            NO_BUDGET_SHARE * allowance, room, compact)
    if target.goal is Goal.AUTO:
        return _within(ranked, allowance, room, compact)
    return _covering(ranked, need, room, compact)


def _host_full_error(need: int, covered: int, room: int, ctx: PassContext) -> str:
    asked = ("offload='all'" if ctx.config.offload == "all"
             else f"memory_budget {ctx.memory_budget}")
    return (f"{asked}: {need} bytes of activations must leave the device, but only "
            f"{covered} can: pinned host memory has room for {max(room, 0)} bytes of this "
            f"graph's offloads (host_memory_limit {ctx.config.host_memory_limit} bytes, less "
            f"what the step's other graphs offload), and the rest cannot be recomputed. Raise "
            f"host_memory_limit, allow recompute, or use fewer tokens per micro-batch")


def _better(taken: list[_Item], best: list[_Item] | None, target: _Target) -> bool:
    """``"auto"`` maximises bytes within its allowance; every other target minimises cost."""
    if best is None:
        return True
    if target.goal is Goal.AUTO:
        return sum(i.nbytes for i in taken) > sum(i.nbytes for i in best)
    return sum(i.cost_s for i in taken) < sum(i.cost_s for i in best)


def plan_memory(graphs: StormGraphs, ctx: PassContext) -> StormGraphs:
    first_split = graphs.plan is None
    now = simulate(graphs, ctx.cost)
    baseline = now if first_split else graphs.plan.baseline
    storages = graphs.storages
    movable = storages.movable()
    no_recompute = (None if first_split and ctx.recompute
                    else "recompute=False" if first_split
                    else "recomputation was planned on the first split")
    minimum = now.activation_bytes - sum(s.nbytes for s in movable)
    if not first_split:
        minimum = graphs.plan.minimum_bytes
    target = _target(graphs, ctx, baseline, minimum)
    allowance = (ctx.others.allowance_s(baseline.step_s, ctx.config.max_overhead)
                 if target.goal is Goal.AUTO else ctx.config.max_overhead * baseline.step_s)
    need = now.activation_bytes - target.nbytes if target.goal is Goal.BYTES else 0
    room = ctx.others.host_room(ctx.config.host_memory_limit)

    hiding = place(graphs, movable, set(), ctx).storages
    compact = compact_storages(graphs, movable)
    best = None
    for _ in range(MAX_PLAN_ROUNDS):
        ranked = _items(graphs, movable, hiding, ctx, no_recompute)
        taken, refused = _select(ranked, target, need, allowance, room, compact)
        if _better(taken, best and best[1], target):
            best = (ranked, taken, hiding, refused)
        recomputed = {i.root for i in taken if i.action is Action.RECOMPUTE}
        if not recomputed:
            break
        on_link = [s for s in movable if s.root not in recomputed]
        again = {**hiding, **place(graphs, on_link, set(), ctx).storages}
        if {r for r, p in again.items() if isinstance(p, Placement)} == \
                {r for r, p in hiding.items() if isinstance(p, Placement)}:
            break
        hiding = again
    ranked, taken, hiding, refused = best
    covered = sum(i.nbytes for i in taken)
    if covered < need:
        raise StormBudgetError(_host_full_error(need, covered, room, ctx))
    unmet = {Goal.HIDDEN: Held.HOST_TIME, Goal.AUTO: Held.COST,
             Goal.BYTES: Held.BUDGET_MET}[target.goal]
    no_room = {i.root for i in refused}
    target_bytes = (now.activation_bytes - sum(i.nbytes for i in taken)
                    if target.goal is Goal.AUTO else target.nbytes)

    chosen = {i.root: i for i in taken}
    decisions: dict[fx.Node, Decision] = {}
    recompute: list[str] = []
    for item in ranked:
        way = chosen.get(item.root)
        eligibility = item.storage.eligibility
        if way is None:
            why = hiding[item.root]
            held = (Held.HOST_MEMORY if item.root in no_room
                    else why if isinstance(why, Unplaced) and target.goal is Goal.HIDDEN
                    else unmet)
            decisions[item.root] = Decision(Action.KEEP, eligibility, item.figures, held)
        else:
            decisions[item.root] = Decision(way.action, eligibility, way.figures)
            if way.action is Action.RECOMPUTE:
                recompute += [n.name for n in (*way.chain, *item.storage.members)]
    storages = storages.decided(decisions)
    recomputed = [i for i in taken if i.action is Action.RECOMPUTE]
    earlier_s = 0.0 if first_split else graphs.plan.recompute_s
    share = GraphShare(
        baseline_bytes=baseline.activation_bytes, minimum_bytes=minimum,
        planned_bytes=now.activation_bytes - sum(i.nbytes for i in taken),
        baseline_step_s=baseline.step_s,
        spent_s=earlier_s + sum(i.cost_s for i in taken),
        host_bytes=sum(_host_bytes(i) for i in taken if i.action is Action.OFFLOAD),
        over_bytes=target.over_bytes if first_split else graphs.share.over_bytes,
        fixed_bytes=device_weights(graphs.forward, ctx.prefetch_window_bytes).nbytes
        + working_bytes(baseline))
    if not first_split:
        return dataclasses.replace(graphs, storages=storages, share=share)
    return dataclasses.replace(graphs, storages=storages, share=share, plan=MemoryPlan(
        baseline=baseline, target_bytes=target_bytes, minimum_bytes=minimum,
        recompute=tuple(dict.fromkeys(recompute)),
        recompute_bytes=sum(i.nbytes for i in recomputed),
        recompute_s=sum(i.figures.recompute_s for i in recomputed),
        recomputed=tuple((i.storage, decisions[i.root]) for i in recomputed)))
