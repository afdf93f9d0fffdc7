"""Golden printed graphs on a tiny function: the exact pattern the passes emit.

``relu`` (2 KiB) passes min_offload_bytes=1024 and is offloaded; ``tanh``'s saved view (256 B)
stays. With both distances at 1, the forward wait lands one compute node (``mm_1``) after the
offload and the prefetch one compute node (``tanh_backward``) before the first use.
"""

import torch

from storm_compile.backend import StormBackend
from storm_compile.config import StormConfig

GOLDEN_OPTIONS = dict(inner="eager", transfer_cpu_tensors=True, min_offload_bytes=1024,
                      prefetch_distance=1, offload_wait_distance=1, host_memory_limit="1GiB")

FORWARD = """
def forward(self, args_list):
    args_iter = iter(args_list)
    primals_1 = next(args_iter)
    primals_2 = next(args_iter)
    primals_3 = next(args_iter)
    args_list.clear()
    mm = torch.ops.aten.mm.default(primals_1, primals_2);  primals_2 = None
    relu = torch.ops.aten.relu.default(mm);  mm = None
    offload_default = torch.ops.storm.offload.default(relu, 1073741824)
    record_event_default = torch.ops.storm.record_event.default(offload_default);  offload_default = None
    mm_1 = torch.ops.aten.mm.default(relu, primals_3)
    wait_event_default = torch.ops.storm.wait_event.default(record_event_default, relu);  record_event_default = relu = None
    tanh = torch.ops.aten.tanh.default(mm_1);  mm_1 = None
    detach_1 = torch.ops.aten.detach.default(tanh)
    sum_1 = torch.ops.aten.sum.dim_IntList(tanh, [1]);  tanh = None
    detach_2 = torch.ops.aten.detach.default(detach_1);  detach_1 = None
    t_1 = torch.ops.aten.t.default(primals_3);  primals_3 = None
    t_2 = torch.ops.aten.t.default(primals_1);  primals_1 = None
    return (sum_1, wait_event_default, detach_2, t_1, t_2)
"""

BACKWARD = """
def forward(self, relu, detach_2, t_1, t_2, tangents_1):
    prefetch_default = torch.ops.storm.prefetch.default(relu, device(type='cpu'))
    record_event_default = torch.ops.storm.record_event.default(prefetch_default);  prefetch_default = None
    unsqueeze = torch.ops.aten.unsqueeze.default(tangents_1, 1);  tangents_1 = None
    expand = torch.ops.aten.expand.default(unsqueeze, [16, 4]);  unsqueeze = None
    tanh_backward = torch.ops.aten.tanh_backward.default(expand, detach_2);  expand = detach_2 = None
    wait_event_default = torch.ops.storm.wait_event.default(record_event_default, relu);  record_event_default = relu = None
    t = torch.ops.aten.t.default(wait_event_default)
    mm_2 = torch.ops.aten.mm.default(t, tanh_backward);  t = None
    mm_3 = torch.ops.aten.mm.default(tanh_backward, t_1);  tanh_backward = t_1 = None
    detach = torch.ops.aten.detach.default(wait_event_default);  wait_event_default = None
    detach_3 = torch.ops.aten.detach.default(detach);  detach = None
    threshold_backward = torch.ops.aten.threshold_backward.default(mm_3, detach_3, 0);  mm_3 = detach_3 = None
    mm_4 = torch.ops.aten.mm.default(t_2, threshold_backward);  t_2 = threshold_backward = None
    return (None, mm_4, mm_2)
"""


def tiny(x, w1, w2):
    h = torch.relu(x @ w1)
    return torch.tanh(h @ w2).sum(dim=1)


def test_golden_graphs():
    captured = []
    backend = StormBackend(StormConfig.from_options(**GOLDEN_OPTIONS), observer=captured.append)
    x = torch.randn(16, 8)
    w1 = torch.randn(8, 32, requires_grad=True)
    w2 = torch.randn(32, 4, requires_grad=True)
    torch.compile(tiny, backend=backend)(x, w1, w2).sum().backward()
    (graphs,) = captured
    assert graphs.forward.code.strip() == FORWARD.strip()
    assert graphs.backward.code.strip() == BACKWARD.strip()
