"""Realise the planner's recompute decisions on the split it planned.

Assumes: ``plan_memory`` ran on the partitioner's first split (``graphs``) and named in
``plan.recompute`` every forward node to rebuild: each recomputed storage's owner, its saved
views and the forward nodes between it and the values that stay saved (its recompute chain,
``plan_memory._recompute_chain``), so each named node reads only named nodes, saved values,
graph inputs and constants.
Guarantees: when the plan recomputes nothing, the graphs come back unchanged. Otherwise a new
pair, the given graphs untouched: the forward no longer returns the named nodes (nor computes
those only they needed) and returns, among its saved values, each graph input a chain reads
that it did not save (after the saved tensors checked for in-place changes, AOTAutograd's
order); the backward takes those inputs and, right before the first node that needs it, runs a
copy of each named node that a backward read reaches (directly or through another copy),
reading the saved values, the new inputs and the copies: the order in which the autograd
engine would rebuild them, and no node the chain does not need. Nothing else moves, so the
plan's figures (recompute time, the bytes that leave the device) are the pair's. The new pair
carries the same ``joint``, ``plan`` (whose ``recomputed`` keeps the recomputed storages'
decisions for the report) and ``share``, and no storage plan yet: ``annotate_costs``,
``plan_offload`` and ``plan_memory`` run again on it. A chain whose new backward input has a
symbolic size the backward does not bind (the partitioner would have to save the symbol too)
raises :class:`RecomputeRejectedError` (the pipeline then plans without recomputation).
Emits: no storm nodes; in the backward, copies of the named forward nodes under their own
names.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import free_symbols

from storm_compile.fx.graphs import (
    PassContext,
    StormGraphs,
    backward_inputs,
    is_symbolic,
    output_node,
    saved_values,
)
from storm_compile.fx import torch_private
from storm_compile.fx.torch_private import LazyGraphModule
from storm_compile.fx.vocabulary import node_order

NO_VC_CHECK = "saved_tensor_with_no_vc_check"
"""``node.meta`` flag of a value AOTAutograd saves without checking it for in-place changes:
such values come last among the saved tensors."""


class RecomputeRejectedError(RuntimeError):
    """The planned recomputation cannot be realised on the split it was planned on."""


def rematerialize(graphs: StormGraphs, ctx: PassContext) -> StormGraphs:
    if graphs.plan is None or not graphs.plan.recompute:
        return graphs
    forward = graphs.forward.graph
    names = set(graphs.plan.recompute)
    rebuilt = [n for n in forward.nodes if n.name in names]
    chosen = set(rebuilt)
    inputs = backward_inputs(graphs)
    saved = saved_values(graphs)
    read = [a for a in dict.fromkeys(a for n in rebuilt for a in n.all_input_nodes)
            if a not in chosen and a not in inputs]
    unknown = [a.name for a in read if a.op not in ("placeholder", "get_attr")]
    if unknown:
        raise RecomputeRejectedError(f"a recompute chain reads {unknown}, which the forward "
                                     f"neither saves nor takes as an input")
    added = [a for a in read if a.op == "placeholder"]
    _check_symbols(added, inputs)
    kept = [s for s in saved if s not in chosen]
    at = next((i for i, s in enumerate(kept) if not _checked_tensor(s)), len(kept))
    now_saved = kept[:at] + added + kept[at:]
    constants = [a for a in read if a.op == "get_attr"]
    backward = _backward(graphs, rebuilt, inputs, now_saved, constants)
    return StormGraphs(_forward(graphs, saved, now_saved), backward, graphs.num_fwd_outputs,
                       joint=graphs.joint, plan=graphs.plan, share=graphs.share)


def _checked_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor) and not node.meta.get(NO_VC_CHECK)


def _check_symbols(added: list[fx.Node], inputs: dict[fx.Node, fx.Node]) -> None:
    """Raise :class:`RecomputeRejectedError` when a new backward input has a symbolic size
    that no saved symbolic size binds."""
    bound = {value.node.expr for value in (s.meta.get("val") for s in inputs)
             if isinstance(value, torch.SymInt)}
    for node in added:
        value = node.meta.get("val")
        unbound = free_symbols(value) - bound if isinstance(value, torch.Tensor) else set()
        if unbound:
            raise RecomputeRejectedError(
                f"recomputing from {node.name} needs its symbolic sizes "
                f"{sorted(map(str, unbound))}, which the backward does not take")


def _forward(graphs: StormGraphs, saved: list[fx.Node], now_saved: list[fx.Node]
             ) -> fx.GraphModule:
    """A copy of the forward returning ``now_saved`` after its own outputs, without the nodes
    only the values it no longer saves needed."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in graphs.forward.graph.nodes:
        if node.op != "output":
            env[node] = graph.node_copy(node, env.__getitem__)
    out = output_node(graphs.forward)
    own = list(out.args[0][:graphs.num_fwd_outputs])
    result = graph.output(tuple(env[v] if isinstance(v, fx.Node) else v
                                for v in (*own, *now_saved)))
    result.meta.update(out.meta)
    if "desc" in out.meta:
        descs = dict(zip(saved, out.meta["desc"][graphs.num_fwd_outputs:]))
        result.meta["desc"] = [*out.meta["desc"][:graphs.num_fwd_outputs], *(
            dataclasses.replace(descs[s], idx=i) if s in descs
            else torch_private.SavedForBackwardsAOTOutput(i) for i, s in enumerate(now_saved))]
    if "output_stack_traces" in out.meta:
        result.meta["output_stack_traces"] = [
            v.meta.get("stack_trace") if isinstance(v, fx.Node) else None
            for v in result.args[0]]
    graph.eliminate_dead_code()
    return _module(graphs.forward, graphs.forward, graph)


def _backward(graphs: StormGraphs, rebuilt: list[fx.Node], inputs: dict[fx.Node, fx.Node],
              now_saved: list[fx.Node], constants: list[fx.Node]) -> fx.GraphModule:
    """A copy of the backward taking ``now_saved`` (symbolic sizes first, AOTAutograd's order)
    and running a copy of each node of ``rebuilt`` that a backward read reaches right before
    the first node that needs it, reading the forward's ``constants`` where it did. A node the
    backward already rebuilds (:func:`_twins`: a streamed weight's fetch) is run once, at the
    earlier of the two places."""
    old = graphs.backward.graph
    order = node_order(graphs.backward)
    twins = _twins(rebuilt, old, inputs)
    need: dict[fx.Node, int] = {}
    for node in reversed(rebuilt):
        reads = [need[u] for u in node.users if u in need]
        if node in inputs:
            reads += [order[u] for u in inputs[node].users]
        if node in twins:
            reads += [order[u] for u in twins[node].users]
        if reads:
            need[node] = min(reads)
    before: dict[int, list[fx.Node]] = {}
    for node in rebuilt:
        if node in need:
            before.setdefault(need[node], []).append(node)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    symbolic = [s for s in now_saved if is_symbolic(s)]
    for value in (*symbolic, *(s for s in now_saved if s not in symbolic)):
        if value in inputs:
            env[inputs[value]] = graph.node_copy(inputs[value])
        else:
            env[value] = graph.placeholder(value.name)
            env[value].meta = dict(value.meta)
    taken = set(inputs.values())
    for node in old.find_nodes(op="placeholder"):
        if node not in taken:
            env[node] = graph.node_copy(node)
    for constant in constants:
        env[constant] = graph.node_copy(constant)
    merged = {twins[n] for n in need if n in twins}
    for node in old.nodes:
        if node.op == "placeholder":
            continue
        for copied in before.get(order[node], ()):
            env[copied] = graph.node_copy(copied, lambda a: _read(a, env, inputs))
            for receiver in (inputs.get(copied), twins.get(copied)):
                if receiver is not None:
                    env[receiver] = env[copied]
        if node not in merged:
            env[node] = graph.node_copy(node, env.__getitem__)
    return _module(graphs.backward, _roots(graphs), graph)


def _module(like: fx.GraphModule, root: fx.GraphModule | dict[str, object], graph: fx.Graph
            ) -> fx.GraphModule:
    """``graph`` as a lazy graph module named and annotated as ``like``, its constants taken
    from ``root``: its Python code is generated on first use."""
    module = LazyGraphModule(root, graph, like.__class__.__name__)
    module.meta.update(like.meta)
    return module


def _twins(rebuilt: list[fx.Node], backward: fx.Graph, inputs: dict[fx.Node, fx.Node]
           ) -> dict[fx.Node, fx.Node]:
    """Each node of ``rebuilt`` (forward order) that ``backward`` already computes: a backward
    node of the same name (the partitioner keeps a joint-graph node's name where it runs it
    again) running the same op on the same values (saved values' inputs, the backward's
    constant of the same attribute, or nodes that are twins themselves). A name alone is not
    enough: nodes the partitioner adds to each graph (random-number states) are named in each
    graph apart."""
    named = {n.name: n for n in backward.nodes if n.op != "placeholder"}
    constants = {n.target: n for n in backward.find_nodes(op="get_attr")}
    twins: dict[fx.Node, fx.Node] = {}

    def same(value: fx.Node) -> fx.Node | None:
        if value.op == "get_attr":
            return constants.get(value.target)
        return inputs.get(value, twins.get(value))

    for node in rebuilt:
        twin = named.get(node.name)
        if twin is None or twin.target != node.target:
            continue
        mapped = fx.node.map_arg((node.args, node.kwargs), same)
        if mapped == (twin.args, twin.kwargs):
            twins[node] = twin
    return twins


def _read(arg: fx.Node, env: dict[fx.Node, fx.Node], inputs: dict[fx.Node, fx.Node]
          ) -> fx.Node:
    """What a copied forward node reads in the new backward: the copy of a rebuilt node, a
    new input, or the input that receives a saved value."""
    return env[arg] if arg in env else env[inputs[arg]]


def _roots(graphs: StormGraphs) -> dict[str, object]:
    """The attributes either graph's constants name (a copied node may read the forward's)."""
    return {**_attributes(graphs.forward), **_attributes(graphs.backward)}


def _attributes(module: fx.GraphModule) -> dict[str, object]:
    return {n.target: _attribute(module, n.target)
            for n in module.graph.find_nodes(op="get_attr")}


def _attribute(module: fx.GraphModule, target: str) -> object:
    for part in target.split("."):
        module = getattr(module, part)
    return module
