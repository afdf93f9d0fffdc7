"""Decide, for every storage that may leave the device, whether it stays, is offloaded, or is
recomputed in the backward, to meet the activation-memory budget at the least predicted time.

The model. Removing storage ``i`` (``b_i`` bytes) from the device at the end of the forward costs
  * ``o_i`` if offloaded: the host time of its six transfer ops (``transfer_host_s``, measured by
    ``storm calibrate``: step time when the step is host-bound), plus, when ``place`` says its
    copies cannot hide beside all the others on the link, the D2H copy time (latency + ``b_i`` /
    bandwidth), by which a saturated link stretches the forward;
  * ``r_i`` if recomputed: the predicted compute of its recompute chain (the forward nodes between
    it and the values that stay saved, or the graph inputs); impossible when the chain draws
    random numbers, with ``recompute=False``, or after the re-split.
Each storage's cheap way is ``c_i = min(o_i, r_i)``, and storages are ranked by ``c_i / b_i``.
With a byte target the planner takes the shortest prefix of the ranking whose bytes reach it,
then drops, dearest first, the storages it can do without (so memory lands near the target);
with ``"auto"`` the longest prefix whose cost stays within ``max_overhead`` of the predicted
step; with ``offload="all"`` every storage; with no budget, only offloads whose copies hide,
largest first, while their host time stays within ``NO_BUDGET_SHARE`` of ``max_overhead``.

Why this is near-optimal: meeting a byte target at least cost is a covering knapsack; taking
items by cost per byte solves its fractional relaxation exactly, so the plan costs at most the
relaxation's optimum plus the cost of the last storage taken. ``"auto"`` is the dual knapsack
(most bytes within a cost), with the same one-item bound. The costs are additive because the
hiding test is made with every candidate on the link at once: any subset of the storages that
hide together still hides.

Assumes: ``plan_offload`` marked with ``action == "offload"`` every storage that may move;
``annotate_costs`` ran. On the first split ``graphs.plan`` is None; after ``rematerialize``
re-split the joint graph it holds the plan, and only offloads are chosen again, for the same
target.
Guarantees: ``graphs.plan`` is set (the no-storm baseline prediction, target, minimum, what is
recomputed); every movable storage's decision is ``keep``, ``offload`` or ``recompute``, with
the figures that decided it in ``reason``. Predicted activation memory is at most the target
when one is given. A budget below the minimum raises :class:`StormBudgetError` (a
``ValueError``) stating the minimum.
Emits: no nodes; only decisions change.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import fx

from storm_compile.graphs import (
    COST_KEY,
    DECISION_KEY,
    MemoryPlan,
    PassContext,
    StormGraphs,
    saved_values,
)
from storm_compile.passes.schedule_transfers import Placement, place, storage_groups
from storm_compile.simulate import simulate

GIB = 1 << 30
US = 1e6


NO_BUDGET_SHARE = 0.5
"""Without a budget, memory saved is welcome but not asked for: offloads may spend only this
share of ``max_overhead``, the rest being headroom for the model's error."""


class StormBudgetError(ValueError):
    """The memory budget cannot be met by this graph."""


@dataclasses.dataclass(frozen=True)
class _Item:
    root: fx.Node
    nbytes: int
    recompute_s: float | None
    """None when it cannot be recomputed, for the reason in ``no_recompute``."""
    no_recompute: str
    chain: tuple[fx.Node, ...]
    offload_s: float
    """Predicted step time an offload adds: host time, plus the copy when it cannot hide."""
    hides: bool

    @property
    def action(self) -> str:
        cheaper = self.recompute_s is not None and self.recompute_s < self.offload_s
        return "recompute" if cheaper else "offload"

    @property
    def cost_s(self) -> float:
        return self.recompute_s if self.action == "recompute" else self.offload_s


def _recompute_chain(root: fx.Node, saved: set[fx.Node]) -> tuple[fx.Node, ...] | None:
    """The forward nodes the backward would run to rebuild ``root`` from saved values and graph
    inputs; None if one of them draws random numbers."""
    chain, seen, stack = [], {root}, [root]
    while stack:
        node = stack.pop()
        if node.op != "call_function":
            continue
        if isinstance(node.target, torch._ops.OpOverload) \
                and torch.Tag.nondeterministic_seeded in node.target.tags:
            return None
        chain.append(node)
        for arg in node.all_input_nodes:
            if arg not in seen and arg not in saved:
                seen.add(arg)
                stack.append(arg)
    return tuple(chain)


def _items(graphs: StormGraphs, groups: dict[fx.Node, list[fx.Node]],
           hiding: dict[fx.Node, Placement | str], ctx: PassContext,
           no_recompute: str | None) -> list[_Item]:
    """The storages, ranked by cost per byte; ``no_recompute`` says why none may be
    recomputed, None when they may."""
    saved = set(saved_values(graphs))
    host = ctx.cost.profile.transfer_host_s
    items = []
    for root, members in groups.items():
        chain = None if no_recompute else _recompute_chain(root, saved - {root, *members})
        nbytes = root.meta[DECISION_KEY].storage_bytes
        hides = isinstance(hiding[root], Placement)
        items.append(_Item(
            root=root, nbytes=nbytes,
            recompute_s=None if chain is None else sum(n.meta[COST_KEY].compute_s for n in chain),
            no_recompute=no_recompute or "its recompute chain draws random numbers",
            chain=chain or (), hides=hides,
            offload_s=host + (0.0 if hides else ctx.cost.transfer_seconds(nbytes, "d2h"))))
    return sorted(items, key=lambda i: (i.cost_s / i.nbytes, i.root.name))


def _target(graphs: StormGraphs, ctx: PassContext, baseline_bytes: int) -> int | str | None:
    budget = ctx.config.memory_budget
    if graphs.plan is not None:
        return graphs.plan.target_bytes
    if ctx.config.offload == "all":
        return "all"
    if isinstance(budget, float):
        return int(budget * baseline_bytes)
    return budget


def _decide(root: fx.Node, members: list[fx.Node], action: str, reason: str) -> None:
    for node in (root, *members):
        node.meta[DECISION_KEY] = dataclasses.replace(node.meta[DECISION_KEY], action=action,
                                                      reason=reason)


def _within(items: list[_Item], allowance: float) -> list[_Item]:
    """The longest prefix of ``items`` whose summed cost stays within ``allowance``."""
    taken, spent = [], 0.0
    for item in items:
        if spent + item.cost_s > allowance:
            break
        taken.append(item)
        spent += item.cost_s
    return taken


def _covering(items: list[_Item], need: int) -> list[_Item]:
    """The shortest prefix of ``items`` whose bytes reach ``need``, less the items, dearest per
    byte first, that it still reaches ``need`` without (so memory lands close to the budget)."""
    taken, covered = [], 0
    for item in items:
        if covered >= need:
            break
        taken.append(item)
        covered += item.nbytes
    for item in reversed(list(taken)):
        if covered - item.nbytes >= need:
            taken.remove(item)
            covered -= item.nbytes
    return taken


MAX_PLAN_ROUNDS = 4
"""Rounds of ranking and choosing: storages chosen for recomputation leave the link, so more of
the others may hide, which makes offloading them cheaper; the plan is chosen again with that
until the set of hiding storages stops changing (two or three rounds on transformers)."""


def _select(ranked: list[_Item], target: int | str | None, need: int,
            allowance: float) -> list[_Item]:
    if target is None:
        hidden = sorted((i for i in ranked if i.hides), key=lambda i: -i.nbytes)
        return _within([dataclasses.replace(i, recompute_s=None, no_recompute="no budget set")
                        for i in hidden], NO_BUDGET_SHARE * allowance)
    if target == "auto":
        return _within(ranked, allowance)
    return _covering(ranked, need)


def _better(taken: list[_Item], best: list[_Item] | None, target: int | str | None) -> bool:
    """``"auto"`` maximises bytes within its allowance; every other target minimises cost."""
    if best is None:
        return True
    if target == "auto":
        return sum(i.nbytes for i in taken) > sum(i.nbytes for i in best)
    return sum(i.cost_s for i in taken) < sum(i.cost_s for i in best)


def plan_memory(graphs: StormGraphs, ctx: PassContext) -> StormGraphs:
    first_split = graphs.plan is None
    now = simulate(graphs, ctx.cost)
    baseline = now if first_split else graphs.plan.baseline
    groups = storage_groups(graphs, "offload")
    no_recompute = (None if first_split and ctx.config.recompute
                    else "recompute=False" if first_split
                    else "recomputation was planned on the first split")
    minimum = now.activation_bytes - sum(m[0].meta[DECISION_KEY].storage_bytes
                                         for m in groups.values())
    target = _target(graphs, ctx, baseline.activation_bytes)
    allowance = ctx.config.max_overhead * baseline.step_s
    if target == "all":
        target = minimum
    if isinstance(target, int) and target < minimum:
        raise StormBudgetError(
            f"memory_budget {target} bytes ({target / GIB:.3f} GiB) is below the minimum "
            f"feasible for this graph, {minimum} bytes ({minimum / GIB:.3f} GiB): what must "
            f"stay on the device at the end of the forward (outputs, views of inputs, "
            f"tensors under min_offload_bytes or of dynamic shape)")
    need = now.activation_bytes - target if isinstance(target, int) else 0

    hiding = place(graphs, groups, set(), ctx)
    best = None
    for _ in range(MAX_PLAN_ROUNDS):
        ranked = _items(graphs, groups, hiding, ctx, no_recompute)
        taken = _select(ranked, target, need, allowance)
        if _better(taken, best and best[1], target):
            best = (ranked, taken, hiding)
        recomputed = {i.root for i in taken if i.action == "recompute"}
        if not recomputed:
            break
        on_link = {r: m for r, m in groups.items() if r not in recomputed}
        again = {**hiding, **place(graphs, on_link, set(), ctx)}
        if {r for r, p in again.items() if isinstance(p, Placement)} == \
                {r for r, p in hiding.items() if isinstance(p, Placement)}:
            break
        hiding = again
    ranked, taken, hiding = best
    unmet = {None: "its host time would pass max_overhead",
             "auto": "its cost would pass max_overhead"}.get(target,
                                                             "the budget is met without it")
    if target == "auto":
        target = now.activation_bytes - sum(i.nbytes for i in taken)

    chosen = {i.root: i for i in taken}
    recompute: list[str] = []
    for item in ranked:
        members = groups[item.root]
        way = chosen.get(item.root)
        if way is None:
            why = hiding[item.root]
            _decide(item.root, members, "keep",
                    why if isinstance(why, str) and target is None else unmet)
        elif way.action == "recompute":
            _decide(item.root, members, "recompute",
                    f"rebuilt in {item.recompute_s * US:.0f} µs, below an offload's "
                    f"{item.offload_s * US:.0f} µs")
            recompute += [n.name for n in (*item.chain, *members)]
        else:
            copy = "copies predicted to hide" if item.hides else "link-bound copy"
            alternative = (f"not recomputed: {item.no_recompute}" if way.recompute_s is None
                           else f"recompute would take {item.recompute_s * US:.0f} µs")
            _decide(item.root, members, "offload",
                    f"{copy}, {item.offload_s * US:.0f} µs added; {alternative}")
    if not first_split:
        return graphs
    recomputed = [i for i in taken if i.action == "recompute"]
    return dataclasses.replace(graphs, plan=MemoryPlan(
        baseline=baseline, target_bytes=target, minimum_bytes=minimum,
        recompute=tuple(dict.fromkeys(recompute)),
        recompute_bytes=sum(i.nbytes for i in recomputed),
        recompute_s=sum(i.recompute_s for i in recomputed)))
