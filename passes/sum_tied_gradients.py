"""Send the gradient of a weight read more than once home once, summed on the device.

Assumes: ``joint`` is AOTAutograd's joint forward-backward graph, not yet partitioned; each use
of a streamed weight in the forward left one ``storm.grad_to_host(grad, host_weight)`` in the
backward (a tied embedding and output projection leave two).
Guarantees: each host weight has at most one ``storm.grad_to_host``, whose gradient is the sum
of all the ones it replaced (the host parameter's ``.grad`` receives what it did before); a
weight with one is left as it was, so running it again changes nothing.
Emits, where the last of a weight's ``grad_to_host(a, w)``, ``grad_to_host(b, w)``, ... was::

    add = aten.add.Tensor(a, b)            # one add per further gradient
    grad_to_host = storm.grad_to_host(add, w)
"""

from __future__ import annotations

import torch
from torch import fx

from storm_compile.runtime import ops


def sum_tied_gradients(joint: fx.GraphModule) -> fx.GraphModule:
    graph = joint.graph
    by_weight: dict[fx.Node, list[fx.Node]] = {}
    for node in graph.find_nodes(op="call_function", target=ops.grad_to_host):
        by_weight.setdefault(node.args[1], []).append(node)
    tied = [(weight, homes) for weight, homes in by_weight.items() if len(homes) > 1]
    for weight, homes in tied:
        with graph.inserting_before(homes[-1]):
            total = homes[0].args[0]
            for home in homes[1:]:
                grad = home.args[0]
                total_val = total.meta["val"] + grad.meta["val"]
                total = graph.call_function(torch.ops.aten.add.Tensor, (total, grad))
                total.meta["val"] = total_val
            graph.call_function(ops.grad_to_host, (total, weight))
        for home in homes:
            graph.erase_node(home)
    if tied:
        joint.recompile()
    return joint
