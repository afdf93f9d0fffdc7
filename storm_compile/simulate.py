"""Replay a forward/backward graph pair on three lanes (compute, H2D, D2H) with the cost model.

The compute lane runs nodes in graph order; an ``offload``/``prefetch`` queues its copy on its
lane at the moment the compute lane reaches it (the copy stream first waits on the compute
stream), copies on a lane run one after another, and a ``wait_event`` holds the compute lane
until its copy is done; issuing a copy holds the compute lane for half the profile's
``transfer_host_s``. When copies run in both directions at once they share the link's duplex
bandwidth. Device memory: a tensor's storage is allocated when its owner runs (unless a fused
chain keeps it in registers) and released after the last use of the storage; forward inputs
(weights, inputs) are the baseline every figure is taken above. The same replay of the graphs
before storm rewrites them predicts the step without storm.
"""

from __future__ import annotations

import collections
import dataclasses
import operator

import torch
from torch import fx
from torch.utils._pytree import tree_leaves

from storm_compile import ops
from storm_compile.cost_model import CostModel, materialized
from storm_compile.graphs import StormGraphs, alias_root, is_view, output_node, saved_values

COMPUTE, D2H, H2D = "compute", "d2h", "h2d"

TRANSFER_DIRECTIONS = 2
"""A profile's ``transfer_host_s`` covers both directions; each half delays the compute lane
when its copy is issued (the host is busy with the ops instead of launching kernels)."""


@dataclasses.dataclass(frozen=True)
class NodeTiming:
    graph: str
    node: str
    lane: str
    start_s: float
    end_s: float
    memory_after: int
    """Device bytes live after the node, above forward inputs (weights and inputs)."""


@dataclasses.dataclass(frozen=True)
class CopyTiming:
    graph: str
    node: str
    lane: str
    start_s: float
    end_s: float
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Prediction:
    step_s: float
    forward_s: float
    exposed_transfer_s: float
    """Time the compute lane spent waiting on copies."""
    activation_bytes: int
    """Device bytes held at the end of the forward, above weights and inputs."""
    peak_bytes: int
    offloaded_bytes: int
    timings: tuple[NodeTiming, ...]
    copies: tuple[CopyTiming, ...]


class _Link:
    """Two FIFO copy lanes over one link; a copy pays its latency, then moves its bytes at the
    lane's bandwidth, or at its share of the duplex bandwidth while the other lane moves bytes."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self.time = 0.0
        self.queues: dict[str, collections.deque] = {D2H: collections.deque(),
                                                      H2D: collections.deque()}
        self.started: dict[fx.Node, float] = {}
        self.done: dict[fx.Node, float] = {}

    def enqueue(self, copy: fx.Node, lane: str, nbytes: int, ready: float) -> None:
        self.queues[lane].append([copy, ready, self.cost.profile.copy_latency_s, float(nbytes)])

    def finish_time(self, copy: fx.Node) -> float:
        while copy not in self.done:
            self._advance()
        return self.done[copy]

    def _advance(self) -> None:
        heads = {lane: q[0] for lane, q in self.queues.items() if q}
        active = {lane: h for lane, h in heads.items() if h[1] <= self.time}
        if not active:
            self.time = min(h[1] for h in heads.values())
            return
        moving = [lane for lane, h in active.items() if h[2] <= 0]
        shared = len(moving) == 2
        steps = []
        for lane, head in active.items():
            self.started.setdefault(head[0], self.time)
            if head[2] > 0:
                steps.append(head[2])
            else:
                steps.append(head[3] / self.cost.bandwidth(lane, shared))
        steps += [h[1] - self.time for lane, h in heads.items() if lane not in active]
        dt = min(steps)
        self.time += dt
        for lane, head in active.items():
            if head[2] > 0:
                head[2] -= dt
            else:
                head[3] -= dt * self.cost.bandwidth(lane, shared)
            if head[2] <= 1e-15 and head[3] <= 1e-6:
                self.done[head[0]] = self.time
                self.queues[lane].popleft()


def _storage_bytes(node: fx.Node) -> int:
    return sum(v.numel() * v.element_size() for v in tree_leaves(node.meta.get("val"))
               if isinstance(v, torch.Tensor))


class _Memory:
    """Live device bytes, by storage owner, over one graph walk."""

    def __init__(self, graph: fx.Graph, host_inputs: set[fx.Node]):
        self.host_inputs = host_inputs
        order = {n: i for i, n in enumerate(graph.nodes)}
        self.last_use: dict[fx.Node, int] = {}
        self.escapes: set[fx.Node] = set()
        for node in graph.nodes:
            owner = self.owner(node)
            if owner is None:
                continue
            self.last_use.setdefault(owner, order[owner])
            for user in node.users:
                if user.op == "output":
                    self.escapes.add(owner)
                self.last_use[owner] = max(self.last_use.get(owner, order[node]), order[user])
        self.release_at: dict[int, list[fx.Node]] = collections.defaultdict(list)
        for owner, index in self.last_use.items():
            if owner not in self.escapes:
                self.release_at[index].append(owner)

    def owner(self, node: fx.Node) -> fx.Node | None:
        """The node whose allocation ``node``'s value lives in; None for host memory."""
        while True:
            if node.target is ops.offload:
                return None
            elif is_view(node) and isinstance(node.args[0], fx.Node):
                node = node.args[0]
            elif node in self.host_inputs:
                return None
            else:
                return node


def _walk(gm: fx.GraphModule, name: str, cost: CostModel, link: _Link, start: float,
          live: int, held: list[fx.Node], host_inputs: set[fx.Node], baseline: int,
          timings: list[NodeTiming]) -> tuple[float, int, int, float]:
    """Run one graph from ``live`` bytes, of which ``held`` are inputs it may release; returns
    (end time, live bytes at the end, peak live bytes, stall time)."""
    memory = _Memory(gm.graph, host_inputs)
    allocated = {node: _storage_bytes(node) for node in held}
    t, peak, stall = start, live, 0.0
    for index, node in enumerate(gm.graph.nodes):
        lane, begin = COMPUTE, t
        if node.target in (ops.offload, ops.prefetch):
            lane = D2H if node.target is ops.offload else H2D
            link.enqueue(node, lane, _storage_bytes(node), t)
            t += cost.profile.transfer_host_s / TRANSFER_DIRECTIONS
        elif node.target is ops.wait_event:
            copy = node.args[0].args[0]
            t = max(t, link.finish_time(copy))
            stall += t - begin
        elif node.op == "call_function" and not is_view(node) \
                and node.target is not operator.getitem:
            t += cost.compute_seconds(node)
        else:
            lane = "-"
        if node.op == "call_function" and memory.owner(node) is node \
                and isinstance(node.meta.get("val"), torch.Tensor) and materialized(node):
            allocated[node] = _storage_bytes(node)
            live += allocated[node]
            peak = max(peak, live)
        for owner in memory.release_at.get(index, ()):
            live -= allocated.pop(owner, 0)
        timings.append(NodeTiming(name, node.name, lane, begin, t, live - baseline))
    return t, live, peak, stall


def simulate(graphs: StormGraphs, cost: CostModel) -> Prediction:
    """Predict step time, exposed transfer time, activation memory and peak of the pair."""
    fw, bw = graphs.forward, graphs.backward
    link = _Link(cost)
    timings: list[NodeTiming] = []
    inputs = set(fw.graph.find_nodes(op="placeholder"))
    baseline = sum(_storage_bytes(n) for n in inputs)
    fw_end, fw_live, fw_peak, fw_stall = _walk(fw, "fw", cost, link, 0.0, baseline, [],
                                               set(), baseline, timings)

    input_views = {n.name for n in saved_values(graphs) if alias_root(n).op == "placeholder"}
    bw_inputs = list(bw.graph.find_nodes(op="placeholder"))
    host_inputs = {n for n in bw_inputs if any(u.target is ops.prefetch for u in n.users)}
    persistent = {n for n in bw_inputs if n.name in input_views}
    on_device = [n for n in bw_inputs if n not in persistent and n not in host_inputs]
    visible = [n for n in output_node(fw).args[0][:graphs.num_fwd_outputs]
               if isinstance(n, fx.Node)]
    bw_live = baseline + sum(_storage_bytes(n) for n in visible) + sum(
        _storage_bytes(n) for n in on_device)
    bw_end, _, bw_peak, bw_stall = _walk(bw, "bw", cost, link, fw_end, bw_live, on_device,
                                         host_inputs, baseline, timings)
    copies = []
    for name, gm in (("fw", fw), ("bw", bw)):
        for target, lane in ((ops.offload, D2H), (ops.prefetch, H2D)):
            for node in gm.graph.find_nodes(op="call_function", target=target):
                if node in link.done:
                    copies.append(CopyTiming(name, node.name, lane, link.started[node],
                                             link.done[node], _storage_bytes(node)))
    return Prediction(
        step_s=bw_end, forward_s=fw_end, exposed_transfer_s=fw_stall + bw_stall,
        activation_bytes=fw_live - baseline, peak_bytes=max(fw_peak, bw_peak) - baseline,
        offloaded_bytes=sum(c.nbytes for c in copies if c.lane == D2H),
        timings=tuple(timings), copies=tuple(copies))
