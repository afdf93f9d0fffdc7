"""Replay a forward/backward graph pair on three lanes (compute, H2D, D2H) with the cost model.

The compute lane runs nodes in graph order; an ``offload``/``prefetch`` queues its copy on its
lane at the moment the compute lane reaches it (the copy stream first waits on the compute
stream), copies on a lane run one after another, and a ``wait_event`` holds the compute lane
until its copy is done; issuing a copy holds the compute lane for half the profile's
``transfer_host_s``. When copies run in both directions at once they share the link's duplex
bandwidth. Device memory: a tensor's storage is allocated when its owner runs, unless a fused
chain keeps it in registers (``realized_values``: what Inductor writes), and released after the
last kernel that reads it (a fused op reads its inputs where the kernel computing it runs); an
op also holds its workspace while it runs, and a channels-last conv net the copies Inductor
makes of its batch and weights; forward inputs (weights, inputs) are the baseline every figure
is taken above. The same replay of the graphs before storm rewrites them predicts the step
without storm.

A fourth lane is storm's host thread (``runtime.HostAdder``): each ``accumulate_grad`` hands it
a gradient, which it adds once the gradient's copy home is done, in graph order (in a step's
first micro-batch a weight's first gradient costs it nothing: it stays in its buffer as the
weight's ``.grad``; so does the sum of a weight whose gradients are summed on the device, which
comes home once a step, and in the step's other micro-batches those gradients cost a device
addition instead of a copy home and the host's work); with an overlapped optimizer it steps
each streamed weight once the weight's gradients are all added, between additions while the
next copy still moves, and after the last. ``wait_host`` holds the end of the backward until the
host thread is done. The host is assumed to have launched the backward's kernels ahead of the
GPU, so a step never waits for the launches to end.
:func:`predict_step` puts micro-batches and the optimizer together into one optimizer step.
"""

from __future__ import annotations

import collections
import dataclasses

import torch
from torch import fx

from storm_compile.cost.cost_model import (
    CostModel,
    channels_last_graph,
    is_fusible,
    realized_values,
)
from storm_compile.fx.graphs import StormGraphs, output_node, saved_values
from storm_compile.fx.plan import ResidentWeight
from storm_compile.fx.prediction import (
    CopyTiming,
    HostTiming,
    NodeTiming,
    Prediction,
    StepPrediction,
)
from storm_compile.fx.vocabulary import (
    COPY_LANES,
    Lane,
    is_compute,
    folds_on_device,
    storage_owner,
    sums_on_device,
    tensor_bytes,
)
from storm_compile.runtime import ops
from storm_compile.runtime.streams import fold_device_bytes

TRANSFER_DIRECTIONS = 2
"""A profile's ``transfer_host_s`` covers both directions; each half delays the compute lane
when its copy is issued (the host is busy with the ops instead of launching kernels)."""


CHANNELS_LAST_DIMS = 4
"""The tensors Inductor copies into channels-last order for a 2-D convolution: (N, C, H, W)."""

FOLD_IN = "fold_in"
"""Tags the copy in of the host sum a folded ``storm.send_grad`` adds its gradient into."""

COPY_DONE_S = 1e-15
"""Latency left below which a copy's latency counts as paid (float round-off of the steps)."""
COPY_DONE_BYTES = 1e-6
"""Bytes left below which a copy counts as moved (float round-off of the steps)."""


@dataclasses.dataclass
class _Copy:
    """One queued copy: its latency, then its bytes, counted down as the link advances."""

    node: fx.Node | tuple
    """The copy, or ``(send, FOLD_IN)``: the copy in of a folded send's host sum."""
    ready_s: float
    latency_left_s: float
    bytes_left: float


class _Link:
    """Two FIFO copy lanes over one link; a copy pays its latency, then moves its bytes at the
    lane's bandwidth, or at its share of the duplex bandwidth while the other lane moves bytes."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self.time = 0.0
        self.queues: dict[Lane, collections.deque[_Copy]] = {Lane.D2H: collections.deque(),
                                                             Lane.H2D: collections.deque()}
        self.started: dict[fx.Node, float] = {}
        self.done: dict[fx.Node, float] = {}
        self.after: dict[fx.Node, tuple] = {}
        """A copy that is done only once another is too."""

    def enqueue(self, copy: fx.Node | tuple, lane: Lane, nbytes: int, ready: float,
                after: tuple | None = None) -> None:
        self.queues[lane].append(_Copy(copy, ready, self.cost.profile.copy_latency_s,
                                       float(nbytes)))
        if after is not None:
            self.after[copy] = after

    def finish_time(self, copy: fx.Node | tuple) -> float:
        while copy not in self.done:
            self._advance()
        after = self.after.get(copy)
        return self.done[copy] if after is None else max(self.done[copy],
                                                         self.finish_time(after))

    def _advance(self) -> None:
        heads = {lane: q[0] for lane, q in self.queues.items() if q}
        active = {lane: h for lane, h in heads.items() if h.ready_s <= self.time}
        if not active:
            self.time = min(h.ready_s for h in heads.values())
            return
        moving = [lane for lane, h in active.items() if h.latency_left_s <= 0]
        shared = len(moving) == 2
        steps = []
        for lane, head in active.items():
            self.started.setdefault(head.node, self.time)
            if head.latency_left_s > 0:
                steps.append(head.latency_left_s)
            else:
                steps.append(head.bytes_left / self.cost.bandwidth(lane, shared))
        steps += [h.ready_s - self.time for lane, h in heads.items() if lane not in active]
        dt = min(steps)
        self.time += dt
        for lane, head in active.items():
            if head.latency_left_s > 0:
                head.latency_left_s -= dt
            else:
                head.bytes_left -= dt * self.cost.bandwidth(lane, shared)
            if head.latency_left_s <= COPY_DONE_S and head.bytes_left <= COPY_DONE_BYTES:
                self.done[head.node] = self.time
                self.queues[lane].popleft()


def _copy_of(node: fx.Node) -> fx.Node:
    """The copy whose buffer ``node`` (a record, wait or accumulate of it) stands for."""
    while node.target not in COPY_LANES:
        node = node.args[0]
    return node


def _storage_bytes(node: fx.Node) -> int:
    return tensor_bytes(node.meta.get("val"))


def _read_at(graph: fx.Graph, order: dict[fx.Node, int], realized: set[fx.Node]
             ) -> dict[fx.Node, int]:
    """Where each node's inputs are last read: its own position unless Inductor folds it into
    other kernels (fusible, not ``realized``), else the last place its users read it: a fused
    value is computed inside the kernels of the values it flows into, which read its inputs
    there (a convolution's output, cast to float32 inside a group norm's kernels, stays live
    until the norm's backward reads it). Views read their base where their users read them,
    which :class:`_Memory` counts through storage owners."""
    read_at: dict[fx.Node, int] = {}
    for node in reversed(graph.nodes):
        inlined = node.op == "call_function" and node not in realized and node.users \
            and is_fusible(node)
        read_at[node] = max(read_at[u] for u in node.users) if inlined else order[node]
    return read_at


class _Memory:
    """Live device bytes, by storage owner, over one graph walk."""

    def __init__(self, graph: fx.Graph, host_inputs: set[fx.Node]):
        self.host_inputs = host_inputs
        order = {n: i for i, n in enumerate(graph.nodes)}
        self.owners = {node: self.owner(node) for node in graph.nodes}
        """:meth:`owner` of every node of the graph."""
        self.realized = realized_values(graph)
        """The nodes whose outputs Inductor writes to memory."""
        read_at = _read_at(graph, order, self.realized)
        self.last_use: dict[fx.Node, int] = {}
        self.escapes: set[fx.Node] = set()
        for node in graph.nodes:
            owner = self.owners[node]
            if owner is None:
                continue
            self.last_use.setdefault(owner, order[owner])
            for user in node.users:
                if user.op == "output":
                    self.escapes.add(owner)
                self.last_use[owner] = max(self.last_use.get(owner, order[node]), read_at[user])
        self.release_at: dict[int, list[fx.Node]] = collections.defaultdict(list)
        for owner, index in self.last_use.items():
            if owner not in self.escapes:
                self.release_at[index].append(owner)

    def owner(self, node: fx.Node) -> fx.Node | None:
        """The node whose allocation ``node``'s value lives in; None for host memory."""
        owner = storage_owner(node)
        to_host = COPY_LANES.get(owner.target) is Lane.D2H
        return None if to_host or owner in self.host_inputs else owner


class _HostThread:
    """storm's host thread over one backward: gradients added in the order they are handed
    over, each once its copy home is done; with ``steps``, each weight stepped once its
    gradients are all added, while the thread would otherwise wait for the next copy; with
    ``first`` (a step's first micro-batch, every ``.grad`` None), each weight's first gradient
    kept as its ``.grad`` at no cost (``runtime.HostAdder``)."""

    def __init__(self, cost: CostModel, name: str, steps: bool, first: bool,
                 folded: frozenset[fx.Node] = frozenset()) -> None:
        self.cost, self.name, self.steps, self.first = cost, name, steps, first
        self.folded = folded
        """The sends whose gradients are folded into their host sums on the device."""
        self.adds: list[fx.Node] = []
        self.timings: list[HostTiming] = []
        self.kept: set[fx.Node] = set()
        """The weights whose first gradient was kept."""

    def hand_over(self, accumulate: fx.Node) -> None:
        self.adds.append(accumulate)

    def finish_time(self, link: _Link) -> float:
        """When the thread is done with every addition (and step) handed over so far."""
        adds_left = collections.Counter(a.args[1] for a in self.adds)
        ready: collections.deque[fx.Node] = collections.deque()
        free = 0.0
        for accumulate in self.adds:
            arrives = link.finish_time(_copy_of(accumulate))
            while ready and free < arrives:
                free = self._run(ready.popleft(), "step", free)
            weight = accumulate.args[1]
            first = self.first and weight not in self.kept
            copy = _copy_of(accumulate)
            work = "keep" if first or sums_on_device(copy) or copy in self.folded else "add"
            self.kept.add(weight)
            free = self._run(accumulate, work, max(free, arrives))
            adds_left[weight] -= 1
            if self.steps and adds_left[weight] == 0:
                ready.append(weight)
        while ready:
            free = self._run(ready.popleft(), "step", free)
        self.adds.clear()
        return free

    def _run(self, node: fx.Node, work: str, start: float) -> float:
        if work in ("add", "keep"):
            nbytes = _storage_bytes(node.args[0])
            end = start + (self.cost.host_add_seconds(nbytes) if work == "add" else 0.0)
        else:
            nbytes = _storage_bytes(node)
            end = start + self.cost.host_step_seconds(nbytes)
        self.timings.append(HostTiming(self.name, node.name, work, start, end, nbytes))
        return end


@dataclasses.dataclass(frozen=True)
class _Walked:
    """What one graph's run left, in seconds from the step's start and bytes on the device."""

    end_s: float
    live_bytes: int
    """Live at the end of the graph."""
    peak_bytes: int
    stall_s: float
    """Compute stream time spent waiting on copies."""
    host_wait_s: float
    """Time ``wait_host`` waited for the host thread once the copies were done."""


def _running_bytes(node: fx.Node, cost: CostModel, channels_last: bool) -> int:
    """Device bytes ``node`` holds while it runs beyond what is live before it: its workspace
    and, for an op returning several tensors (allocated by the items that read them), those
    tensors."""
    value = node.meta.get("val")
    several = isinstance(value, (tuple, list)) and not is_fusible(node)
    outputs = tensor_bytes(value) if several else 0
    return cost.workspace_bytes(node, channels_last) + outputs


def _laid_out_inputs(graph: fx.Graph) -> list[fx.Node]:
    """The forward's 4-D inputs Inductor copies channels-last for its convolutions (the batch and
    the weights, when :func:`channels_last_graph`): a copy of each, made as the forward starts,
    which the backward reads in the input's place when the input is saved."""
    read = {node.args[index] for node in graph.find_nodes(
        op="call_function", target=torch.ops.aten.convolution.default) for index in (0, 1)}
    return [n for n in graph.find_nodes(op="placeholder")
            if n in read and isinstance(n.meta.get("val"), torch.Tensor)
            and n.meta["val"].dim() == CHANNELS_LAST_DIMS
            and not n.meta["val"].is_contiguous(memory_format=torch.channels_last)]


def _walk(gm: fx.GraphModule, name: str, cost: CostModel, link: _Link, host: _HostThread,
          start: float, live: int, held: list[fx.Node], host_inputs: set[fx.Node],
          baseline: int, timings: list[NodeTiming], channels_last: bool,
          kept: set[fx.Node] = frozenset()) -> _Walked:
    """Run one graph from ``live`` bytes, of which ``held`` are inputs it may release (or copies
    of them); ``channels_last``: whether Inductor lays the pair's convolutions out so;
    ``kept``: the gradients' sends that add into a sum on the device instead of copying."""
    memory = _Memory(gm.graph, host_inputs)
    allocated = {node: _storage_bytes(node) for node in held}
    t, peak, stall, host_wait = start, live, 0.0, 0.0
    for index, node in enumerate(gm.graph.nodes):
        lane, begin = Lane.COMPUTE, t
        if node in kept:
            t += cost.device_add_seconds(_storage_bytes(node))
        elif node.target in COPY_LANES:
            lane = COPY_LANES[node.target]
            fold_in = (node, FOLD_IN) if node in host.folded else None
            if fold_in is not None:
                link.enqueue(fold_in, Lane.H2D, _storage_bytes(node), t)
            link.enqueue(node, lane, _storage_bytes(node), t, after=fold_in)
            t += cost.profile.transfer_host_s / TRANSFER_DIRECTIONS
        elif node.target in (ops.wait_event, ops.wait_host):
            waited = node.args[0] if node.target is ops.wait_host else [node.args[0]]
            t = max([t, *(link.finish_time(_copy_of(w)) for w in waited
                          if _copy_of(w) not in kept)])
            stall += t - begin
            if node.target is ops.wait_host:
                copies_done = t
                t = max(t, host.finish_time(link))
                host_wait += t - copies_done
        elif node.target is ops.accumulate_grad:
            if _copy_of(node) not in kept:
                host.hand_over(node)
            lane = Lane.NONE
        elif is_compute(node):
            t += cost.compute_seconds(node)
        else:
            lane = Lane.NONE
        if lane is Lane.COMPUTE:
            peak = max(peak, live + _running_bytes(node, cost, channels_last))
        if node.op == "call_function" and memory.owners[node] is node \
                and isinstance(node.meta.get("val"), torch.Tensor) and node in memory.realized:
            allocated[node] = _storage_bytes(node)
            live += allocated[node]
            peak = max(peak, live)
        for owner in memory.release_at.get(index, ()):
            live -= allocated.pop(owner, 0)
        timings.append(NodeTiming(name, node.name, lane, begin, t, live - baseline))
    return _Walked(t, live, peak, stall, host_wait)


def simulate(graphs: StormGraphs, cost: CostModel, steps: bool = False,
             first: bool = False, held: bool = False, folded: bool = False) -> Prediction:
    """Predict step time, exposed transfer time, activation memory and peak of the pair; with
    ``steps``, the host thread also steps each streamed weight in the backward (an overlapped
    optimizer's last micro-batch); with ``first``, the pair is a step's first micro-batch,
    whose gradients the host keeps as ``.grad`` instead of adding them; with ``held``, a
    micro-batch of a step of several but its last, whose gradients summed on the device stay
    there; with ``folded``, the last micro-batch of a step of several, whose gradients sent with
    their weights (:func:`~storm_compile.fx.vocabulary.folds_on_device`) are folded into their
    host sums on the device: each such send copies the sum in beside its copy home, and the
    host adds nothing for it."""
    fw, bw = graphs.forward, graphs.backward
    link = _Link(cost)
    folds = frozenset(n for n in bw.graph.find_nodes(op="call_function", target=ops.send_grad)
                      if folded and folds_on_device(n))
    host = _HostThread(cost, "bw", steps, first, folds)
    timings: list[NodeTiming] = []
    inputs = set(fw.graph.find_nodes(op="placeholder"))
    baseline = sum(_storage_bytes(n) for n in inputs)
    channels_last = channels_last_graph(fw.graph)
    laid_out = _laid_out_inputs(fw.graph) if channels_last else []
    forward = _walk(fw, "fw", cost, link, host, 0.0,
                    baseline + sum(_storage_bytes(n) for n in laid_out), laid_out, set(),
                    baseline, timings, channels_last)

    saved_inputs = {n.name: storage_owner(n) for n in saved_values(graphs)
                    if storage_owner(n).op == "placeholder"}
    bw_inputs = list(bw.graph.find_nodes(op="placeholder"))
    host_inputs = {n for n in bw_inputs if any(u.target is ops.prefetch for u in n.users)}
    persistent = {n for n in bw_inputs if n.name in saved_inputs}
    on_device = [n for n in bw_inputs if n not in persistent and n not in host_inputs]
    copied = [n for n in bw_inputs if n in persistent and saved_inputs[n.name] in laid_out]
    visible = [n for n in output_node(fw).args[0][:graphs.num_fwd_outputs]
               if isinstance(n, fx.Node)]
    bw_live = baseline + sum(_storage_bytes(n) for n in visible) + sum(
        _storage_bytes(n) for n in on_device + copied)
    kept = {n for n in bw.graph.find_nodes(op="call_function", target=ops.send_grad)
            if held and sums_on_device(n)}
    backward = _walk(bw, "bw", cost, link, host, forward.end_s, bw_live, on_device + copied,
                     host_inputs, baseline, timings, channels_last, kept)
    copies = []
    for name, gm in (("fw", fw), ("bw", bw)):
        for target, lane in COPY_LANES.items():
            for node in gm.graph.find_nodes(op="call_function", target=target):
                if node in link.done:
                    copies.append(CopyTiming(name, node.name, lane, link.started[node],
                                             link.done[node], _storage_bytes(node)))
                if (node, FOLD_IN) in link.done:
                    copies.append(CopyTiming(name, f"{node.name}.{FOLD_IN}", Lane.H2D,
                                             link.started[node, FOLD_IN],
                                             link.done[node, FOLD_IN], _storage_bytes(node)))
    return Prediction(
        step_s=backward.end_s, forward_s=forward.end_s,
        exposed_transfer_s=forward.stall_s + backward.stall_s,
        activation_bytes=forward.live_bytes - baseline,
        peak_bytes=max(forward.peak_bytes, backward.peak_bytes) - baseline,
        offloaded_bytes=sum(_storage_bytes(n) for n in fw.graph.find_nodes(
            op="call_function", target=ops.offload)),
        host_wait_s=backward.host_wait_s, timings=tuple(timings), copies=tuple(copies),
        host=tuple(host.timings))


def stepped_weights(graphs: StormGraphs) -> list[fx.Node]:
    """The backward's inputs that are streamed weights, each once: what an optimizer over the
    host parameters steps. Their gradients go home through ``storm.accumulate_grad`` (storm's
    rewritten graphs) or ``storm.grad_to_host`` (as traced)."""
    homes = [n for target in (ops.accumulate_grad, ops.grad_to_host)
             for n in graphs.backward.graph.find_nodes(op="call_function", target=target)]
    return list(dict.fromkeys(n.args[1] for n in homes))


def refreshed_weights(graphs: StormGraphs) -> list[ResidentWeight]:
    """The trained weights the plan keeps on the device: the optimizer changes each of them, so
    the first micro-batch of the next step copies it there again, on the compute stream, before
    its first read (``TransferRuntime.mirror``). A frozen weight kept there is copied once."""
    stepped = {w.name for w in stepped_weights(graphs)}
    return [w for w in graphs.storages.resident if w.name in stepped]


def predict_step(graphs: StormGraphs, cost: CostModel, micro_batches: int,
                 overlapped: bool, accumulating: bool = False) -> StepPrediction:
    """One optimizer step of ``micro_batches`` forward and backward passes of the pair, AdamW
    (fused, on the host) over its streamed weights: after the last backward, or, ``overlapped``
    (:class:`~storm_compile.weights.streaming.OverlappedOptimizer`), on the host thread during it.
    The first micro-batch's gradients become the weights' ``.grad`` without additions (the loop
    calls ``zero_grad`` between steps), and it first copies the trained weights kept on the
    device there again (:func:`refreshed_weights`).
    ``accumulating`` (:func:`~storm_compile.weights.streaming.gradient_accumulation`): a micro-batch
    but the last does not wait for its gradients' additions, which run during the next one
    (whose end waits for them);
    a micro-batch then takes its forward and backward or the host's additions, whichever is
    longer. The optimizer's device work for parameters left on the device is not counted (for
    a streamed model: its norms and biases, a few MiB)."""
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be at least 1, got {micro_batches}")
    only = micro_batches == 1
    first = simulate(graphs, cost, steps=overlapped and only, first=True, held=not only)
    each = first if only else simulate(graphs, cost, held=True)
    last = first if only else simulate(graphs, cost, steps=overlapped, folded=True)
    optimizer = 0.0 if overlapped else sum(
        cost.host_step_seconds(_storage_bytes(w)) for w in stepped_weights(graphs))
    refresh = sum(cost.transfer_seconds(w.nbytes, Lane.H2D) for w in refreshed_weights(graphs))
    opening, opening_wait = first.step_s + refresh, first.host_wait_s
    micro, wait = each.step_s, each.host_wait_s
    if accumulating and not only:
        adding = sum(h.end_s - h.start_s for h in each.host if h.work == "add")
        micro, wait = max(each.step_s - each.host_wait_s, adding), 0.0
        opening, opening_wait = first.step_s + refresh - first.host_wait_s, 0.0
    return StepPrediction(micro_batches=micro_batches, overlapped=overlapped,
                          accumulating=accumulating, first_micro_batch_s=opening,
                          micro_batch_s=micro, last_micro_batch_s=last.step_s,
                          optimizer_s=optimizer, exposed_transfer_s=each.exposed_transfer_s,
                          first_host_wait_s=opening_wait, host_wait_s=wait,
                          last_host_wait_s=last.host_wait_s)


def host_inputs(graphs: StormGraphs) -> set[fx.Node]:
    """Forward inputs that live in host memory: the streamed weights, copied in by prefetches."""
    return {n for n in graphs.forward.graph.find_nodes(op="placeholder")
            if any(u.target is ops.prefetch for u in n.users)}


def device_bytes(graphs: StormGraphs, prediction: Prediction) -> int:
    """Device memory at the predicted peak: the forward's inputs that live on the device
    (parameters left there, buffers, the batch, the kept copy of a resident streamed weight),
    the buffers a backward that folds gradients into their host sums folds them through, and
    the peak above them."""
    streamed = host_inputs(graphs)
    sums = sum(w.nbytes for w in graphs.storages.resident if w.summed) \
        if graphs.storages is not None else 0
    folds = [n for n in graphs.backward.graph.find_nodes(op="call_function", target=ops.send_grad)
             if folds_on_device(n)]
    folding = fold_device_bytes(max(map(_storage_bytes, folds), default=0))
    return prediction.peak_bytes + sums + folding + sum(
        tensor_bytes(n.meta.get("val")) for n in graphs.forward.graph.find_nodes(op="placeholder")
        if n not in streamed)
