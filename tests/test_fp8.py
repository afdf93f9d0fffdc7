"""``offload_format="fp8"``: offloaded activations packed into fp8 with a scale (lossy, opt-in)."""

import copy

import pytest
import torch

from helpers import CPU_TEST_OPTIONS, FP8_GRADIENT_ERROR
from storm_compile import storm
from storm_compile.cli.models import LLAMA_PRESETS, build_llama
from storm_compile.compiler.backend import StormBackend
from storm_compile.config import StormConfig, StormOptionError
from storm_compile.fx import fp8
from storm_compile.fx.plan import Action
from storm_compile.runtime import ops

EXACT_GRADIENT_ERROR = 1e-5
"""The same without fp8: the copies are exact."""


def test_which_tensors_compress():
    bf16 = torch.empty(4, 8, dtype=torch.bfloat16)
    assert fp8.compresses(bf16, "fp8") and not fp8.compresses(bf16, None)
    assert not fp8.compresses(bf16.t(), "fp8")                     # not contiguous
    assert not fp8.compresses(torch.empty(4, 8, dtype=torch.int64), "fp8")
    assert not fp8.compresses(torch.empty(0, dtype=torch.float32), "fp8")
    assert not fp8.compresses(torch.empty((), dtype=torch.bfloat16), "fp8")   # 2 bytes packed
    assert fp8.link_bytes(bf16, bf16.nbytes, "fp8") == fp8.SCALE_BYTES + 32
    assert fp8.link_bytes(bf16, bf16.nbytes, None) == bf16.nbytes


def test_the_option_is_validated_and_off_by_default():
    assert StormConfig.from_options().offload_format is None
    with pytest.raises(StormOptionError, match="offload_format.*'fp8'"):
        storm(offload_format="int4")


def _graphs(**options):
    torch.manual_seed(0)
    model, batch = build_llama(LLAMA_PRESETS["tiny"])
    captured = []
    backend = StormBackend(StormConfig.from_options(**{**CPU_TEST_OPTIONS, **options}),
                           observer=captured.append)
    torch.compile(model, backend=backend)(*batch).backward()
    return captured[0]


def _casts_to(graphs, dtype) -> int:
    return sum(1 for gm in (graphs.forward, graphs.backward) for n in gm.graph.nodes
               if n.target is torch.ops.prims.convert_element_type.default and n.args[1] == dtype)


def test_each_offload_moves_its_packed_bytes_and_the_backward_rebuilds_it():
    graphs = _graphs(offload_format="fp8")
    offloaded = list(graphs.storages.with_action(Action.OFFLOAD))
    packed = [s for s in offloaded if fp8.compresses(s.root.meta["val"], "fp8")]
    assert packed and len(packed) == _casts_to(graphs, fp8.FP8)
    copies = graphs.forward.graph.find_nodes(op="call_function", target=ops.offload)
    for storage in offloaded:
        assert storage.link_bytes == fp8.link_bytes(storage.root.meta["val"], storage.nbytes,
                                                    "fp8")
    moved = sorted(n.meta["val"].nbytes for n in copies)
    assert moved == sorted(s.link_bytes for s in offloaded)
    assert all(s.link_bytes < s.nbytes for s in packed)


def test_without_the_option_nothing_is_packed():
    graphs = _graphs()
    assert _casts_to(graphs, fp8.FP8) == 0
    assert all(s.link_bytes == s.nbytes for s, _ in graphs.storages)


@pytest.mark.parametrize("inner", ["eager", "inductor"])
@pytest.mark.parametrize("offload_format", [None, "fp8"])
def test_gradients_within_fp8_error_and_the_loss_exact(inner, offload_format):
    torch.manual_seed(0)
    model, batch = build_llama(LLAMA_PRESETS["tiny"])
    reference = copy.deepcopy(model)
    expected_loss = reference(*batch)
    expected_loss.backward()
    torch._dynamo.reset()
    loss = torch.compile(model, backend=storm(**{
        **CPU_TEST_OPTIONS, "inner": inner, "offload_format": offload_format}))(*batch)
    loss.backward()
    torch.testing.assert_close(loss, expected_loss)
    errors = [((p.grad - r.grad).norm() / r.grad.norm()).item()
              for p, r in zip(model.parameters(), reference.parameters())]
    bound = FP8_GRADIENT_ERROR if offload_format else EXACT_GRADIENT_ERROR
    assert max(errors) <= bound
    if offload_format:
        assert max(errors) > EXACT_GRADIENT_ERROR       # the copies were packed, not exact
