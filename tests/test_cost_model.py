"""Cost model and simulator arithmetic with the round-number ``cpu-test`` profile."""

import dataclasses
import json

import pytest
import torch

from storm_compile.cost.cost_model import (
    ATTENTION_EFFICIENCY,
    MEASURED_MIN_S,
    CostModel,
    MeasuredCosts,
    channels_last_graph,
    materialized,
    node_flops,
    realized_values,
)
from storm_compile.cost.profiles import PROFILES, DeviceProfile
from storm_compile.cost.simulate import _Link
from storm_compile.fx.vocabulary import Lane
from storm_compile.runtime import ops

TEST = PROFILES["cpu-test"]


def _node(fn, *shapes, dtype=torch.float32):
    """The first call node of ``fn`` traced with fake inputs of ``shapes``."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    with FakeTensorMode():
        inputs = [torch.empty(s, dtype=dtype) for s in shapes]
        gm = make_fx(fn)(*inputs)
    return next(n for n in gm.graph.nodes if n.op == "call_function")


def test_matmul_flops_and_compute_bound_time():
    node = _node(torch.mm, (256, 512), (512, 1024))
    assert node_flops(node) == 2 * 256 * 512 * 1024
    assert CostModel(TEST).compute_seconds(node) == pytest.approx(2 * 256 * 512 * 1024 / 1e12)


def test_a_node_is_priced_anew_when_an_input_changes_its_value():
    """The description kept on a node serves while its values are the same objects: a node
    whose input now holds another value is described, and priced, again."""
    node = _node(torch.mm, (256, 512), (512, 1024))
    cost = CostModel(TEST)
    first = cost.compute_seconds(node)
    left = node.args[0]
    wider = left.meta["val"].new_empty((512, 512))
    left.meta["val"] = wider
    node.meta["val"] = node.meta["val"].new_empty((512, 1024))
    assert CostModel(TEST).compute_seconds(node) == pytest.approx(2 * first)
    assert cost.compute_seconds(node) == pytest.approx(2 * first)


def test_half_precision_uses_the_matmul_rate():
    node = _node(torch.mm, (256, 512), (512, 1024), dtype=torch.bfloat16)
    fast = dataclasses.replace(TEST, matmul_flops=4e12)
    assert CostModel(fast).compute_seconds(node) == pytest.approx(2 * 256 * 512 * 1024 / 4e12)


def test_pointwise_is_memory_bound():
    node = _node(torch.add, (1024, 1024), (1024, 1024))
    moved = 3 * 1024 * 1024 * 4
    assert CostModel(TEST).compute_seconds(node) == pytest.approx(moved / 1e11)


def test_tiny_op_pays_the_launch_floor():
    node = _node(torch.neg, (4,))
    assert CostModel(TEST).compute_seconds(node) == TEST.launch_s


def test_causal_attention_does_half_the_work():
    def attend(q, k, v, causal):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    shape = (1, 2, 128, 64)
    full = _node(lambda q, k, v: attend(q, k, v, False), shape, shape, shape)
    causal = _node(lambda q, k, v: attend(q, k, v, True), shape, shape, shape)
    assert node_flops(full) == 4 * 2 * 128 * 128 * 64
    assert node_flops(causal) == node_flops(full) // 2
    expected = node_flops(full) / (TEST.fp32_flops * ATTENTION_EFFICIENCY)
    assert CostModel(TEST).compute_seconds(full) == pytest.approx(expected)


def test_grouped_query_attention_costs_what_its_query_heads_do():
    """Key and value with fewer heads than the query (grouped-query attention, as in Llama 3)
    are priced as if repeated to the query's heads, on every torch (2.11's formula rejects
    unequal heads)."""
    def attend(q, k, v):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)[0]

    query, grouped = (1, 4, 128, 64), (1, 2, 128, 64)
    assert node_flops(_node(attend, query, grouped, grouped)) == \
        node_flops(_node(attend, query, query, query)) == 4 * 4 * 128 * 128 * 64


def test_override_and_cache():
    node = _node(torch.mm, (8, 8), (8, 8))
    assert CostModel(TEST, override=lambda n: 0.5).compute_seconds(node) == 0.5
    model = CostModel(TEST)
    assert model.compute_seconds(node) == model.compute_seconds(node)
    assert len(model._cache) == 1


def test_measured_costs_time_only_ops_the_roofline_prices_above_the_floor():
    """Timed alone, a small op's time is its dispatch's, which a compiled graph does not pay:
    with a roofline, measured costs keep its price for ops under ``MEASURED_MIN_S``."""
    roofline = CostModel(TEST)
    small, large = _node(torch.mm, (8, 8), (8, 8)), _node(torch.mm, (320, 320), (320, 320))
    assert roofline.compute_seconds(small) < MEASURED_MIN_S <= roofline.compute_seconds(large)
    measured = MeasuredCosts("cpu", roofline=roofline)
    assert measured(small) is None
    assert measured(large) > 0
    assert MeasuredCosts("cpu")(small) > 0


def test_the_backend_times_under_measured_costs_only_what_the_roofline_prices_above_the_floor(
        monkeypatch):
    """``cost="measured"`` as the backend builds it keeps the roofline's price for small ops
    (with CUDA reported present: the backend refuses the option without it)."""
    from storm_compile.compiler.backend import StormBackend
    from storm_compile.config import StormConfig

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    backend = StormBackend(StormConfig.from_options(cost="measured", profile="cpu-test"))
    measured = backend.ctx.cost.override
    assert isinstance(measured, MeasuredCosts)
    assert measured.roofline.profile == PROFILES["cpu-test"]
    small = _node(torch.mm, (8, 8), (8, 8))
    assert measured(small) is None
    assert backend.ctx.cost.compute_seconds(small) == CostModel(TEST).compute_seconds(small)


def test_transfer_time_and_shared_link():
    model = CostModel(TEST)
    assert model.transfer_seconds(10**10, Lane.H2D) == pytest.approx(1e-5 + 1.0)
    assert model.bandwidth(Lane.D2H, shared=True) == pytest.approx(0.75e10)


def test_link_slows_copies_that_overlap_in_both_directions():
    alone = _Link(CostModel(TEST))
    alone.enqueue("a", Lane.D2H, 10**10, 0.0)
    assert alone.finish_time("a") == pytest.approx(1e-5 + 1.0)
    both = _Link(CostModel(TEST))
    both.enqueue("a", Lane.D2H, 10**10, 0.0)
    both.enqueue("b", Lane.H2D, 10**10, 0.0)
    assert both.finish_time("a") == pytest.approx(1e-5 + 10**10 / 0.75e10)
    assert both.finish_time("b") == pytest.approx(1e-5 + 10**10 / 0.75e10)


def test_copies_on_one_lane_queue():
    link = _Link(CostModel(TEST))
    link.enqueue("a", Lane.H2D, 10**10, 0.0)
    link.enqueue("b", Lane.H2D, 10**10, 0.0)
    assert link.finish_time("b") == pytest.approx(2 * (1e-5 + 1.0))


def test_profile_json_round_trip(tmp_path):
    path = tmp_path / "p.json"
    PROFILES["h100"].to_json(path)
    assert DeviceProfile.from_json(path) == PROFILES["h100"]
    data = json.loads(path.read_text())
    data["duplex_bandwidth"] = 0
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="'duplex_bandwidth' must be > 0"):
        DeviceProfile.from_json(path)


def test_streamed_weight_copies_cost_their_link_time():
    graph = torch.fx.Graph()
    weight = graph.placeholder("w")
    weight.meta["val"] = torch.empty(1024, 1024)
    fetch = graph.call_function(ops.fetch_weight, (weight, torch.device("cpu")))
    fetch.meta["val"] = torch.empty(1024, 1024)
    home = graph.call_function(ops.grad_to_host, (fetch, weight))
    home.meta["val"] = None
    model = CostModel(TEST)
    assert model.compute_seconds(fetch) == pytest.approx(model.transfer_seconds(4 << 20, Lane.H2D))
    assert model.compute_seconds(home) == pytest.approx(
        model.transfer_seconds(4 << 20, Lane.D2H) + (4 << 20) / TEST.host_add_bandwidth)


def test_profile_without_the_host_rates_asks_for_a_new_calibration(tmp_path):
    path = tmp_path / "old.json"
    data = json.loads(PROFILES["h100"].to_text())
    del data["host_adamw_bandwidth"]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="'host_adamw_bandwidth'.*run `storm calibrate` again"):
        DeviceProfile.from_json(path)


def test_the_matmul_rate_is_timed_over_a_burst_of_products_as_long_as_a_step_runs_them():
    from storm_compile.cost.calibrate import MATMUL_BURST_S, sustained_flops

    single_s = MATMUL_BURST_S / 39.5
    timed = []

    def timer(work, repeats=1):
        work()
        timed.append(repeats)
        return single_s if len(timed) == 1 else 0.5

    flops = sustained_flops(8, torch.float32, device="cpu", timer=timer)
    assert timed == [1, 3]
    assert flops == pytest.approx(2 * 8**3 * 40 / 0.5)


def _materialized(fn, *shapes) -> dict[str, bool]:
    """Whether each call of ``fn``, traced with fake inputs of ``shapes``, writes memory."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    with FakeTensorMode():
        gm = make_fx(fn)(*(torch.empty(s) for s in shapes))
    return {str(n.target): materialized(n) for n in gm.graph.nodes if n.op == "call_function"}


def test_cross_entropy_fuses_like_the_pointwise_ops_inductor_decomposes_it_into():
    fused = _materialized(lambda x, t: torch.nn.functional.cross_entropy(x, t.long()),
                          (8, 32), (8,))
    assert fused["aten._log_softmax.default"] is False
    assert fused["aten.nll_loss_forward.default"] is True


def test_a_fused_value_read_through_a_view_stays_fused_unless_the_view_escapes():
    inside = _materialized(lambda x: torch.log_softmax(x, -1).view(-1).exp().sum(), (8, 32))
    assert inside["aten._log_softmax.default"] is False
    escaping = _materialized(lambda x: torch.log_softmax(x, -1).view(-1), (8, 32))
    assert escaping["aten._log_softmax.default"] is True


def test_an_nf4_weight_is_rebuilt_in_one_kernel_that_writes_only_the_weight():
    """Inductor lowers the code book's gather to an indirect load: the int64 codes and the
    float32 code-book values are never written, the bf16 weight is (the matmul reads it)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from storm_compile.weights.quantize import Packed, dequantize

    packed = Packed("nf4", (64, 128), torch.bfloat16)
    with FakeTensorMode():
        data = torch.empty(packed.nbytes, dtype=torch.uint8)
        x = torch.empty(8, 128, dtype=torch.bfloat16)
        gm = make_fx(lambda d, x: x @ dequantize(d, packed).t())(data, x)
    written = {n.meta["val"].dtype for n in gm.graph.nodes
               if n.op == "call_function" and materialized(n)
               and isinstance(n.meta.get("val"), torch.Tensor)
               and n.meta["val"].dim() > 0 and n.meta["val"].numel() >= 64 * 128}
    assert torch.int64 not in written and torch.float32 not in written
    assert torch.bfloat16 in written


def test_a_cross_entropy_gathers_its_log_probabilities_without_writing_them():
    """A loss's log-softmax read only by the gather of the targets' log-probabilities is
    computed at the gathered indices: Inductor writes neither the float32 logits nor the
    float32 log-probabilities of the whole vocabulary, only the logits' maximum and log-sum."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    def loss(logits, targets):
        shifted = logits.float() - logits.float().amax(-1, keepdim=True)
        log_probs = shifted - shifted.exp().sum(-1, keepdim=True).log()
        return -log_probs.gather(-1, targets.unsqueeze(-1)).mean()

    with FakeTensorMode():
        gm = make_fx(loss)(torch.empty(8, 512, dtype=torch.bfloat16),
                           torch.empty(8, dtype=torch.int64))
    written = [n for n in realized_values(gm.graph)
               if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].numel() >= 512 * 8]
    assert written == []


def _traced(fn, *shapes, dtype=torch.float32):
    """``fn`` traced with fake inputs of ``shapes``."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    with FakeTensorMode():
        return make_fx(fn)(*(torch.empty(s, dtype=dtype) for s in shapes))


def _silu_input(gm) -> torch.fx.Node:
    return next(n for n in gm.graph.nodes if n.target is torch.ops.aten.sigmoid.default).args[0]


def test_a_fused_value_read_twice_is_written_once_its_expression_reads_over_four_buffers():
    """Inductor writes a normalized value a SiLU reads twice (its sigmoid and its product)
    when the normalization reads five buffers, and keeps it in registers when it reads four."""
    def silu(y):
        return y * torch.sigmoid(y)

    five = _traced(lambda x, mean, rstd, w, b: silu((x - mean) * rstd * w + b), *[(8, 32)] * 5)
    four = _traced(lambda x, mean, rstd, w: silu((x - mean) * rstd * w), *[(8, 32)] * 4)
    assert _silu_input(five) in realized_values(five.graph)
    assert _silu_input(four) not in realized_values(four.graph)
    assert not materialized(_silu_input(five))


def test_constants_inlined_into_a_fused_value_are_not_buffers_it_reads():
    """A cross-entropy's backward: labels compared with an ``iota`` over the vocabulary select
    between two ``scalar_tensor`` values, times the loss's gradient, read by a sum and by the
    logits' gradient. Inductor inlines the constants, so the product reads two buffers and is
    never written, though five nodes feed it."""
    def one_hot_gradient(labels, grad, probabilities):
        vocabulary = torch.ops.prims.iota(32, start=0, step=1, dtype=torch.int64,
                                          device="cpu", requires_grad=False)
        selected = torch.where(labels.long().unsqueeze(1) == vocabulary,
                               torch.scalar_tensor(-1.0), torch.scalar_tensor(0.0))
        product = selected * grad
        return product.sum(1, keepdim=True), probabilities - product

    gm = _traced(one_hot_gradient, (8,), (8, 1), (8, 32))
    product = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mul.Tensor)
    constants = [n for n in gm.graph.nodes if n.target in (
        torch.ops.prims.iota.default, torch.ops.aten.scalar_tensor.default)]
    assert len(constants) == 3
    assert product not in realized_values(gm.graph)
    assert not any(materialized(n) for n in constants)


def _convolution_backward(channels_last: bool, dtype: torch.dtype) -> tuple[int, int]:
    """Workspace bytes storm prices for a convolution's backward, and its input's and output
    gradient's bytes."""
    def backward(grad, x, w):
        return torch.ops.aten.convolution_backward(grad, x, w, [0], [1, 1], [1, 1], [1, 1],
                                                   False, [0, 0], 1, [True, True, False])

    gm = _traced(backward, (2, 8, 16, 16), (2, 16, 16, 16), (8, 16, 3, 3), dtype=dtype)
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    grad, x = (node.args[i].meta["val"] for i in (0, 1))
    size = dtype.itemsize
    return (CostModel(TEST).workspace_bytes(node, channels_last),
            (x.numel() + grad.numel()) * size)


def test_a_half_precision_convolution_backward_holds_its_input_and_gradient_bytes_while_it_runs():
    workspace, operands = _convolution_backward(channels_last=False, dtype=torch.bfloat16)
    assert workspace == operands
    assert _convolution_backward(channels_last=True, dtype=torch.bfloat16)[0] == 0
    assert _convolution_backward(channels_last=False, dtype=torch.float32)[0] == 0


def test_an_attention_backward_holds_a_float32_query_gradient_while_it_runs():
    def attend(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v).sum()

    shape = (1, 2, 128, 64)
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    with FakeTensorMode():
        inputs = [torch.empty(shape, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
        gm = make_fx(lambda q, k, v: torch.autograd.grad(attend(q, k, v), q)[0])(*inputs)
    node = next(n for n in gm.graph.nodes if "attention" in str(n.target)
                and "backward" in str(n.target))
    assert CostModel(TEST).workspace_bytes(node, False) == 2 * 2 * 128 * 64 * 2


def _conv_net(channels: tuple[int, ...]):
    def net(x, *weights):
        for w in weights:
            x = torch.nn.functional.conv2d(x, w, padding=1)
        return x

    shapes = [(2, channels[0], 8, 8)] + [(cout, cin, 3, 3)
                                         for cin, cout in zip(channels, channels[1:])]
    return _traced(net, *shapes)


def test_inductor_lays_out_channels_last_unless_a_convolution_narrows_or_all_are_small():
    assert channels_last_graph(_conv_net((3, 128, 128)).graph)
    assert not channels_last_graph(_conv_net((3, 192, 64)).graph)
    assert not channels_last_graph(_conv_net((3, 32, 32)).graph)
    assert not channels_last_graph(_traced(torch.mm, (4, 4), (4, 4)).graph)


def test_a_value_read_by_a_fused_cast_stays_live_until_the_kernel_that_reads_the_cast():
    """Inductor computes a fused cast inside the kernel of the value it flows into: the
    matmul's output the cast reads stays live until that kernel (the sum after the second
    matmul), not until the cast's own place in the graph."""
    from storm_compile.cost.simulate import _Memory

    def f(x, w):
        y = x @ w
        z = y.float()
        other = x @ w.t()
        return (z * 2).sum() + other.sum()

    gm = _traced(f, (64, 64), (64, 64), dtype=torch.bfloat16)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    mms = [n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default]
    cast = next(iter(mms[0].users))
    reader = next(iter(next(iter(cast.users)).users))
    assert order[mms[1]] < order[reader]
    assert _Memory(gm.graph, set()).last_use[mms[0]] == order[reader]


def test_a_conv_nets_batch_and_weights_are_copied_channels_last_and_a_1d_nets_are_not():
    from storm_compile.cost.simulate import _laid_out_inputs

    two_d = _conv_net((3, 128, 128))
    assert [n.name for n in _laid_out_inputs(two_d.graph)] == [
        n.name for n in two_d.graph.find_nodes(op="placeholder")]

    def one_d(x, w1, w2):
        return torch.nn.functional.conv1d(torch.nn.functional.conv1d(x, w1), w2)

    traced = _traced(one_d, (2, 3, 16), (128, 3, 3), (128, 128, 3))
    assert _laid_out_inputs(traced.graph) == []
