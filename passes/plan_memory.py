"""Decide, for every storage that may leave the device, whether it stays, is offloaded, or is
recomputed in the backward, to meet the activation-memory budget at the least predicted time.

The model. Removing storage ``i`` (``b_i`` bytes) from the device at the end of the forward costs
  * nothing if it is offloaded and both copies hide under compute (``place`` decides which do:
    the link is a shared, ordered resource, so hiding depends on what else is on it);
  * ``r_i``, the predicted compute of its recompute chain (the forward nodes between it and the
    values already saved or the graph inputs), if recomputed; None when the chain draws random
    numbers;
  * ``e_i``, the D2H copy time (latency + ``b_i`` / bandwidth), if offloaded without hiding: once
    the link is saturated each extra copy stretches the forward by its duration.
Each storage's cheap way is ``c_i = min(r_i, e_i)``. The planner ranks storages by ``c_i / b_i``
and takes a prefix of that ranking the cheap way; everything outside the prefix that ``place``
says would hide is offloaded for free. With a byte target it takes the shortest prefix that
reaches it (then only as many free offloads, in production order, as the target still needs);
with ``"auto"`` the longest prefix whose cost stays within ``max_overhead`` of the predicted step;
with ``offload="all"`` the shortest prefix that moves everything. Covered bytes never fall as the
prefix grows (a storage taken off the link frees link time for the ones after it), so each
search is a bisection over the prefix length: ``O(log n)`` placements.

Why this is near-optimal: with the set of hidden offloads fixed, choosing what else to remove is
a covering knapsack (reach ``need`` bytes at least cost); taking items by cost per byte solves
its fractional relaxation exactly, so the plan costs at most the relaxation's optimum plus the
cost of one storage, the last one taken. Ranking hidden candidates together with the rest hands
the link to the storages that are dearest to remove otherwise, since a cheap storage taken off
the link lets a later, dearer one hide instead.

Assumes: ``plan_offload`` marked with ``action == "offload"`` every storage that may move;
``annotate_costs`` ran. Recomputation is considered only with ``recompute=True``. On the first split, ``graphs.plan`` is None; after ``rematerialize``
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


def _items(graphs: StormGraphs, groups: dict[fx.Node, list[fx.Node]], ctx: PassContext,
           no_recompute: str | None) -> list[_Item]:
    """The storages, ranked by cost per byte; ``no_recompute`` says why none may be
    recomputed, None when they may."""
    may_recompute = no_recompute is None
    saved = set(saved_values(graphs))
    items = []
    for root, members in groups.items():
        chain = _recompute_chain(root, saved - {root, *members}) if may_recompute else None
        items.append(_Item(
            root=root, nbytes=root.meta[DECISION_KEY].storage_bytes,
            recompute_s=None if chain is None else sum(n.meta[COST_KEY].compute_s for n in chain),
            no_recompute=(no_recompute if not may_recompute
                          else "its recompute chain draws random numbers"),
            chain=chain or (),
            offload_s=ctx.cost.transfer_seconds(root.meta[DECISION_KEY].storage_bytes, "d2h")))
    return sorted(items, key=lambda i: (i.cost_s / i.nbytes, i.root.name))


class _Evaluation:
    """Placements for prefixes of the ranking, computed once each."""

    def __init__(self, graphs: StormGraphs, groups, ranked: list[_Item], ctx: PassContext):
        self.graphs, self.groups, self.ranked, self.ctx = graphs, groups, ranked, ctx
        self.cache: dict[int, dict[fx.Node, Placement | str]] = {}

    def placements(self, k: int) -> dict[fx.Node, Placement | str]:
        if k not in self.cache:
            prefix = self.ranked[:k]
            recomputed = {i.root for i in prefix if i.action == "recompute"}
            required = {i.root for i in prefix if i.action == "offload"}
            on_link = {r: m for r, m in self.groups.items() if r not in recomputed}
            self.cache[k] = place(self.graphs, on_link, required, self.ctx)
        return self.cache[k]

    def hidden(self, k: int) -> list[_Item]:
        prefix = {i.root for i in self.ranked[:k]}
        placed = self.placements(k)
        return [i for i in self.ranked if i.root not in prefix
                and isinstance(placed.get(i.root), Placement)]

    def covered(self, k: int) -> int:
        return sum(i.nbytes for i in self.ranked[:k]) + sum(i.nbytes for i in self.hidden(k))

    def cost(self, k: int) -> float:
        return sum(i.cost_s for i in self.ranked[:k])


def _first(low: int, high: int, ok) -> int:
    """The least k in [low, high] with ok(k), for ok monotone (False then True); high if none."""
    while low < high:
        mid = (low + high) // 2
        if ok(mid):
            high = mid
        else:
            low = mid + 1
    return low


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


def plan_memory(graphs: StormGraphs, ctx: PassContext) -> StormGraphs:
    first_split = graphs.plan is None
    now = simulate(graphs, ctx.cost)
    baseline = now if first_split else graphs.plan.baseline
    groups = storage_groups(graphs, "offload")
    no_recompute = (None if first_split and ctx.config.recompute
                    else "recompute=False" if first_split
                    else "recomputation was planned on the first split")
    ranked = _items(graphs, groups, ctx, no_recompute)
    evaluation = _Evaluation(graphs, groups, ranked, ctx)
    minimum = now.activation_bytes - sum(i.nbytes for i in ranked)
    target = _target(graphs, ctx, baseline.activation_bytes)

    if target is None:
        k, need = 0, None
    elif target == "auto":
        allowance = ctx.config.max_overhead * baseline.step_s
        k = _first(0, len(ranked), lambda n: evaluation.cost(n + 1) > allowance)
        need = None
        target = now.activation_bytes - evaluation.covered(k)
    else:
        if target == "all":
            target = minimum
        if target < minimum:
            raise StormBudgetError(
                f"memory_budget {target} bytes ({target / GIB:.3f} GiB) is below the minimum "
                f"feasible for this graph, {minimum} bytes ({minimum / GIB:.3f} GiB): what must "
                f"stay on the device at the end of the forward (outputs, views of inputs, "
                f"tensors under min_offload_bytes or of dynamic shape)")
        need = now.activation_bytes - target
        k = _first(0, len(ranked), lambda n: evaluation.covered(n) >= need)

    taken = {i.root for i in ranked[:k]}
    free = evaluation.hidden(k)
    if need is not None:
        still = need - sum(i.nbytes for i in ranked[:k])
        chosen = []
        order = {n: i for i, n in enumerate(graphs.forward.graph.nodes)}
        for item in sorted(free, key=lambda i: order[i.root]):
            if still <= 0:
                break
            chosen.append(item)
            still -= item.nbytes
        free = chosen
    free_roots = {i.root for i in free}
    placements = evaluation.placements(k)
    recompute: list[str] = []
    for item in ranked:
        members = groups[item.root]
        if item.root in taken and item.action == "recompute":
            _decide(item.root, members, "recompute",
                    f"rebuilt in {item.recompute_s * US:.0f} µs, below the copy's "
                    f"{item.offload_s * US:.0f} µs")
            recompute += [n.name for n in (*item.chain, *members)]
        elif item.root in taken:
            _decide(item.root, members, "offload",
                    f"link-bound copy of {item.offload_s * US:.0f} µs; "
                    + (f"not recomputed: {item.no_recompute}" if item.recompute_s is None
                       else f"recompute would take {item.recompute_s * US:.0f} µs"))
        elif item.root in free_roots:
            _decide(item.root, members, "offload", "copies predicted to hide")
        else:
            why = placements.get(item.root)
            _decide(item.root, members, "keep",
                    why if isinstance(why, str) else "the budget is met without it")
    if not first_split:
        return graphs
    recomputed = [i for i in ranked[:k] if i.action == "recompute"]
    return dataclasses.replace(graphs, plan=MemoryPlan(
        baseline=baseline, target_bytes=target, minimum_bytes=minimum,
        recompute=tuple(dict.fromkeys(recompute)),
        recompute_bytes=sum(i.nbytes for i in recomputed),
        recompute_s=sum(i.recompute_s for i in recomputed)))
