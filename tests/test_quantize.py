"""Frozen streamed weights held in int8 and NF4 host formats (storm_compile.weights.quantize)."""

import copy
import json
import sys

import pytest
import torch
from torch import nn

from helpers import CPU_TEST_OPTIONS
from storm_compile import storm
from storm_compile.cli.models import add_lora, build_llama
from storm_compile.cli.shapes import LLAMA_PRESETS
from storm_compile.compiler.backend import StormBackend
from storm_compile.config import StormConfig
from storm_compile.fx.graphs import saved_values
from storm_compile.weights import streaming
from storm_compile.weights.quantize import (
    INT8_LEVELS,
    NF4_BLOCK,
    NF4_CODE,
    Packed,
    StormQuantizeError,
    dequantize,
    quantize,
)
from storm_compile.weights.streaming import (
    StormHostMemoryError,
    checkpoint_weights,
    stream_parameters,
)

SHAPE = LLAMA_PRESETS["tiny"]
RESIDENT_BYTES = 8192
"""Above the tiny model's norm weights and LoRA factors, below its smallest matrix."""
RANK = 4
FORMATS = ("int8", "nf4")


def _lora_llama(device: str = "cpu"):
    torch.manual_seed(0)
    model, batch = build_llama(SHAPE, device)
    return add_lora(model, RANK), batch


def _big(param: torch.Tensor) -> bool:
    return param.numel() * param.element_size() >= RESIDENT_BYTES


def _as_held(model: nn.Module, format: str) -> nn.Module:
    """A copy of ``model`` whose streamed-size frozen weights hold what ``format`` keeps of them,
    resident (the unstreamed reference)."""
    held = copy.deepcopy(model)
    with torch.no_grad():
        for param in held.parameters():
            if _big(param) and not param.requires_grad:
                param.copy_(dequantize(*quantize(param, format)))
    return held


def _adapter_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("format", FORMATS)
def test_a_weight_packs_to_its_format_bytes_and_back(format):
    weight = torch.randn(96, 128)
    data, packed = quantize(weight, format)
    codes = 96 * 128 if format == "int8" else 96 * 128 // 2
    scales = 96 if format == "int8" else 96 * 128 // NF4_BLOCK
    assert data.dtype == torch.uint8 and data.numel() == packed.nbytes == codes + 4 * scales
    rebuilt = dequantize(data, packed)
    assert rebuilt.shape == weight.shape and rebuilt.dtype == weight.dtype
    if format == "int8":
        step = weight.abs().amax(1, keepdim=True) / INT8_LEVELS
        assert ((rebuilt - weight).abs() <= step / 2 + 1e-6).all()
    else:
        scale = weight.reshape(-1, NF4_BLOCK).abs().amax(1, keepdim=True)
        values = (rebuilt.reshape(-1, NF4_BLOCK) / scale)
        code = torch.tensor(NF4_CODE)
        assert torch.isclose(values[..., None], code, atol=1e-6).any(-1).all()
        nearest = (weight.reshape(-1, NF4_BLOCK)[..., None] / scale[..., None] - code) \
            .abs().amin(-1)
        torch.testing.assert_close((values - weight.reshape(-1, NF4_BLOCK) / scale).abs(),
                                   nearest)


def test_values_on_the_code_book_come_back_exactly():
    scale = torch.tensor([3.0, 0.5]).repeat_interleave(NF4_BLOCK)
    weight = (torch.tensor(NF4_CODE).repeat(2 * NF4_BLOCK // len(NF4_CODE)) * scale).view(2, 64)
    assert torch.equal(dequantize(*quantize(weight, "nf4")), weight)
    rows = torch.arange(-INT8_LEVELS, INT8_LEVELS + 1, dtype=torch.float32)[None] * 0.25
    assert torch.equal(dequantize(*quantize(rows, "int8")), rows)


@pytest.mark.parametrize("shape, format, message", [
    ((128,), "int8", "2 or more dimensions"),
    ((3, 7), "nf4", "blocks of 64"),
    ((64, 64), "fp8", "unknown host format"),
])
def test_a_weight_a_format_cannot_hold_is_an_error(shape, format, message):
    with pytest.raises(StormQuantizeError, match=message):
        quantize(torch.zeros(shape), format)


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("backend", ["eager", "storm"])
def test_quantized_streaming_equals_the_held_weights_unstreamed(format, backend):
    """Forward and every adapter's gradient equal the same quantized weights used resident;
    the frozen weights get no gradient; the host holds the packed bytes."""
    model, batch = _lora_llama()
    reference = _as_held(model, format)
    done = stream_parameters(model, "cpu", resident_bytes=RESIDENT_BYTES, host_format=format)
    assert set(done.formats) == set(done.names) and set(done.formats.values()) == {format}
    assert done.host_bytes == sum(
        Packed(format, tuple(p.shape), p.dtype).nbytes
        for p in reference.parameters() if _big(p))
    run = model if backend == "eager" else torch.compile(model, backend=storm(**CPU_TEST_OPTIONS))
    expected = (reference if backend == "eager" else torch.compile(reference,
                                                                   backend="aot_eager"))(*batch)
    loss = run(*batch)
    expected.backward()
    loss.backward()
    torch.testing.assert_close(loss, expected)
    grads, wanted = _adapter_grads(model), _adapter_grads(reference)
    assert grads.keys() == wanted.keys() and len(grads) == 2 * (7 * SHAPE.layers + 1)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, wanted[name])
    host = [p for n, p in model.named_parameters() if "original" in n]
    assert host and all(p.dtype == torch.uint8 and p.grad is None for p in host)


def test_a_rebuilt_weight_is_never_saved_for_the_backward():
    """The partitioner fetches and rebuilds a packed weight again in the backward: nothing the
    forward saves has a streamed weight's shape."""
    model, batch = _lora_llama()
    shapes = {tuple(p.shape) for p in model.parameters() if _big(p)}
    stream_parameters(model, "cpu", resident_bytes=RESIDENT_BYTES, host_format="nf4")
    captured = []
    backend = StormBackend(StormConfig.from_options(**CPU_TEST_OPTIONS),
                           observer=captured.append)
    torch.compile(model, backend=backend)(*batch).backward()
    saved = [tuple(n.meta["val"].shape) for n in saved_values(captured[0])
             if isinstance(n.meta.get("val"), torch.Tensor)]
    assert saved and not shapes & set(saved)


@pytest.mark.parametrize("format", [*FORMATS, None])
def test_a_packed_weight_holds_its_copy_and_its_rebuilt_weight_while_read(format):
    """What a byte budget pays for a streamed weight being read: its copy, and for a packed
    one the weight rebuilt in its dtype beside it (the largest such weight decides)."""
    model, batch = _lora_llama()
    logical = {id(p): p.numel() * p.element_size() for p in model.parameters() if _big(p)}
    stream_parameters(model, "cpu", resident_bytes=RESIDENT_BYTES, host_format=format)
    captured = []
    backend = StormBackend(StormConfig.from_options(**CPU_TEST_OPTIONS),
                           observer=captured.append)
    torch.compile(model, backend=backend)(*batch).backward()
    weights = streaming.device_weights(captured[0].forward, 0)
    copied = weights.largest.meta["val"].numel() * weights.largest.meta["val"].element_size()
    rebuilt = 0 if format is None else max(logical.values())
    assert weights.largest_bytes == copied + rebuilt


def test_trainable_weights_keep_their_dtype_and_naming_one_is_an_error():
    """A model-wide format packs the frozen weights only; a module named in a per-module
    format whose own parameter trains is an error before anything moves."""
    torch.manual_seed(0)
    model, _ = build_llama(SHAPE)
    model.lm_head.requires_grad_(False)
    with pytest.raises(StormQuantizeError, match="names 'embed' .* embed.weight trains"):
        stream_parameters(model, "cpu", resident_bytes=RESIDENT_BYTES,
                          host_format={"": "nf4", "embed": "int8"})
    assert not any(torch.nn.utils.parametrize.is_parametrized(m) for m in model.modules())
    done = stream_parameters(model, "cpu", resident_bytes=RESIDENT_BYTES, host_format="int8")
    assert done.formats == {"lm_head.weight": "int8"}
    assert model.embed.parametrizations.weight.original.dtype == torch.float32


def test_formats_per_module_take_the_longest_name():
    model, _ = _lora_llama()
    formats = {"": "nf4", "blocks.0": "int8", "blocks.0.q": None}
    done = stream_parameters(model, "cpu", resident_bytes=RESIDENT_BYTES, host_format=formats)
    assert done.formats["blocks.0.k.base.weight"] == "int8"
    assert done.formats["blocks.1.q.base.weight"] == done.formats["lm_head.base.weight"] == "nf4"
    assert "blocks.0.q.base.weight" in done.names and "blocks.0.q.base.weight" not in done.formats
    assert model.blocks[0].q.base.parametrizations.weight.original.dtype == torch.float32


def test_state_dict_gives_the_rebuilt_weights_and_loading_packs_them():
    model, batch = _lora_llama()
    reference = _as_held(model, "int8")
    stream_parameters(model, "cpu", resident_bytes=RESIDENT_BYTES, host_format="int8")
    state = model.state_dict()
    assert state.keys() == reference.state_dict().keys()
    for name, value in reference.state_dict().items():
        assert torch.equal(state[name], value), name
    other, _ = _lora_llama()
    stream_parameters(other, "cpu", resident_bytes=RESIDENT_BYTES, host_format="int8")
    with torch.no_grad():
        for param in other.parameters():
            param.zero_()
    other.load_state_dict(state)
    torch.testing.assert_close(other(*batch), reference(*batch))
    state["lm_head.base.weight"] = state["lm_head.base.weight"][:-64]
    with pytest.raises(ValueError, match=r"lm_head.base.weight has shape \(192, 64\)"):
        other.load_state_dict(state)


def test_host_memory_counts_frozen_weights_once_in_their_format(monkeypatch):
    """A frozen weight needs no gradient or optimizer state on the host: what must fit is its
    packed bytes; one byte less is refused before anything moves."""
    model, _ = _lora_llama()
    packed = sum(Packed("nf4", tuple(p.shape), p.dtype).nbytes
                 for p in model.parameters() if _big(p))
    monkeypatch.setattr(streaming, "available_host_bytes", lambda: packed - 1)
    with pytest.raises(StormHostMemoryError, match=f"need {packed} bytes"):
        stream_parameters(model, "cpu", resident_bytes=RESIDENT_BYTES, host_format="nf4")
    assert all(p.dtype == torch.float32 for p in model.parameters())
    monkeypatch.setattr(streaming, "available_host_bytes", lambda: packed)
    stream_parameters(model, "cpu", resident_bytes=RESIDENT_BYTES, host_format="nf4")


def test_a_model_on_the_meta_device_loads_from_a_checkpoint(tmp_path):
    """Built on the meta device, materialised from a safetensors checkpoint one weight at a
    time, packed on the way: the same model as one built whole and streamed."""
    safetensors = pytest.importorskip("safetensors.torch")
    model, batch = _lora_llama()
    reference = copy.deepcopy(model)
    stream_parameters(reference, "cpu", resident_bytes=RESIDENT_BYTES, host_format="nf4")
    safetensors.save_file({n: p.contiguous() for n, p in model.named_parameters()},
                          str(tmp_path / "model.safetensors"))
    empty, _ = _lora_llama("meta")
    with pytest.raises(ValueError, match="are on the meta device and no weights were given"):
        stream_parameters(copy.deepcopy(empty), "cpu", resident_bytes=RESIDENT_BYTES)
    stream_parameters(empty, "cpu", resident_bytes=RESIDENT_BYTES, host_format="nf4",
                      weights=checkpoint_weights(tmp_path))
    assert not [n for n, p in empty.named_parameters() if p.is_meta]
    assert torch.equal(empty(*batch), reference(*batch))
    with_buffer, _ = _lora_llama("meta")
    with_buffer.register_buffer("scale", torch.ones(4, device="meta"))
    with pytest.raises(ValueError, match=r"buffers on the meta device \(scale\)"):
        stream_parameters(with_buffer, "cpu", weights=checkpoint_weights(tmp_path))


def test_a_dtype_conversion_rebuilds_packed_weights_in_the_new_dtype():
    """``model.to(torch.float64)`` leaves the packed bytes as they are and the weights are
    rebuilt in float64, as the rest of the model computes."""
    model, batch = _lora_llama()
    reference = _as_held(model, "nf4").to(torch.float64)
    stream_parameters(model, "cpu", resident_bytes=RESIDENT_BYTES, host_format="nf4")
    packed = model.lm_head.base.parametrizations.weight.original
    model.to(torch.float64)
    assert model.lm_head.base.parametrizations.weight.original is packed
    assert packed.dtype == torch.uint8 and model.lm_head.base.weight.dtype == torch.float64
    torch.testing.assert_close(model(*batch), reference(*batch))


@pytest.mark.gpu
@pytest.mark.parametrize("format", FORMATS)
def test_quantized_streaming_on_the_gpu_equals_the_held_weights(format):
    """On CUDA, under storm with Inductor: pinned packed bytes, rebuilt on the device, the same
    loss and adapter gradients as the held weights resident under Inductor."""
    model, batch = _lora_llama()
    reference = _as_held(model, format).cuda()
    stream_parameters(model, "cuda", resident_bytes=RESIDENT_BYTES, host_format=format)
    batch = tuple(t.cuda() for t in batch)
    packed = model.lm_head.base.parametrizations.weight.original
    assert packed.is_pinned() and packed.dtype == torch.uint8
    loss = torch.compile(model, backend=storm())(*batch)
    expected = torch.compile(reference)(*batch)
    loss.backward()
    expected.backward()
    torch.testing.assert_close(loss, expected)
    wanted = _adapter_grads(reference)
    for name, grad in _adapter_grads(model).items():
        torch.testing.assert_close(grad, wanted[name])


def test_a_sharded_checkpoint_is_read_one_tensor_at_a_time(tmp_path):
    """A directory with ``model.safetensors.index.json`` maps every name to its shard."""
    safetensors = pytest.importorskip("safetensors.torch")
    tensors = {"a.weight": torch.randn(4, 8), "b.weight": torch.randn(8, 4)}
    for index, (name, value) in enumerate(tensors.items()):
        safetensors.save_file({name: value}, str(tmp_path / f"shard-{index}.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: f"shard-{i}.safetensors" for i, n in enumerate(tensors)}}))
    weights = checkpoint_weights(tmp_path)
    assert sorted(weights) == sorted(tensors) and len(weights) == 2
    for name, value in tensors.items():
        assert torch.equal(weights[name], value)


def test_reading_a_checkpoint_without_safetensors_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "safetensors", None)
    with pytest.raises(ImportError, match=r"pip install storm-compile\[checkpoints\]"):
        checkpoint_weights(tmp_path)
