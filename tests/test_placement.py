"""Placement on the H2D lane: streamed weights' fetches first, activations' prefetches in the
lane time they leave."""

import torch
from torch import fx

from helpers import CPU_TEST_OPTIONS, cost_model
from storm_compile.config import StormConfig
from storm_compile.cost import placement
from storm_compile.fx.graphs import COST_KEY, NodeCost, PassContext
from storm_compile.fx.plan import Unplaced
from storm_compile.fx.vocabulary import Lane
from storm_compile.runtime import ops

aten = torch.ops.aten
COPY_S = 1.0
"""Each copy's predicted time: both fill the lane before their read."""


def _backward(first_compute_s: float) -> tuple[fx.GraphModule, dict[str, fx.Node]]:
    """``n1 = relu(x)`` (``first_compute_s``), ``f = fetch_weight(w)``, ``n2 = mm(n1, f)``
    (1 s): a streamed weight and an activation both first read by ``n2``."""
    graph = fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    n1 = graph.call_function(aten.relu.default, (x,), name="n1")
    f = graph.call_function(ops.fetch_weight, (w, "cpu"), name="f")
    n2 = graph.call_function(aten.mm.default, (n1, f), name="n2")
    graph.output((n2,))
    seconds = {"n1": first_compute_s, "n2": 1.0}
    for node in graph.nodes:
        node.meta[COST_KEY] = NodeCost(0, node.name in seconds, seconds.get(node.name, 0.0))
    return fx.GraphModule(torch.nn.Module(), graph), {n.name: n for n in graph.nodes}


def _requests(named: dict[str, fx.Node], ctx: PassContext) -> list[placement._Request]:
    """The activation (keyed by ``x``) before the weight, as ``place`` lists them."""
    nbytes = _bytes_for(COPY_S, ctx)
    return [placement._Request(named["x"], nbytes, named["n2"]),
            placement._Request(named["f"], nbytes, named["n2"])]


def _bytes_for(seconds: float, ctx: PassContext) -> int:
    one = ctx.cost.transfer_seconds(1 << 20, Lane.H2D) - ctx.cost.transfer_seconds(0, Lane.H2D)
    return int((seconds - ctx.cost.transfer_seconds(0, Lane.H2D)) / one * (1 << 20))


WINDOW_BYTES = 1 << 40
"""A prefetch window the copies' bytes never fill: only lane time limits them here."""


def _ctx() -> PassContext:
    return PassContext(StormConfig.from_options(**CPU_TEST_OPTIONS,
                                                prefetch_window_bytes=WINDOW_BYTES),
                       cost_model())


def test_a_prefetch_that_would_push_a_weights_fetch_late_does_not_hide():
    """The lane holds one copy before ``n2`` (1.5 s of compute less half a copy's slack): the
    weight's fetch takes it, and the activation's prefetch, which would otherwise have taken
    it and left the fetch late, is late itself."""
    gm, named = _backward(first_compute_s=1.5)
    ctx = _ctx()
    placed = placement._h2d(gm, placement._Timeline(gm), _requests(named, ctx), {named["f"]},
                            ctx)
    assert placed[named["f"]].slack_s >= 0
    assert isinstance(placed[named["x"]], Unplaced) and placed[named["x"]].late_s > 0


def test_with_room_for_both_both_hide():
    gm, named = _backward(first_compute_s=3.0)
    ctx = _ctx()
    placed = placement._h2d(gm, placement._Timeline(gm), _requests(named, ctx), {named["f"]},
                            ctx)
    assert placed[named["f"]].slack_s >= 0 and placed[named["x"]].slack_s >= 0
