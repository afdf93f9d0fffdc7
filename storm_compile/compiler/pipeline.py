"""The storm pipeline, in the order it runs: capture → joint-graph passes → split → annotate
costs → plan → insert transfers → verify (after every pass) → agree across ranks → compile.

Capture and compile belong to AOTAutograd and the inner compiler; storm's part sits between
them, in :func:`storm_partition`, which AOTAutograd calls with the joint graph. For a streamed
graph under a byte budget, :func:`plan_within_budget` searches among plans; it plans against
``PassContext.limits`` and never rewrites the user's options.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import logging
import math
import time
import warnings
from collections.abc import Callable

from torch import fx

from storm_compile.config import StormConfig
from storm_compile.cost.simulate import device_bytes, host_inputs, simulate
from storm_compile.fx.graphs import (
    JointGraph,
    PassContext,
    PassRecord,
    StormGraphs,
    copy_decided,
    lazy_module,
)
from storm_compile.fx.plan import Action, ResidentWeight
from storm_compile.fx.prediction import NodeTiming, Prediction
from storm_compile.fx.vocabulary import GIB, RECOMPUTE_TAG, tensor_bytes
from storm_compile.passes import (
    annotate_costs,
    insert_transfers,
    place_transfers,
    plan_gradient_sums,
    plan_memory,
    plan_offload,
    plan_weights,
    refetch_weights,
    rematerialize,
    sum_tied_gradients,
    verify_graphs,
    verify_joint,
)
from storm_compile.passes.rematerialize import RecomputeRejectedError
from storm_compile.passes.verify import StormVerificationError
from storm_compile.planner.step_budget import StepBudget, StormBudgetError
from storm_compile.runtime.ranks import check_ranks_agree
from storm_compile.weights.streaming import device_weights

log = logging.getLogger("storm_compile")

Pass = Callable[[StormGraphs, PassContext], StormGraphs]
JointPass = Callable[[fx.GraphModule], fx.GraphModule]

JOINT: tuple[JointPass, ...] = (
    refetch_weights,     # streamed weights fetched again in the backward, never saved
    sum_tied_gradients,  # a tied weight's gradients summed on the device, sent home once
)

PLAN: tuple[Pass, ...] = (
    annotate_costs,      # bytes and predicted compute time of every node
    plan_offload,        # which saved storages may leave the device
    plan_memory,         # keep, offload or recompute each of them (decisions only)
)


def _size(graphs: StormGraphs) -> tuple[int, int]:
    return len(graphs.forward.graph.nodes), len(graphs.backward.graph.nodes)


def _plan_summary(graphs: StormGraphs) -> str:
    if graphs.storages is None:
        return ""
    actions = collections.Counter(d.action.value for _, d in graphs.storages)
    placed = sum(d.placement is not None for _, d in graphs.storages)
    counts = [f"{action} {count}" for action, count in sorted(actions.items())]
    return ", ".join(counts + ([f"placed {placed}"] if placed else []))


def _changes(before: StormGraphs, after: StormGraphs, sizes: tuple[int, int]) -> str:
    """What a pass changed, in a few words: a new pair of graphs, nodes added to either graph,
    the storage plan's decisions."""
    if after.forward is not before.forward:
        return "recomputed values rebuilt in the backward"
    changes = [f"{graph} {now - then:+d} nodes"
               for graph, then, now in zip(("forward", "backward"), sizes, _size(after))
               if now != then]
    plan = _plan_summary(after)
    if plan != _plan_summary(before):
        changes.append(f"plan: {plan}")
    return "; ".join(changes)


def _verified(name: str, verify: Callable[[], None]) -> None:
    try:
        verify()
    except Exception as error:
        raise StormVerificationError(f"storm pass {name!r} left invalid graphs: {error}") \
            from error


def _code(ctx: PassContext, **modules: fx.GraphModule) -> tuple[tuple[str, str], ...]:
    """The code of ``modules`` by graph name when ``ctx.stages`` asks for it, else nothing."""
    return tuple((name, gm.code) for name, gm in modules.items()) if ctx.stages else ()


def _run(storm_pass: Pass, graphs: StormGraphs, ctx: PassContext) -> StormGraphs:
    """Run one pass, verify the graphs it leaves (a failure names the pass) and append its
    :class:`PassRecord` to them."""
    start, sizes = time.perf_counter(), _size(graphs)
    after = storm_pass(graphs, ctx)
    seconds = time.perf_counter() - start
    log.debug("storm: pass %s took %.3f s", storm_pass.__name__, seconds)
    _verified(storm_pass.__name__, lambda: verify_graphs(after))
    record = PassRecord(storm_pass.__name__, seconds, _changes(graphs, after, sizes),
                        _code(ctx, forward=after.forward, backward=after.backward))
    return dataclasses.replace(after, records=(*graphs.records, record))


def _tagged(joint: fx.GraphModule) -> int:
    return sum(RECOMPUTE_TAG in n.meta for n in joint.graph.nodes)


def _names(joint: fx.GraphModule) -> set[str]:
    return {n.name for n in joint.graph.nodes}


def run_joint_passes(joint: fx.GraphModule, ctx: PassContext
                     ) -> tuple[fx.GraphModule, tuple[PassRecord, ...]]:
    """Run :data:`JOINT` on AOTAutograd's joint graph, in place, each verified
    (``verify_joint``; a failure names the pass): the graph and a :class:`PassRecord` per pass,
    after one for the graph as captured (``capture``, with its code under ``ctx.stages``)."""
    records = [PassRecord("capture", 0.0, "as AOTAutograd traced it", _code(ctx, joint=joint))]
    for joint_pass in JOINT:
        start, names, tagged = time.perf_counter(), _names(joint), _tagged(joint)
        joint = joint_pass(joint)
        seconds = time.perf_counter() - start
        _verified(joint_pass.__name__, lambda: verify_joint(joint))
        added, removed = len(_names(joint) - names), len(names - _names(joint))
        changes = ([f"joint +{added} -{removed} nodes"] if added or removed else []) + (
            [f"{_tagged(joint) - tagged:+d} recompute tags"] if _tagged(joint) != tagged else [])
        records.append(PassRecord(joint_pass.__name__, seconds, "; ".join(changes),
                                  _code(ctx, joint=joint)))
    return joint, tuple(records)


def run_passes(graphs: StormGraphs, ctx: PassContext) -> StormGraphs:
    """Plan, realise recomputation, plan the new split's offloads, choose the resident weights,
    place and insert transfers."""
    return plan_transfers(plan_storages(graphs, ctx), ctx)


def plan_storages(graphs: StormGraphs, ctx: PassContext) -> StormGraphs:
    """Plan, realise recomputation, plan the new split's offloads: every saved storage decided
    and recorded in the step's ledger, the graphs not rewritten. What it decides depends on
    the graphs, ``ctx.config`` and ``ctx.limits``, ``ctx.cost`` and the ledger's other graphs,
    never on ``ctx.resident_room``."""
    first_split = graphs.plan is None
    for storm_pass in PLAN:
        graphs = _run(storm_pass, graphs, ctx)
    if first_split and graphs.plan.recompute:
        try:
            graphs = _run(rematerialize, graphs, ctx)    # rebuild the recomputed values
        except RecomputeRejectedError as error:
            warnings.warn(f"storm: could not rebuild what the plan recomputes ({error}); "
                          f"this graph uses storm's best plan without recomputation "
                          f"instead", RuntimeWarning, stacklevel=3)
            ctx = dataclasses.replace(
                ctx, limits=dataclasses.replace(ctx.limits, recompute=False))
            graphs = dataclasses.replace(graphs, plan=None)
        for storm_pass in PLAN:                      # offloads of the new split, same target
            graphs = _run(storm_pass, graphs, ctx)
    return graphs


def plan_transfers(graphs: StormGraphs, ctx: PassContext) -> StormGraphs:
    """Choose the resident weights, place and insert transfers, on graphs whose storages
    :func:`plan_storages` decided; the graphs are rewritten in place."""
    graphs = _run(plan_weights, graphs, ctx)         # streamed weights kept on the device
    return place_and_insert(graphs, ctx)


def place_and_insert(graphs: StormGraphs, ctx: PassContext) -> StormGraphs:
    """Place and insert transfers, on graphs whose storages :func:`plan_storages` decided and
    whose resident weights ``plan_weights`` chose; the graphs are rewritten in place."""
    graphs = _run(place_transfers, graphs, ctx)      # where each copy and wait goes
    graphs = _run(insert_transfers, graphs, ctx)     # rewrite both graphs from the decisions
    if not graphs.storages.with_action(Action.OFFLOAD) and not graphs.plan.recompute:
        reasons = sorted({d.reason for _, d in graphs.storages})
        log.debug("storm: nothing to offload or recompute (%s); graphs run unchanged",
                  "; ".join(reasons) or "nothing is saved for the backward")
    return graphs


PEAK_ROUNDS = 5
"""Plans a streamed graph gets after its first when its predicted device peak is over a byte
``memory_budget``, in each of the two ways :func:`plan_within_budget` tries. The backward's peak
above the saved activations moves with the plan (what is recomputed, how much is prefetched
ahead), so round ``k`` aims the activations at the last plan's less its excess over the budget
times ``2**k`` (never below their minimum), and lowers ``prefetch_window_bytes`` to at most what
the last peak held besides activations, less that excess (one way) or less only the part of it
the activations could not take (the other: the window hides the weights' copies), and halves it
once the activations are at their minimum. Each round plans the graph once more: only a graph
over its budget pays for them."""

RELIEF_SHARE = 0.02
"""A byte budget's plan whose predicted step waits on copies for more than this share of
itself is planned again with some of its link-bound offloads rebuilt (:func:`_relieved`): the
default ``max_overhead``, below which those plans would cost more compile time than the step
could gain."""

RESIDENT_ROUNDS = 3
"""Plans a streamed graph gets to keep weights on the device with the room its fitting plan
left under a byte budget: a weight kept there is also cloned while it is read, and stops being
prefetched, so the first try can land over the budget; each next try has the room less that
excess times ``2**k``, and after the last the plan without resident weights stands."""


def _decide(graphs: StormGraphs, ctx: PassContext) -> StormGraphs:
    """:func:`plan_storages` on a fresh copy of the split of ``graphs``' joint graph: decided
    graphs no pass has rewritten. Plans that differ only in
    ``PassContext.resident_room`` decide the same, so each is placed and rewritten from a copy
    of one (:func:`_transfers`) instead of being planned again from a fresh split."""
    forward, backward = graphs.joint.split()
    return plan_storages(StormGraphs(forward, backward, graphs.num_fwd_outputs,
                                     joint=graphs.joint, records=graphs.records), ctx)


def _transfers(decided: StormGraphs, ctx: PassContext) -> StormGraphs:
    """:func:`plan_transfers` from ``decided``, on a copy of its graphs: the plan
    :func:`run_passes` makes from the same split with ``ctx``, ``decided`` left unchanged
    (``plan_weights`` does not rewrite graphs)."""
    return place_and_insert(copy_decided(_run(plan_weights, decided, ctx)), ctx)


def _peak(graphs: StormGraphs, ctx: PassContext) -> tuple[int, Prediction]:
    prediction = simulate(graphs, ctx.cost)
    return device_bytes(graphs, prediction), prediction


def plan_within_budget(graphs: StormGraphs, ctx: PassContext) -> StormGraphs:
    """:func:`run_passes`; then, under a byte ``memory_budget``, which bounds the step's
    device peak (inputs, weights, activations and the backward's working set):

    1. while the predicted device peak (:func:`~storm_compile.cost.simulate.device_bytes`) is over
       the budget, plan again from a fresh split with fewer activations and a smaller prefetch
       window, at most :data:`PEAK_ROUNDS` times (:func:`_fit_peak`), once with the window
       spared while the activations can take the excess and once with both lowered; keep the
       fitting plan with the faster predicted step; raise :class:`StormBudgetError` stating the
       least peak seen and where it is when neither fits the budget; keep the least with a
       warning when it fits the budget but not beside what the step's earlier graphs hold, or
       for a run the step's ledger planned again (``Limits.peak_error``);
    2. when the fitting plan's predicted step waits on its copies, plan again with some of
       its link-bound offloads priced with both copies, which rebuilds them where that costs
       less, and keep the fastest (:func:`_relieved`);
    3. for a graph that streams weights, plan again with the room the fitting plan left
       (``PassContext.resident_room``) for ``plan_weights`` to keep weights on the device
       (:func:`_with_residents`), and, unless
       that kept every streamed weight, once more from a plan whose activation target is lower
       by up to the streamed weights' bytes (activations traded for weights kept);
    4. in the room each of those plans' peak leaves under the user's budget, sum the gradients
       of its resident weights on the device (``plan_gradient_sums``, then ``insert_transfers``
       gives their sends the weights: a sum holds the weight's bytes and changes nothing else
       of the plan), and keep the plan whose predicted step of two micro-batches is the fastest
       (:func:`_summed`).

    The returned graphs' ``share`` is their plan's part of the step, for the caller to record
    in the step's ledger; the passes only read the step (``ctx.others``)."""
    asked, user = ctx.config, ctx
    budget = asked.memory_budget.planned.nbytes      # the byte budget less its margin
    streams = device_weights(graphs.forward, asked.prefetch_window_bytes).streams
    first = plan_storages(graphs, ctx)
    if budget is None or first.plan.target_bytes is None:
        return plan_transfers(first, ctx)
    room = budget - ctx.others.held_bytes()          # the peak beside the other graphs
    planned = _transfers(first, ctx)
    peak, prediction = _peak(planned, ctx)
    if peak > room:
        fits, least = [], _peak_at(peak, prediction, planned)
        for spare_window in (True, False):
            fit = _fit_peak(graphs, ctx, planned, prediction, spare_window, room)
            if isinstance(fit, _Fit):
                fits.append(fit)
            else:
                least = min(least, fit, key=lambda seen: seen.nbytes)
        if fits:
            fastest = min(fits, key=lambda fit: fit.prediction.step_s)
            planned, prediction, ctx, peak, first = (fastest.graphs, fastest.prediction,
                                                     fastest.ctx, fastest.peak, fastest.decided)
        elif ctx.limits.peak_error and least.nbytes > budget:
            raise _over_budget(budget, room, least, asked)
        else:
            cause = ("a compiled graph ran again before the backward, and the step that first "
                     "shows a run plans it at its minimum beside what the earlier runs hold; "
                     "from the next step on the runs share the budget"
                     if not ctx.limits.peak_error else
                     "the step's graphs compiled before this one were planned before it "
                     "existed and took the room; a fraction budget (such as 0.5) shares the "
                     "step between its graphs as they arrive")
            warnings.warn(
                f"storm: this graph's least predicted peak, {least.nbytes} bytes "
                f"({least.nbytes / GIB:.3f} GiB), is over the {room} bytes the step's "
                f"memory_budget leaves it: {cause}", RuntimeWarning, stacklevel=2)
            return _with_peak(least.graphs, least.nbytes)
    relieved = _relieved(graphs, ctx, planned, prediction, room)
    if relieved is not None:
        planned, prediction, ctx, peak, first = (relieved.graphs, relieved.prediction,
                                                 relieved.ctx, relieved.peak, relieved.decided)
    if not streams:
        return _with_peak(planned, peak)
    candidates = [_Candidate(prediction.step_s, planned, peak)]
    kept = _with_residents(first, ctx, room, planned, room - peak)
    candidates += [kept] if kept is not None else []
    streamed = sum(tensor_bytes(w.meta.get("val")) for w in host_inputs(planned))
    freed = min(streamed, planned.plan.target_bytes - planned.plan.minimum_bytes)
    if freed > 0 and (kept is None
                      or sum(w.nbytes for w in kept.graphs.storages.resident) < streamed):
        fewer = dataclasses.replace(ctx, limits=dataclasses.replace(
            ctx.limits, budget_bytes=ctx.memory_budget.nbytes - freed))
        candidates += _traded(graphs, fewer, room)
    best = min((_summed(c, user, room) for c in candidates), key=lambda c: c.step_s)
    return _with_peak(best.graphs, best.peak)


def _summed(candidate: _Candidate, user: PassContext, room: int) -> _Candidate:
    """``candidate`` with the gradients of its resident weights summed on the device in the
    room its peak leaves (``plan_gradient_sums``, then ``insert_transfers`` marks their sends
    ``summed``; a sum holds the weight's bytes and changes nothing else of the plan), priced
    for a step of two micro-batches: one that holds its gradients' sums on the device, and the
    last, which sends the sums home and folds the other gradients into their host sums on the
    device.

    A graph compiles at the loop's first forward, before any step says how many backwards it
    takes. Room spent on weights kept on the device speeds every micro-batch; room spent on
    their gradients' sums speeds every one but the last, often by more: for the 3B Llama preset
    under a 14 GiB budget (``storm throughput llama --preset 3b --stream --memory-budget 14GiB
    --tokens 4096 --micro-batches 1,4 --overlap-optimizer --profile h100``), the plan fastest at
    one micro-batch keeps every weight and sums few; it is predicted 4 % faster at one
    micro-batch and 17 % slower at four than the plan chosen on two."""
    graphs = _run(plan_gradient_sums, candidate.graphs,
                  dataclasses.replace(user, resident_room=room - candidate.peak))
    peak = candidate.peak
    if graphs is not candidate.graphs:
        peak += graphs.share.resident_bytes - candidate.graphs.share.resident_bytes
        graphs = _run(insert_transfers, graphs, user)
    last_s = simulate(graphs, user.cost, folded=True).step_s
    return _Candidate(simulate(graphs, user.cost, held=True).step_s + last_s, graphs, peak)


@dataclasses.dataclass(frozen=True)
class _Fit:
    """A plan made from a fresh split (:func:`_replanned`), and what it was planned with: as
    the search returns one, its predicted device peak fits the byte budget."""

    graphs: StormGraphs
    prediction: Prediction
    ctx: PassContext
    peak: int
    decided: StormGraphs
    """Its storage decisions, before the graphs were rewritten."""


@dataclasses.dataclass(frozen=True)
class _Candidate:
    """A plan the search may return: its predicted step (of one micro-batch; of two once
    :func:`_summed`), its rewritten graphs (with their share of the step) and its predicted
    device peak."""

    step_s: float
    graphs: StormGraphs
    peak: int


@dataclasses.dataclass(frozen=True)
class _PeakAt:
    """A plan's predicted device peak, the node where it is, and the plan."""

    nbytes: int
    at: NodeTiming
    graphs: StormGraphs


def _peak_at(peak: int, prediction: Prediction, graphs: StormGraphs) -> _PeakAt:
    return _PeakAt(peak, max(prediction.timings, key=lambda t: t.memory_after), graphs)


def _with_peak(graphs: StormGraphs, peak: int) -> StormGraphs:
    """``graphs`` with their predicted device peak in their share of the step."""
    return dataclasses.replace(graphs, share=dataclasses.replace(graphs.share, peak_bytes=peak))


def _fit_peak(graphs: StormGraphs, ctx: PassContext,
              planned: StormGraphs, prediction: Prediction, spare_window: bool, room: int
              ) -> _Fit | _PeakAt:
    """Plan ``graphs`` again from a fresh split while the predicted device peak stays over
    ``room`` (the byte budget less what the step's other graphs hold), starting from
    ``planned`` (over it, predicted as ``prediction``), at most :data:`PEAK_ROUNDS` times: the
    first fitting plan, or the least peak seen, the node where it is and its plan. Round ``k``
    takes the excess times ``2**k`` from the activations (never below their minimum) and from
    ``prefetch_window_bytes``: with ``spare_window`` only the part the activations could not
    take."""
    lowered, window = ctx.memory_budget.nbytes, ctx.prefetch_window_bytes
    weights = device_weights(graphs.forward, window)
    peak = device_bytes(planned, prediction)
    least = _peak_at(peak, prediction, planned)
    for round_ in range(PEAK_ROUNDS):
        excess = (peak - room) * 2**round_
        target = max(planned.plan.minimum_bytes, prediction.activation_bytes - excess)
        taken = excess - (prediction.activation_bytes - target) if spare_window else excess
        window = max(0, min(window, peak - prediction.activation_bytes) - taken)
        if target == prediction.activation_bytes:
            window //= 2
        now = device_weights(graphs.forward, window)
        lowered -= planned.plan.target_bytes - target + weights.nbytes - now.nbytes
        weights = now
        ctx = dataclasses.replace(ctx, limits=dataclasses.replace(
            ctx.limits, budget_bytes=lowered, prefetch_window_bytes=window))
        fit = _replanned(graphs, ctx)
        if fit is None:
            return least
        if fit.peak <= room:
            return fit
        planned, prediction, peak = fit.graphs, fit.prediction, fit.peak
        least = min(least, _peak_at(peak, prediction, planned), key=lambda seen: seen.nbytes)
    return least


def _relieved(graphs: StormGraphs, ctx: PassContext, planned: StormGraphs,
              prediction: Prediction, room: int) -> _Fit | None:
    """The fastest of the plans that rebuild some of ``planned``'s link-bound offloads instead,
    when its predicted step waits on copies for more than :data:`RELIEF_SHARE` of itself; None
    when none is faster or fits ``room``.

    ``plan_memory`` prices an offload whose copies cannot hide with its D2H copy, which
    stretches the forward; where the backward's H2D lane is saturated too, its prefetch
    stretches the backward as well, and rebuilding it there can cost less than the two copies.
    Each try plans the graph again from a fresh split with the ``k`` largest of ``planned``'s
    link-bound offloads named in ``Limits.link_bound``, priced with both
    copies: ``k`` at half of them and at all, then at the quarters around half when half is the
    fastest: four plans at most. Rebuilding moves time from the link to the compute stream, so
    the search looks for the count between none and all at which the two balance."""
    bound = [s.root.name for s, d in sorted(planned.storages, key=lambda sd: -sd[0].nbytes)
             if d.action is Action.OFFLOAD and not d.figures.hides]
    if not bound or prediction.exposed_transfer_s <= RELIEF_SHARE * prediction.step_s:
        return None
    tried: dict[int, _Fit | None] = {}

    def step_s(count: int) -> float:
        if count not in tried:
            tried[count] = _relief(graphs, ctx, frozenset(bound[:count]), room)
        fit = tried[count]
        return math.inf if fit is None else fit.prediction.step_s

    half = len(bound) // 2
    if half and step_s(half) < min(step_s(len(bound)), prediction.step_s):
        for count in {half // 2, (half + len(bound)) // 2} - {0, half, len(bound)}:
            step_s(count)
    else:
        step_s(len(bound))
    fits = [fit for fit in tried.values() if fit is not None]
    fastest = min(fits, key=lambda fit: fit.prediction.step_s, default=None)
    return fastest if fastest is not None \
        and fastest.prediction.step_s < prediction.step_s else None


def _relief(graphs: StormGraphs, ctx: PassContext, bound: frozenset[str], room: int
            ) -> _Fit | None:
    """The graph planned again with the offloads of ``bound`` priced with both copies
    (``Limits.link_bound``); None when the step's ledger refuses the plan or its peak does not
    fit ``room``."""
    fit = _replanned(graphs, dataclasses.replace(ctx, limits=dataclasses.replace(
        ctx.limits, link_bound=ctx.limits.link_bound | bound)))
    return fit if fit is not None and fit.peak <= room else None


def _traded(graphs: StormGraphs, ctx: PassContext, budget: int) -> list[_Candidate]:
    """The graph planned with ``ctx``'s lower activation target, then with the room that plan
    leaves for weights kept on the device (:func:`_with_residents`), and with half of it (the
    other half left to their gradients' sums, which take a kept weight's bytes again); none
    when the step's ledger refuses the lower target or its peak does not fit ``budget``, and
    only those that keep a weight."""
    traded = _replanned(graphs, ctx)
    if traded is None or traded.peak > budget:
        return []
    tries = (_with_residents(traded.decided, ctx, budget, traded.graphs, room)
             for room in (budget - traded.peak, (budget - traded.peak) // 2))
    return [kept for kept in tries if kept is not None]


def _replanned(graphs: StormGraphs, ctx: PassContext) -> _Fit | None:
    """The graph planned again from a fresh split with ``ctx`` (:func:`_decide`) and rewritten,
    with its prediction and predicted device peak; None when the step's ledger refuses the
    plan's target."""
    try:
        decided = _decide(graphs, ctx)
    except StormBudgetError:
        return None
    planned = _transfers(decided, ctx)
    peak, prediction = _peak(planned, ctx)
    return _Fit(planned, prediction, ctx, peak, decided)


def _with_residents(decided: StormGraphs, ctx: PassContext, budget: int, fitting: StormGraphs,
                    room: int) -> _Candidate | None:
    """The graph planned again with ``room`` for weights kept on the device
    (``PassContext.resident_room``) above ``fitting``, a plan whose peak fits the budget, made
    with ``ctx`` from ``decided``: the first of :data:`RESIDENT_ROUNDS` tries whose peak fits
    ``budget`` too, with its predicted step and ledger share; None when no weight fits or no
    try does. Each try decides what ``fitting`` decided, so it starts from ``decided``; a try
    that keeps the same weights as an earlier one is that plan again, whose peak is known."""
    smallest = min(tensor_bytes(w.meta.get("val")) for w in host_inputs(fitting))
    peaks: dict[tuple[ResidentWeight, ...], int] = {}
    for round_ in range(RESIDENT_ROUNDS if room >= smallest else 0):
        with_room = dataclasses.replace(ctx, resident_room=room)
        weighed = _run(plan_weights, decided, with_room)
        resident = weighed.storages.resident
        if not resident:
            return None
        if resident not in peaks:
            kept = place_and_insert(copy_decided(weighed), with_room)
            peak, prediction = _peak(kept, ctx)
            if peak <= budget:
                return _Candidate(prediction.step_s, kept, peak)
            peaks[resident] = peak
        room -= (peaks[resident] - budget) * 2**round_
    return None


def _over_budget(budget: int, room: int, least: _PeakAt, asked: StormConfig
                 ) -> StormBudgetError:
    peak, at, asked_budget = least.nbytes, least.at, asked.memory_budget
    margin = (f"; {budget} bytes planned, {asked_budget.margin:.0%} left to the allocator"
              if asked_budget.margin else "")
    beside = (f"; less the {budget - room} bytes the step's other graphs hold"
              if room < budget else "")
    return StormBudgetError(
        f"memory_budget {asked_budget.nbytes} bytes ({asked_budget.nbytes / GIB:.3f} GiB"
        f"{margin}{beside}) is below the device "
        f"memory this graph needs at its peak: of the plans storm tried, with up to every "
        f"activation that may move offloaded or recomputed, the least predicted peak is {peak} "
        f"bytes ({peak / GIB:.3f} GiB), at {at.node} of the "
        f"{'backward' if at.graph == 'bw' else 'forward'}. Raise memory_budget, lower "
        f"prefetch_window_bytes ({asked.prefetch_window_bytes} bytes of offloaded activations "
        f"and streamed weights may be copied ahead), or use fewer tokens per micro-batch")


@contextlib.contextmanager
def _without_cycle_collection():
    """Python's cycle collector off while storm plans, as it was after. Planning makes and drops
    copies of graphs of hundreds of thousands of nodes, each node in reference cycles, and the
    collector's full passes rescan every one of them: on the 2-core CPU, for the 70B Llama shape
    at 40 layers (``storm schedule llama --preset 70b --layers 40 --seq 2048 --batch 4 --stream
    --lora 16 --host-format nf4 --memory-budget 12GiB``), tracing and planning took 75 s with it
    on while storm planned and 64 s with it off, the same plan, the process's peak resident
    memory 0.95 and 1.13 GiB. The copies the search drops are freed by the collector's first
    pass once it is back on."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@_without_cycle_collection()
def storm_partition(joint: fx.GraphModule, joint_inputs, *, ctx: PassContext, step: StepBudget,
                    observer: Callable[[StormGraphs], None] | None = None,
                    **partition_kwargs) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Plan and rewrite one graph of the step whose ledger is ``step``: its passes plan against
    the step's other graphs (:meth:`StepBudget.view`), and the ledger records the share of the
    plan they return (the one place the ledger is written during planning), with Python's cycle
    collector off (:func:`_without_cycle_collection`)."""
    graph = step.next_graph()
    ctx = dataclasses.replace(ctx, others=step.view(graph))
    # 1. capture: AOTAutograd traced the joint graph; the joint-graph passes fetch streamed
    #    weights again in the backward instead of saving them and sum a tied weight's
    #    gradients on the device; then split it the way torch.compile does.
    joint, records = run_joint_passes(lazy_module(joint), ctx)
    joint_graph = JointGraph(joint, joint_inputs, partition_kwargs)
    start = time.perf_counter()
    forward, backward = joint_graph.split()
    split = PassRecord("split", time.perf_counter() - start, "split",
                       _code(ctx, forward=forward, backward=backward))
    log.debug("storm: pass split took %.3f s", split.seconds)
    graphs = StormGraphs(forward, backward, partition_kwargs["num_fwd_outputs"], joint=joint_graph,
                         records=(*records, split))
    # 2-5. annotate costs, plan, (rebuild what is recomputed), place, insert transfers; verified;
    #      a streamed graph planned again while its predicted peak is over a byte budget.
    graphs = plan_within_budget(graphs, ctx)
    step.record(graph, graphs.share)
    # 6. agree: every rank of a process group made this same plan.
    check_ranks_agree(graphs)
    if observer is not None:
        observer(graphs)
    # 7. compile: AOTAutograd hands both graphs to the inner compiler.
    return graphs.forward, graphs.backward
