"""One memory budget for the whole training step, however many graphs dynamo makes of it.

A step is often several compiled graphs: graph breaks, DDPOptimizer's one graph per gradient
bucket, FSDP2's hooks. A user's ``memory_budget`` is about the step, so each graph is planned
knowing what the graphs compiled before it planned. Graphs are planned in the order dynamo
compiles them (for DDP, every bucket's piece during the first forward), and a
:class:`StepBudget` keeps one :class:`GraphShare` per graph of the step, keyed by the frame that
made it and its position within that frame's compilation; a recompilation of the same frame
(new shapes, a failed guard) replaces that frame's graphs. A step ends when each of its forward
runs has had its backward (or dropped its outputs); once one has ended, a graph first planned in
a later step takes the place of the graph the last step ran at that point (the other side of a
data-dependent branch), beside the graphs this step ran before it and those the last step ran
after that point (:meth:`StepBudget._other_shares`). A graph's passes plan against a
:class:`StepView`, a frozen copy of the other graphs' shares, and return their own share; the
pipeline records it.

How graph ``k`` is planned, with ``B`` and ``A`` summing the other graphs' activation memory
without storm and as planned:

* a fraction ``f``: ``f * (B + b_k) - A``, within ``[minimum_k, b_k]``: the step so far stays
  at ``f`` of its activations; a graph too small to reach its share does what it can and the
  later ones make up the difference where they can;
* bytes: what the others left, ``budget - A``. If even this graph's minimum does not fit, the
  step's minimum (every graph's minimum summed) is compared with the budget: above it, the
  budget is infeasible for the step (:class:`StormBudgetError`, stating the step's minimum);
  below it, the earlier graphs, planned before this one existed, took the room, so this graph
  keeps its minimum and storm warns once how far the step is over;
* ``"auto"``: the step-time allowance ``max_overhead`` is the step's, shared the same way: a
  graph may spend ``max_overhead * (S + s_k)`` less what the other graphs spent.

One compiled graph may run several times before the step's backward: identical blocks compile
to one graph when each is compiled on its own (torchtitan's way) or sits behind FSDP2's hooks, a
siamese or GAN step makes several forwards before one backward, and a validation loss kept with
grad enabled keeps its autograd graph. Planning sees one run; the forward sees them all. A byte
budget bounds the step's device peak, and a run's peak comes with the activations the step's
earlier runs still hold: backwards run in reverse, so run ``i``'s backward runs beside runs
``0 .. i-1``. Under a byte budget :meth:`StepBudget.run_room` decides, before each run, the
device peak that run must be planned for (a :class:`RunRoom`; the backend compiles the graph
once more for each, :func:`storm_compile.compiler.backend._counting_runs`), and
:meth:`StepBudget.ran` counts what each run whose backward is still to come holds:

* a run the graph's own plan fits beside what the step holds uses that plan;
* in a step where a graph runs more often than in the last finished step, each further run is
  planned at the graph's minimum (the step learns the count here; storm warns when that run's
  predicted peak does not fit what is left);
* a run also holds the device inputs the step's earlier runs of the graph did not pass
  (another block's weights), measured once a step knows the graph runs several times;
* once a finished step ran a graph ``k`` times and measured those inputs, its last run keeps
  room for the least peak any plan of the graph reached (its backward runs beside the other
  runs' activations), and the other ``k - 1`` share what is left, less their inputs, for
  activations in equal parts, each run peaking at most at what the runs before it leave; when
  the last run's least peak beside the others at their minimum does not fit, or a run's plan
  cannot fit its room, the budget is infeasible (:class:`StormBudgetError`).

A fraction budget, or ``"auto"``, holds for every run alike.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import NamedTuple

from storm_compile.config import PEAK_MARGIN, MemoryBudget
from storm_compile.fx.torch_private import CompileContext
from storm_compile.fx.vocabulary import GIB

NO_FRAME = -1
"""Frame id of graphs compiled outside dynamo (the CLI traces with AOTAutograd directly)."""


class StormBudgetError(ValueError):
    """The memory budget cannot be met by the step."""


@dataclasses.dataclass(frozen=True)
class GraphShare:
    """One compiled graph's part of the step, as planned."""

    baseline_bytes: int
    """Activation memory the graph holds without storm."""
    minimum_bytes: int
    """The least activation memory the graph allows."""
    planned_bytes: int
    """Activation memory storm's plan is predicted to hold."""
    baseline_step_s: float
    spent_s: float
    """Predicted step time the plan adds."""
    resident_bytes: int = 0
    """Streamed weights the plan keeps on the device: they count against a byte budget."""
    host_bytes: int = 0
    """Pinned host memory its offloads hold at the end of its forward (in the pool's buckets):
    the step's graphs share ``host_memory_limit``."""
    over_bytes: int = 0
    """How far a byte budget is exceeded with this graph at its minimum: graphs compiled
    earlier in the step took the room (the ledger warns once when it records such a share)."""
    peak_bytes: int = 0
    """Under a byte budget, the plan's predicted device peak (its inputs, activations and
    working set)."""
    fixed_bytes: int = 0
    """The device memory the graph's peak holds besides its activations: its inputs there (for
    a graph that streams weights, the weights it reads there) and its backward's working set
    above the saved activations. A byte budget bounds it with the activations."""


@dataclasses.dataclass(frozen=True)
class RunRoom:
    """What one run of a graph is planned again for under a byte budget."""

    peak_bytes: int
    """The device peak the run may reach beside what the step holds when it runs."""
    plan_bytes: int
    """The byte budget its activations are planned for: ``peak_bytes``, or, for a run the step
    shows for the first time, what the graph holds besides activations and its minimum (more
    runs may follow)."""
    known: bool
    """Whether the last finished step made this run too. A known run's room leaves the later
    runs theirs, and a plan that cannot fit it is an error; for a run shown for the first time
    a plan over ``peak_bytes`` is kept with a warning, and the next step plans for the runs
    this one made."""


@dataclasses.dataclass(frozen=True)
class StepTarget:
    """The activation memory a graph should reach, and how far a byte budget is then exceeded
    (:attr:`GraphShare.over_bytes`)."""

    nbytes: int
    over_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class StepView:
    """What the step's other graphs planned, as one graph's passes plan against it: a frozen
    copy of their shares, so that a pass reads the step and never writes it (the pipeline
    records the share the passes return, :attr:`storm_compile.fx.graphs.StormGraphs.share`)."""

    others: tuple[GraphShare, ...] = ()

    def target_bytes(self, asked: MemoryBudget, baseline: int, minimum: int,
                     device_bytes: int = 0, working_bytes: int = 0,
                     holds: str = "") -> StepTarget:
        """Activation memory this graph should reach for a byte or fraction budget. A byte
        budget bounds the device peak: the graph holds ``device_bytes`` there besides
        activations (``holds`` says what: its inputs, or a streamed graph's weights), and its
        backward's ``working_bytes`` above the activations lower the target while it stays
        above ``minimum``."""
        held = sum(s.planned_bytes + s.resident_bytes for s in self.others)
        if asked.fraction is not None:
            share = asked.fraction * (sum(s.baseline_bytes for s in self.others) + baseline) \
                - held
            return StepTarget(int(min(max(share, minimum), baseline)))
        budget = asked.nbytes - device_bytes
        if budget - held >= minimum:
            return StepTarget(int(min(max(budget - held - working_bytes, minimum), baseline)))
        step_minimum = minimum + sum(s.minimum_bytes for s in self.others)
        if step_minimum > budget:
            beside = (f"; a byte budget bounds the device peak, and this graph also holds "
                      f"{holds or f'{device_bytes} bytes'} on the device" if device_bytes else "")
            raise StormBudgetError(
                f"memory_budget leaves {asked.nbytes} bytes ({asked.nbytes / GIB:.3f} GiB) "
                f"to plan (a byte budget leaves {PEAK_MARGIN:.0%} of itself to the allocator), "
                f"below "
                f"the minimum feasible for the step: its {len(self.others) + 1} graph(s) "
                f"compiled so far must hold at least {step_minimum} bytes "
                f"({step_minimum / GIB:.3f} GiB) of activations at the end of the forward "
                f"(outputs, views of inputs, tensors under min_offload_bytes){beside}")
        return StepTarget(minimum, held + minimum - budget)

    def held_bytes(self) -> int:
        """What the step's other graphs hold on the device while this graph runs: their
        planned activations and resident streamed weights."""
        return sum(s.planned_bytes + s.resident_bytes for s in self.others)

    def left_bytes(self, budget: int, own: GraphShare) -> int:
        """What a byte budget leaves once the step's graphs, this one as ``own``, hold what
        they planned."""
        return budget - sum(s.planned_bytes + s.resident_bytes for s in (*self.others, own))

    def allowance_s(self, baseline_step_s: float, max_overhead: float) -> float:
        """Predicted step time this graph's plan may add under ``memory_budget="auto"``."""
        step = sum(s.baseline_step_s for s in self.others) + baseline_step_s
        return max(0.0, max_overhead * step - sum(s.spent_s for s in self.others))

    def host_room(self, limit: int) -> int:
        """Pinned host memory this graph's offloads may hold: ``limit`` less what the step's
        other graphs' offloads hold."""
        return limit - sum(s.host_bytes for s in self.others)


class GraphId(NamedTuple):
    """One graph of the step: where dynamo compiled it."""

    frame: int
    compilation: int
    """Which compilation of that frame (a recompile replaces the frame's earlier graphs)."""
    position: int
    """The graph's position in that compilation: above 0 only when a frame made several graphs,
    which DDPOptimizer does (a graph break resumes in a new frame)."""


def current_graph_id(counter: dict[tuple[int, int], int]) -> GraphId:
    """The id of the graph about to be planned; ``counter`` numbers graphs per compilation."""
    compile_id = CompileContext.current_compile_id()
    frame = (NO_FRAME, 0) if compile_id is None else (compile_id.frame_id,
                                                     compile_id.frame_compile_id)
    position = counter.get(frame, 0)
    counter[frame] = position + 1
    return GraphId(*frame, position)


class StepBudget:
    """The graphs of one backend's step and what each planned; see the module docstring."""

    def __init__(self) -> None:
        self._shares: dict[GraphId, GraphShare] = {}
        self._positions: dict[tuple[int, int], int] = {}
        self._warned = False
        self._inputs: dict[GraphId, int] = {}
        """The most device inputs a run of a graph passed that its step's earlier runs did not,
        measured in the step under way when it knew the graph runs several times."""
        self._inputs_known: dict[GraphId, int] = {}
        """:attr:`_inputs` as the last finished step measured them: until a step has, a run's
        room is not a known one (:attr:`RunRoom.known`)."""
        self._least: dict[GraphId, int] = {}
        """The least device peak of the plans seen for a graph's runs."""
        self._runs: dict[GraphId, list[int]] = {}
        """Activation bytes each run of a graph whose backward is still to come holds."""
        self._ran: list[GraphId] = []
        """The graphs the step under way ran, in order."""
        self._before: tuple[GraphId, ...] | None = None
        """The graphs the last finished step ran, in order (None before the first ends)."""
        self.last: GraphId | None = None
        """The graph recorded last."""

    def next_graph(self) -> GraphId:
        return current_graph_id(self._positions)

    def peek_graph(self) -> GraphId:
        """The id :meth:`next_graph` will return, without taking it."""
        return current_graph_id(dict(self._positions))

    def ledger_key(self, graph: GraphId) -> str:
        """What ``graph``'s plan is made against: the other graphs of the step and their
        shares. Part of the graph's cache key under a budget."""
        return repr(sorted(self._other_shares(graph).items()))

    def _step(self, graph: GraphId) -> dict[GraphId, GraphShare]:
        """Shares of the step's graphs, ``graph`` included when recorded: a later compilation
        of a frame replaces its earlier graphs."""
        latest: dict[int, int] = {}
        for frame, compilation, _ in self._shares:
            latest[frame] = max(latest.get(frame, compilation), compilation)
        latest[graph.frame] = max(latest.get(graph.frame, graph.compilation), graph.compilation)
        return {key: share for key, share in self._shares.items()
                if key == graph or key.compilation == latest[key.frame]}

    def _other_shares(self, graph: GraphId) -> dict[GraphId, GraphShare]:
        """Shares of the graphs that run in ``graph``'s step. Until a step has finished, every
        graph recorded so far. Then a step is expected to run as the last one did: a graph
        planned in a later step runs where it is reached, in place of the graph the last step
        ran at that point (the other side of a data-dependent branch, a frame recompiled for
        new shapes), beside the graphs this step ran before it and those the last step ran
        after that point. Alternatives that never run in one step so never share a budget."""
        return {key: share for key, share in self._in_step(graph, len(self._ran) + 1).items()
                if key != graph}

    def _in_step(self, graph: GraphId, rest: int) -> dict[GraphId, GraphShare]:
        """Shares of the step's graphs (:meth:`_step`) that run in the step under way: those
        it ran, and those the last step ran from position ``rest`` on."""
        shares = self._step(graph)
        if self._before is None:
            return shares
        coming = {*self._ran, *self._before[rest:]}
        return {key: share for key, share in shares.items() if key in coming}

    def _others(self, graph: GraphId) -> list[GraphShare]:
        """Shares of the other graphs of ``graph``'s step (:meth:`_other_shares`)."""
        return list(self._other_shares(graph).values())

    def run_room(self, graph: GraphId, budget: int) -> RunRoom | None:
        """What the next run of the recorded ``graph`` must be planned for under a byte
        ``budget`` (see the module docstring), or None when the graph's own plan serves it."""
        share, runs = self._shares[graph], self._runs.get(graph, [])
        learned = self.runs_expected(graph)
        if not runs and learned < 2:
            return None                      # the run its plan was made for
        others = self._other_shares(graph)
        beside = sum(s.resident_bytes for s in others.values()) + sum(
            sum(self._runs[key]) if self._runs.get(key) else s.planned_bytes
            for key, s in others.items())
        left = budget - beside - sum(runs)
        if len(runs) >= learned:             # more runs than the last step showed
            if share.peak_bytes <= left:
                return None
            return RunRoom(max(left, 0), share.fixed_bytes + share.minimum_bytes, known=False)
        last, inputs = self.least_peak(graph), self._inputs_known.get(graph)
        known, inputs = inputs is not None, inputs or 0
        least = last + (learned - 1) * (share.minimum_bytes + inputs)
        if least > budget - beside:
            raise StormBudgetError(
                f"memory_budget {budget} bytes ({budget / GIB:.3f} GiB) is the step's, and one "
                f"of its compiled graphs runs {learned} times before the backward: the last "
                f"run's backward, at its least predicted peak ({last} bytes), beside the other "
                f"runs at their minimum ({share.minimum_bytes} bytes each, and {inputs} bytes "
                f"of device inputs the first run did not pass) needs {least} bytes "
                f"({least / GIB:.3f} GiB), and the step's other graphs hold {beside} bytes. "
                f"Raise memory_budget, or run fewer forwards per backward")
        if len(runs) == learned - 1:         # the last: nothing runs beside its backward
            room = max(left, 0)
            return None if share.peak_bytes <= left else RunRoom(room, room, known)
        each = (budget - beside - last) // (learned - 1) - inputs
        if share.peak_bytes <= left and share.planned_bytes <= each:
            return None
        return RunRoom(left, share.fixed_bytes + each, known)

    def runs_expected(self, graph: GraphId) -> int:
        """Runs of ``graph`` the last finished step made (0 before one has finished)."""
        return 0 if self._before is None else self._before.count(graph)

    def runs_held(self, graph: GraphId) -> int:
        """Runs of ``graph`` whose backward is still to come."""
        return len(self._runs.get(graph, ()))

    def least_peak(self, graph: GraphId) -> int:
        """The least device peak of the plans made for ``graph``'s runs (:meth:`saw_peak`)."""
        return self._least.get(graph, self._shares[graph].peak_bytes)

    def saw_peak(self, graph: GraphId, peak_bytes: int) -> None:
        """A plan of one of ``graph``'s runs is predicted to peak at ``peak_bytes``."""
        self._least[graph] = min(self.least_peak(graph), peak_bytes)

    def ran(self, graph: GraphId, planned_bytes: int, input_bytes: int = 0,
            measured: bool = False) -> Callable[[], None]:
        """``graph`` ran a forward whose backward is still to come, holding ``planned_bytes``
        of activations and ``input_bytes`` of device inputs the step's earlier runs of it did
        not pass (``measured``: against the first run's; else every device input of a run the
        last step did not make, an upper bound the ledger does not learn from). Returns what to
        call once the run's backward starts or its autograd graph is gone (either, any number
        of times); when no run is left waiting, the step has finished."""
        if measured:
            self._inputs[graph] = max(self._inputs.get(graph, 0), input_bytes)
        runs = self._runs.setdefault(graph, [])
        planned_bytes += input_bytes
        runs.append(planned_bytes)
        self._ran.append(graph)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                runs.remove(planned_bytes)
                if not any(self._runs.values()):
                    self._before, self._ran = tuple(self._ran), []
                    self._inputs_known.update(self._inputs)

        return release

    def view(self, graph: GraphId) -> StepView:
        """What ``graph``'s passes plan against: the step's other graphs' shares, frozen."""
        return StepView(tuple(self._others(graph)))

    def record(self, graph: GraphId, share: GraphShare) -> None:
        """``graph``'s plan holds ``share``; warn once when it is over a byte budget."""
        self._shares[graph] = share
        self._least.pop(graph, None)
        self.last = graph
        if share.over_bytes > 0:
            self._warn_over(share.over_bytes)

    def share(self, graph: GraphId) -> GraphShare:
        """What this graph's last plan recorded."""
        return self._shares[graph]

    def _warn_over(self, excess: int) -> None:
        if self._warned:
            return
        self._warned = True
        warnings.warn(
            f"storm: the step's activation memory is planned {excess} bytes "
            f"({excess / GIB:.3f} GiB) over memory_budget: graphs compiled earlier in the step "
            f"were planned before this one existed and took the room; a fraction budget "
            f"(such as 0.5) shares the step between its graphs as they arrive",
            RuntimeWarning, stacklevel=2)


def runs_over(budget: int, held: int) -> str:
    """Why a run of a graph does not fit beside the ``held`` bytes the step holds: the step's
    ``budget`` (its byte ``memory_budget`` as planned, :attr:`MemoryBudget.planned`) and what
    makes a graph run again before a backward."""
    return (f"memory_budget leaves the step {budget} bytes ({budget / GIB:.3f} GiB), and one of "
            f"its compiled graphs runs again before the backward: beside the {held} bytes "
            f"({held / GIB:.3f} GiB) the step holds, no plan of that run fits. A graph runs "
            f"several times before a backward when identical blocks compile to one graph, when "
            f"a step makes several forwards before one backward (a siamese or GAN step), or "
            f"when an earlier forward's outputs still hold its autograd graph (a validation "
            f"loss kept with grad enabled: run validation under torch.no_grad(), or keep "
            f"loss.item()). Raise memory_budget, or make fewer forwards per backward")
