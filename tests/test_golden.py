"""Golden printed graphs and schedule on a tiny function with the ``cpu-test`` profile.

Offload: ``relu`` (2 KiB) passes min_offload_bytes=1024 and, with ``offload="all"`` and
``recompute=False``, is offloaded even though its copies cannot hide (negative slack); ``tanh``'s
saved view (256 B) stays. The forward waits after ``sum_1``, the last compute node; the backward
prefetches right after its inputs and moves the saved view's replays after the wait.

Recompute: under ``memory_budget=0.5`` relu must leave; rebuilding it (``mm`` and ``relu``,
1 µs each) beats its 10 µs copy, so the partitioner, driven by the recompute tags, saves the
graph inputs instead and reruns both ops in the backward right before their first use.
"""

import pytest
import torch

from storm_compile.backend import StormBackend
from storm_compile.config import StormConfig
from storm_compile.schedule import annotate, format_table

BASE_OPTIONS = dict(inner="eager", transfer_cpu_tensors=True, min_offload_bytes=1024,
                    profile="cpu-test", host_memory_limit="1GiB")
GOLDEN_OPTIONS = dict(BASE_OPTIONS, offload="all", recompute=False)
RECOMPUTE_OPTIONS = dict(BASE_OPTIONS, memory_budget=0.5)

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
    tanh = torch.ops.aten.tanh.default(mm_1);  mm_1 = None
    detach_1 = torch.ops.aten.detach.default(tanh)
    sum_1 = torch.ops.aten.sum.dim_IntList(tanh, [1]);  tanh = None
    wait_event_default = torch.ops.storm.wait_event.default(record_event_default, relu);  record_event_default = relu = None
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
    detach = torch.ops.aten.detach.default(wait_event_default);  wait_event_default = None
    detach_3 = torch.ops.aten.detach.default(detach);  detach = None
    mm_2 = torch.ops.aten.mm.default(t, tanh_backward);  t = None
    mm_3 = torch.ops.aten.mm.default(tanh_backward, t_1);  tanh_backward = t_1 = None
    threshold_backward = torch.ops.aten.threshold_backward.default(mm_3, detach_3, 0);  mm_3 = detach_3 = None
    mm_4 = torch.ops.aten.mm.default(t_2, threshold_backward);  t_2 = threshold_backward = None
    return (None, mm_4, mm_2)
"""

SCHEDULE = """
graph    node                  op                          stream      compute_us    transfer_bytes    transfer_us  event         memory_after  decision
-------  --------------------  --------------------------  --------  ------------  ----------------  -------------  ----------  --------------  --------------------------------------------------------------------------------------------------------
fw       primals_1             placeholder                 -                  0.0                 0            0.0                           0  keep: storage of a graph input (parameter, buffer or user input)
fw       primals_2             placeholder                 -                  0.0                 0            0.0                           0
fw       primals_3             placeholder                 -                  0.0                 0            0.0                           0  keep: storage of a graph input (parameter, buffer or user input)
fw       mm                    mm.default                  compute            1.0                 0            0.0                        2048
fw       relu                  relu.default                compute            1.0                 0            0.0                        2048  offload: link-bound copy, 10 µs added; not recomputed: recompute=False; D2H slack -7 µs, H2D slack -9 µs
fw       offload_default       offload.default             d2h                0.0              2048           10.2                        2048
fw       record_event_default  record_event.default        d2h                0.0                 0            0.0  record ev0            2048
fw       mm_1                  mm.default                  compute            1.0                 0            0.0                        2304
fw       tanh                  tanh.default                compute            1.0                 0            0.0                        2304  keep: smaller than min_offload_bytes (1024)
fw       detach_1              detach.default              -                  0.0                 0            0.0                        2304
fw       sum_1                 sum.dim_IntList             compute            1.0                 0            0.0                        2368
fw       wait_event_default    wait_event.default          compute            7.2                 0            0.0  wait ev0               320
fw       detach_2              detach.default              -                  0.0                 0            0.0                         320  keep: smaller than min_offload_bytes (1024)
fw       t_1                   t.default                   -                  0.0                 0            0.0                         320  keep: storage of a graph input (parameter, buffer or user input)
fw       t_2                   t.default                   -                  0.0                 0            0.0                         320  keep: storage of a graph input (parameter, buffer or user input)
fw       output                output                      -                  0.0                 0            0.0                         320
bw       relu                  placeholder                 -                  0.0                 0            0.0                         384
bw       detach_2              placeholder                 -                  0.0                 0            0.0                         384
bw       t_1                   placeholder                 -                  0.0                 0            0.0                         384
bw       t_2                   placeholder                 -                  0.0                 0            0.0                         384
bw       tangents_1            placeholder                 -                  0.0                 0            0.0                         384
bw       prefetch_default      prefetch.default            h2d                0.0              2048           10.2                        2432
bw       record_event_default  record_event.default        h2d                0.0                 0            0.0  record ev0            2432
bw       unsqueeze             unsqueeze.default           -                  0.0                 0            0.0                        2432
bw       expand                expand.default              -                  0.0                 0            0.0                        2432
bw       tanh_backward         tanh_backward.default       compute            1.0                 0            0.0                        2368
bw       wait_event_default    wait_event.default          compute            9.2                 0            0.0  wait ev0              2368
bw       t                     t.default                   -                  0.0                 0            0.0                        2368
bw       detach                detach.default              -                  0.0                 0            0.0                        2368
bw       detach_3              detach.default              -                  0.0                 0            0.0                        2368
bw       mm_2                  mm.default                  compute            1.0                 0            0.0                        2880
bw       mm_3                  mm.default                  compute            1.0                 0            0.0                        4672
bw       threshold_backward    threshold_backward.default  compute            1.0                 0            0.0                        2624
bw       mm_4                  mm.default                  compute            1.0                 0            0.0                        1600
bw       output                output                      -                  0.0                 0            0.0                        1600

summary                    value
-------------------------  ----------------
profile                    cpu-test
predicted_step_ms          0.026
predicted_forward_ms       0.012
baseline_step_ms           0.010
exposed_transfer_ms        0.016
activation_bytes           320 (0.000 GiB)
baseline_activation_bytes  2368 (0.000 GiB)
budget_bytes               320 (0.000 GiB)
minimum_activation_bytes   320 (0.000 GiB)
peak_bytes                 6720 (0.000 GiB)
baseline_peak_bytes        6720 (0.000 GiB)
offloaded_bytes            2048 (0.000 GiB)
recomputed_bytes           0 (0.000 GiB)
recompute_ms               0.000
offloaded_storages         1
recomputed_storages        0
kept_storages              3
"""


RECOMPUTE_FORWARD = """
def forward(self, args_list):
    args_iter = iter(args_list)
    primals_1 = next(args_iter)
    primals_2 = next(args_iter)
    primals_3 = next(args_iter)
    args_list.clear()
    mm = torch.ops.aten.mm.default(primals_1, primals_2)
    relu = torch.ops.aten.relu.default(mm);  mm = None
    mm_1 = torch.ops.aten.mm.default(relu, primals_3);  relu = None
    tanh = torch.ops.aten.tanh.default(mm_1);  mm_1 = None
    detach_1 = torch.ops.aten.detach.default(tanh)
    sum_1 = torch.ops.aten.sum.dim_IntList(tanh, [1]);  tanh = None
    detach_2 = torch.ops.aten.detach.default(detach_1);  detach_1 = None
    t_1 = torch.ops.aten.t.default(primals_3);  primals_3 = None
    return (sum_1, primals_1, primals_2, detach_2, t_1)
"""

RECOMPUTE_BACKWARD = """
def forward(self, primals_1, primals_2, detach_2, t_1, tangents_1):
    unsqueeze = torch.ops.aten.unsqueeze.default(tangents_1, 1);  tangents_1 = None
    expand = torch.ops.aten.expand.default(unsqueeze, [16, 4]);  unsqueeze = None
    tanh_backward = torch.ops.aten.tanh_backward.default(expand, detach_2);  expand = detach_2 = None
    mm = torch.ops.aten.mm.default(primals_1, primals_2);  primals_2 = None
    relu = torch.ops.aten.relu.default(mm);  mm = None
    t = torch.ops.aten.t.default(relu)
    mm_2 = torch.ops.aten.mm.default(t, tanh_backward);  t = None
    mm_3 = torch.ops.aten.mm.default(tanh_backward, t_1);  tanh_backward = t_1 = None
    detach = torch.ops.aten.detach.default(relu);  relu = None
    detach_3 = torch.ops.aten.detach.default(detach);  detach = None
    threshold_backward = torch.ops.aten.threshold_backward.default(mm_3, detach_3, 0);  mm_3 = detach_3 = None
    t_2 = torch.ops.aten.t.default(primals_1);  primals_1 = None
    mm_4 = torch.ops.aten.mm.default(t_2, threshold_backward);  t_2 = threshold_backward = None
    return (None, mm_4, mm_2)
"""

RECOMPUTE_SCHEDULE = """
graph    node                op                          stream      compute_us    transfer_bytes    transfer_us  event      memory_after  decision
-------  ------------------  --------------------------  --------  ------------  ----------------  -------------  -------  --------------  ----------------------------------------------------------------
fw       primals_1           placeholder                 -                  0.0                 0            0.0                        0  keep: storage of a graph input (parameter, buffer or user input)
fw       primals_2           placeholder                 -                  0.0                 0            0.0                        0  keep: storage of a graph input (parameter, buffer or user input)
fw       primals_3           placeholder                 -                  0.0                 0            0.0                        0  keep: storage of a graph input (parameter, buffer or user input)
fw       mm                  mm.default                  compute            1.0                 0            0.0                     2048
fw       relu                relu.default                compute            1.0                 0            0.0                     2048  recompute: rebuilt in 2 µs, below an offload's 10 µs
fw       mm_1                mm.default                  compute            1.0                 0            0.0                      256
fw       tanh                tanh.default                compute            1.0                 0            0.0                      256  keep: smaller than min_offload_bytes (1024)
fw       detach_1            detach.default              -                  0.0                 0            0.0                      256
fw       sum_1               sum.dim_IntList             compute            1.0                 0            0.0                      320
fw       detach_2            detach.default              -                  0.0                 0            0.0                      320  keep: smaller than min_offload_bytes (1024)
fw       t_1                 t.default                   -                  0.0                 0            0.0                      320  keep: storage of a graph input (parameter, buffer or user input)
fw       output              output                      -                  0.0                 0            0.0                      320
bw       primals_1           placeholder                 -                  0.0                 0            0.0                      384  keep: storage of a graph input (parameter, buffer or user input)
bw       primals_2           placeholder                 -                  0.0                 0            0.0                      384
bw       detach_2            placeholder                 -                  0.0                 0            0.0                      384
bw       t_1                 placeholder                 -                  0.0                 0            0.0                      384
bw       tangents_1          placeholder                 -                  0.0                 0            0.0                      384
bw       unsqueeze           unsqueeze.default           -                  0.0                 0            0.0                      384
bw       expand              expand.default              -                  0.0                 0            0.0                      384
bw       tanh_backward       tanh_backward.default       compute            1.0                 0            0.0                      320
bw       mm                  mm.default                  compute            1.0                 0            0.0                     2368
bw       relu                relu.default                compute            1.0                 0            0.0                     2368
bw       t                   t.default                   -                  0.0                 0            0.0                     2368
bw       mm_2                mm.default                  compute            1.0                 0            0.0                     2880
bw       mm_3                mm.default                  compute            1.0                 0            0.0                     4672
bw       detach              detach.default              -                  0.0                 0            0.0                     4672
bw       detach_3            detach.default              -                  0.0                 0            0.0                     4672
bw       threshold_backward  threshold_backward.default  compute            1.0                 0            0.0                     2624
bw       t_2                 t.default                   -                  0.0                 0            0.0                     2624
bw       mm_4                mm.default                  compute            1.0                 0            0.0                     1600
bw       output              output                      -                  0.0                 0            0.0                     1600

summary                    value
-------------------------  ----------------
profile                    cpu-test
predicted_step_ms          0.012
predicted_forward_ms       0.005
baseline_step_ms           0.010
exposed_transfer_ms        0.000
activation_bytes           320 (0.000 GiB)
baseline_activation_bytes  2368 (0.000 GiB)
budget_bytes               1184 (0.000 GiB)
minimum_activation_bytes   320 (0.000 GiB)
peak_bytes                 6720 (0.000 GiB)
baseline_peak_bytes        6720 (0.000 GiB)
offloaded_bytes            0 (0.000 GiB)
recomputed_bytes           2048 (0.000 GiB)
recompute_ms               0.002
offloaded_storages         0
recomputed_storages        1
kept_storages              4
"""

def tiny(x, w1, w2):
    h = torch.relu(x @ w1)
    return torch.tanh(h @ w2).sum(dim=1)


def capture_tiny(options: dict):
    captured = []
    backend = StormBackend(StormConfig.from_options(**options), observer=captured.append)
    x = torch.randn(16, 8)
    w1 = torch.randn(8, 32, requires_grad=True)
    w2 = torch.randn(32, 4, requires_grad=True)
    torch.compile(tiny, backend=backend)(x, w1, w2).sum().backward()
    (graphs,) = captured
    annotated = annotate(graphs, backend.ctx.cost)
    annotated.pop("prediction")
    return graphs, format_table(annotated)


@pytest.mark.parametrize("options, forward, backward, schedule", [
    (GOLDEN_OPTIONS, FORWARD, BACKWARD, SCHEDULE),
    (RECOMPUTE_OPTIONS, RECOMPUTE_FORWARD, RECOMPUTE_BACKWARD, RECOMPUTE_SCHEDULE),
], ids=["offload", "recompute"])
def test_golden_graphs_and_schedule(options, forward, backward, schedule):
    graphs, table = capture_tiny(options)
    assert graphs.forward.code.strip() == forward.strip()
    assert graphs.backward.code.strip() == backward.strip()
    assert table.strip() == schedule.strip()
