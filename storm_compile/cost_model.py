"""How long a node computes and a tensor takes to cross the link, from a device profile.

Compute time is a roofline: the larger of FLOPs over the dtype's peak rate, bytes moved over
memory bandwidth, and a launch floor. Bytes moved follow Inductor's fusion: a chain of pointwise
ops and reductions reads its inputs once and writes only what leaves the chain, and pays one
launch. FLOPs come from
``torch.utils.flop_counter``'s formulas. Transfer time is a fixed latency plus bytes over the
direction's bandwidth; when both directions run at once they share ``duplex_bandwidth``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch import fx
from torch.utils._pytree import tree_leaves
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils.flop_counter import flop_registry

from storm_compile.graphs import is_view

aten = torch.ops.aten
log = logging.getLogger("storm_compile")

FLOP_ALIASES = {
    aten._scaled_dot_product_flash_attention_for_cpu: aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_flash_attention_for_cpu_backward:
        aten._scaled_dot_product_flash_attention_backward,
}
"""Ops priced with another op's FLOP formula: the CPU flash-attention kernels do the same work
as the CUDA ones, so a schedule traced on a CPU is priced as it would run on the GPU."""

CAUSAL_WORK_FRACTION = 0.5
"""Share of the full attention FLOPs a causal flash-attention kernel does: it skips the blocks
above the diagonal."""

ATTENTION_OPS = frozenset({
    aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_flash_attention_backward,
    aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_efficient_attention_backward,
    aten._scaled_dot_product_cudnn_attention, aten._scaled_dot_product_cudnn_attention_backward,
})
ATTENTION_EFFICIENCY = 0.6
"""Fraction of the dense-matmul rate fused attention kernels reach. Measured on the gpt stack
(d2048, T2048, bf16, H200 trace): 4.2 ms of flash-attention kernels where the matmul rate
predicts 2.6 ms, i.e. 0.61."""

HALF_PRECISION = (torch.bfloat16, torch.float16)

FUSIBLE_REDUCTIONS = frozenset({
    aten.sum.default, aten.sum.dim_IntList, aten.mean.dim, aten.mean.default, aten.amax.default,
    aten.amin.default, aten.var_mean.correction, aten.prod.dim_int,
})
"""Reductions Inductor fuses with the pointwise ops around them."""
FUSIBLE_CASTS = frozenset({aten._to_copy.default})


def is_fusible(node: fx.Node) -> bool:
    """Whether Inductor folds ``node`` into a neighbouring kernel: pointwise ops, dtype casts
    and simple reductions. Chains of them run as one kernel that reads the chain's inputs once
    and writes only what leaves the chain."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    return (torch.Tag.pointwise in target.tags or target in FUSIBLE_REDUCTIONS
            or target in FUSIBLE_CASTS)


def _producer(arg: fx.Node) -> fx.Node:
    while is_view(arg) and isinstance(arg.args[0], fx.Node):
        arg = arg.args[0]
    return arg


def materialized(node: fx.Node) -> bool:
    """Whether ``node``'s output is written to device memory (False inside a fused chain)."""
    return not is_fusible(node) or any(
        user.op == "output" or not is_fusible(user) for user in node.users)


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """Rates of one GPU and its host link. Bandwidths in bytes/s, times in seconds."""

    name: str
    matmul_flops: float
    """bf16/fp16 dense matrix FLOP/s reached by large matmuls."""
    fp32_flops: float
    """fp32 FLOP/s (TF32 off, PyTorch's default)."""
    memory_bandwidth: float
    """Device memory bytes/s, counting bytes read plus bytes written."""
    launch_s: float
    """Smallest time a kernel takes, launch included."""
    h2d_bandwidth: float
    d2h_bandwidth: float
    duplex_bandwidth: float
    """Total bytes/s over both directions when copies run both ways at once."""
    copy_latency_s: float
    """Fixed cost of one copy, paid before its bytes move."""
    transfer_host_s: float
    """Host time of storm's six ops moving one storage out and back (offload, record, wait;
    prefetch, record, wait): step time whenever the step is host-bound."""

    @classmethod
    def from_json(cls, path: str | Path) -> "DeviceProfile":
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"device profile {str(path)!r}: cannot read: {error}") from error
        if not isinstance(data, dict):
            raise ValueError(f"device profile {str(path)!r}: expected a JSON object")
        values = {}
        for field in dataclasses.fields(cls):
            if field.name not in data:
                raise ValueError(f"device profile {str(path)!r}: missing field {field.name!r}")
            value = data[field.name]
            if field.name == "name":
                values["name"] = str(value)
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"device profile {str(path)!r}: field {field.name!r} must be a "
                                 f"non-negative number, got {value!r}")
            values[field.name] = float(value)
        for name in ("matmul_flops", "fp32_flops", "memory_bandwidth", "h2d_bandwidth",
                     "d2h_bandwidth", "duplex_bandwidth"):
            if values[name] == 0:
                raise ValueError(f"device profile {str(path)!r}: field {name!r} must be > 0")
        return cls(**values)

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(dataclasses.asdict(self), indent=1))


TRANSFER_HOST_S = 178e-6
"""Host time per storage moved (six op calls from Python), as ``storm calibrate`` measured it on
the H100 machine (136 µs on the lent H200's host); every built-in profile uses it, since it is
the host CPU's figure, not the GPU's: calibrate yours."""

PROFILES: dict[str, DeviceProfile] = {
    # Measured on our H100 80GB HBM3 (torch 2.11, cu130): pinned copies 55.2 GB/s each way,
    # 89 GB/s both ways at once, bf16 matmul 767 TFLOP/s; `storm calibrate` there gave fp32
    # 51 TFLOP/s, 2.97 TB/s device copies (read+write), 7.6 µs per small kernel and 15.8 µs
    # of fixed latency per host copy.
    "h100": DeviceProfile("h100", matmul_flops=767e12, fp32_flops=51e12,
                          memory_bandwidth=2.97e12, launch_s=7.6e-6, h2d_bandwidth=55.2e9,
                          d2h_bandwidth=55.2e9, duplex_bandwidth=89e9, copy_latency_s=15.8e-6,
                          transfer_host_s=TRANSFER_HOST_S),
    # H200: bf16 and memory rates as seen on this workplace's H200 (790 TFLOP/s, 4.3 TB/s
    # read+write); the host link is the same PCIe Gen5 as the H100's.
    "h200": DeviceProfile("h200", matmul_flops=790e12, fp32_flops=55e12,
                          memory_bandwidth=4.3e12, launch_s=4e-6, h2d_bandwidth=55.2e9,
                          d2h_bandwidth=55.2e9, duplex_bandwidth=89e9, copy_latency_s=20e-6,
                          transfer_host_s=TRANSFER_HOST_S),
    # Datasheet-derived, at about 80 % of peak: A100 PCIe 312 TFLOP/s bf16, 1.9 TB/s, Gen4 x16.
    "a100-pcie": DeviceProfile("a100-pcie", matmul_flops=250e12, fp32_flops=19.5e12,
                               memory_bandwidth=1.5e12, launch_s=5e-6, h2d_bandwidth=25e9,
                               d2h_bandwidth=25e9, duplex_bandwidth=40e9, copy_latency_s=10e-6,
                               transfer_host_s=TRANSFER_HOST_S),
    # Datasheet-derived, at about 80 % of peak: RTX 4090 165 TFLOP/s bf16 (fp32 accumulate),
    # 1.0 TB/s, Gen4 x16.
    "rtx4090": DeviceProfile("rtx4090", matmul_flops=130e12, fp32_flops=66e12,
                             memory_bandwidth=0.8e12, launch_s=5e-6, h2d_bandwidth=25e9,
                             d2h_bandwidth=25e9, duplex_bandwidth=40e9, copy_latency_s=10e-6,
                             transfer_host_s=TRANSFER_HOST_S),
    # Round numbers for tests: schedules printed with it are exact and never change.
    "cpu-test": DeviceProfile("cpu-test", matmul_flops=1e12, fp32_flops=1e12,
                              memory_bandwidth=1e11, launch_s=1e-6, h2d_bandwidth=1e10,
                              d2h_bandwidth=1e10, duplex_bandwidth=1.5e10, copy_latency_s=1e-5,
                              transfer_host_s=0.0),
}


def resolve_profile(spec: str | DeviceProfile) -> DeviceProfile:
    """A built-in profile by name, or one read from a JSON file path."""
    if isinstance(spec, DeviceProfile):
        return spec
    if spec in PROFILES:
        return PROFILES[spec]
    if spec.endswith(".json") or Path(spec).is_file():
        return DeviceProfile.from_json(spec)
    raise ValueError(f"unknown device profile {spec!r}; built-in profiles: "
                     f"{', '.join(PROFILES)}, or a path to a profile JSON")


def _value(arg):
    return arg.meta.get("val") if isinstance(arg, fx.Node) else arg


def _tensor_bytes(values) -> int:
    return sum(v.numel() * v.element_size() for v in tree_leaves(values)
               if isinstance(v, torch.Tensor))


def _is_causal(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    for index, argument in enumerate(schema.arguments if schema else ()):
        if argument.name == "is_causal":
            value = node.kwargs.get("is_causal", node.args[index] if index < len(node.args)
                                    else argument.default_value)
            return bool(value)
    return False


def node_flops(node: fx.Node) -> int:
    """FLOPs of ``node`` by torch's flop-counter formulas (0 for ops without one)."""
    packet = getattr(node.target, "overloadpacket", None)
    packet = FLOP_ALIASES.get(packet, packet)
    formula = flop_registry.get(packet)
    if formula is None:
        return 0
    args = [_value(a) for a in node.args]
    kwargs = {k: _value(v) for k, v in node.kwargs.items()}
    flops = formula(*args, **kwargs, out_val=node.meta.get("val"))
    return int(flops * CAUSAL_WORK_FRACTION) if _is_causal(node) else int(flops)


MEASURE_REPEATS = 5
"""Timed runs per distinct node in measured mode (after one warm-up); the median is kept."""


class MeasuredCosts:
    """A ``CostModel`` override that times each distinct non-fusible op once on the GPU.

    It runs inside AOTAutograd's partitioner, where a fake-tensor mode is active; the timing
    steps out of it so the op really runs.

    Inputs are random tensors of the node's shapes, strides and dtypes (integer tensors are
    zeros, so index arguments stay in range). Fusible ops return None: alone they would be
    timed unfused, so the fusion-aware roofline prices them. An op that cannot be run from its
    fake arguments is logged and priced by the roofline.
    """

    def __init__(self, device: torch.device | str = "cuda") -> None:
        self.device = torch.device(device)
        self._cache: dict[tuple, float | None] = {}

    def _real(self, value):
        if not isinstance(value, torch.Tensor):
            return value
        out = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype,
                                  device=self.device)
        return out.normal_() if out.is_floating_point() else out.zero_()

    def __call__(self, node: fx.Node) -> float | None:
        if is_fusible(node) or not isinstance(node.target, torch._ops.OpOverload):
            return None
        key = CostModel.describe(node)
        if key not in self._cache:
            self._cache[key] = self._time(node)
        return self._cache[key]

    def _time(self, node: fx.Node) -> float | None:
        with unset_fake_temporarily():
            return self._run(node)

    def _run(self, node: fx.Node) -> float | None:
        args = [self._real(_value(a)) for a in node.args]
        kwargs = {k: self._real(_value(v)) for k, v in node.kwargs.items()}
        try:
            node.target(*args, **kwargs)
            times = []
            for _ in range(MEASURE_REPEATS):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                node.target(*args, **kwargs)
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
        except (RuntimeError, TypeError, ValueError) as error:
            log.debug("storm: could not time %s (%s); using the roofline", node.target, error)
            return None
        return sorted(times)[len(times) // 2]


class CostModel:
    """Per-node compute time and per-copy transfer time under one :class:`DeviceProfile`.

    ``override(node)`` may return seconds for a node (e.g. a measured time) or None to use the
    roofline. Estimates are cached by op, input/output shapes, strides and dtypes.
    """

    def __init__(self, profile: DeviceProfile,
                 override: Callable[[fx.Node], float | None] | None = None) -> None:
        self.profile = profile
        self.override = override
        self._cache: dict[tuple, float] = {}

    def _traffic(self, node: fx.Node) -> tuple[int, int]:
        """Bytes ``node`` reads and writes in device memory, counting fusion: a fusible node
        reads only the inputs produced outside its chain and writes only if it ends the chain."""
        out = node.meta.get("val")
        if not is_fusible(node):
            return _tensor_bytes([_value(a) for a in node.args]), _tensor_bytes(out)
        reads = sum(_tensor_bytes(a.meta.get("val")) for a in node.all_input_nodes
                    if not is_fusible(_producer(a)))
        return reads, _tensor_bytes(out) if materialized(node) else 0

    @staticmethod
    def describe(node: fx.Node) -> tuple:
        """Op, and shapes, strides and dtypes of its arguments and outputs."""
        def describe(value):
            if isinstance(value, torch.Tensor):
                return (tuple(value.shape), tuple(value.stride()), value.dtype)
            return value if isinstance(value, (int, float, bool, str, type(None))) else type(value)

        args = tuple(describe(v) for v in tree_leaves([_value(a) for a in node.args]))
        kwargs = tuple((k, describe(v)) for k, v in node.kwargs.items())
        return (node.target, args, kwargs,
                tuple(describe(v) for v in tree_leaves(node.meta.get("val"))))

    def _key(self, node: fx.Node) -> tuple:
        return (*self.describe(node), self._traffic(node), materialized(node))

    def compute_seconds(self, node: fx.Node) -> float:
        """Seconds ``node`` keeps the compute stream busy (0 for views and graph plumbing)."""
        if node.op != "call_function" or is_view(node) or not hasattr(node.target, "_schema"):
            return 0.0
        if self.override is not None:
            measured = self.override(node)
            if measured is not None:
                return measured
        key = self._key(node)
        if key not in self._cache:
            self._cache[key] = self._roofline(node)
        return self._cache[key]

    def _roofline(self, node: fx.Node) -> float:
        out = node.meta.get("val")
        dtypes = [v.dtype for v in tree_leaves(out) if isinstance(v, torch.Tensor)]
        rate = self.profile.matmul_flops if dtypes and dtypes[0] in HALF_PRECISION \
            else self.profile.fp32_flops
        packet = getattr(node.target, "overloadpacket", None)
        if FLOP_ALIASES.get(packet, packet) in ATTENTION_OPS:
            rate *= ATTENTION_EFFICIENCY
        reads, writes = self._traffic(node)
        launch = self.profile.launch_s if materialized(node) else 0.0
        return max(node_flops(node) / rate, (reads + writes) / self.profile.memory_bandwidth,
                   launch)

    def transfer_seconds(self, nbytes: int, direction: str) -> float:
        """Seconds to copy ``nbytes`` alone on the link, ``direction`` 'h2d' or 'd2h'."""
        return self.profile.copy_latency_s + nbytes / self.bandwidth(direction)

    def bandwidth(self, direction: str, shared: bool = False) -> float:
        """Bytes/s of one direction, alone or sharing the link with the other direction."""
        alone = self.profile.h2d_bandwidth if direction == "h2d" else self.profile.d2h_bandwidth
        if not shared:
            return alone
        total = self.profile.h2d_bandwidth + self.profile.d2h_bandwidth
        return self.profile.duplex_bandwidth * alone / total
