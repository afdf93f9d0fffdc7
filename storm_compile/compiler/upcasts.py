"""Outputs upcast to float32 by the code around a model, cast after the compiled graph instead.

A mixed-precision training loop often returns the model's outputs in float32 (accelerate's
``convert_outputs_to_fp32``, which the Hugging Face ``Trainer`` applies under ``bf16=True``):
``logits.float()`` runs inside the frame dynamo traces and becomes an output of the compiled
graph. When the loss is computed inside the model, nothing reads that output's gradient, and
autograd gives the compiled graph's backward a zero gradient of the output's size, which
lives through the backward: for a 128256-token vocabulary and 4096 tokens, 1.96 GiB of
float32 zeros, the half of it a bfloat16 output would take. Storm compiles the graph returning
the half-precision value and casts it after the compiled call; autograd then zero-fills a
gradient of the value's own dtype, and a loss that does read the float32 output gets its
gradient through the cast, as in eager.

Assumes: ``gm`` is dynamo's graph, its output node returns a flat tuple of values, and nodes
carry dynamo's ``example_value``. Guarantees: the compiled callable returns what ``gm`` returned,
value for value and dtype for dtype; only a cast to float32 of a half-precision value that is
computed in the graph, read by nothing else and returned once, with the value's device, shape
and strides, moves out of the graph.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from storm_compile.cost.cost_model import HALF_PRECISION

UPCASTS = frozenset({"float", "to"})
"""Tensor methods dynamo records for ``x.float()`` and ``x.to(torch.float32)``."""


def _upcast_source(node: Any) -> fx.Node | None:
    """The half-precision value ``node`` casts to float32 when it is such a cast that may move
    out of the graph (see the module docstring), else None."""
    if not isinstance(node, fx.Node) or node.op != "call_method" or node.target not in UPCASTS \
            or len(node.users) != 1 or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    source = node.args[0]
    cast, value = node.meta.get("example_value"), source.meta.get("example_value")
    if not isinstance(cast, torch.Tensor) or not isinstance(value, torch.Tensor):
        return None
    if source.op == "placeholder" or cast.dtype != torch.float32 \
            or value.dtype not in HALF_PRECISION or cast.device != value.device \
            or cast.shape != value.shape or cast.stride() != value.stride():
        return None
    return source


def move_upcasts(gm: fx.GraphModule) -> frozenset[int]:
    """Rewrite ``gm`` to return, in place of each float32 upcast the module docstring allows,
    the value it casts; the positions of those outputs, which :func:`cast_after` casts."""
    output = next(iter(gm.graph.find_nodes(op="output")))
    values = output.args[0]
    if not isinstance(values, (tuple, list)):
        return frozenset()
    returned = [v for v in values if isinstance(v, fx.Node)]
    moved, rewired = set(), list(values)
    for index, node in enumerate(values):
        source = _upcast_source(node)
        if source is None or source in returned or returned.count(node) != 1:
            continue
        rewired[index] = source
        moved.add(index)
    if not moved:
        return frozenset()
    output.args = (type(values)(rewired), *output.args[1:])
    for index in moved:
        gm.graph.erase_node(values[index])
    gm.recompile()
    return frozenset(moved)


def cast_after(compiled: Callable, moved: frozenset[int]) -> Callable:
    """``compiled``, with the outputs at the ``moved`` positions cast to float32 after it runs
    (as called: boxed or not)."""
    if not moved:
        return compiled

    def run(*args: Any) -> Any:
        outputs = compiled(*args)
        cast = [out.to(torch.float32) if index in moved else out
                for index, out in enumerate(outputs)]
        return cast if isinstance(outputs, list) else tuple(cast)

    if getattr(compiled, "_boxed_call", False):
        run._boxed_call = True
    return run
