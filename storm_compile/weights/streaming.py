"""Parameters kept in host memory and read on the device through a copy in the traced graph.

``stream_parameters(model, device)`` moves each parameter of at least ``resident_bytes`` to host
memory (pinned when CUDA is present) and registers a parametrization on it, so that reading
``module.weight`` inside ``forward`` becomes ``storm.fetch_weight(host_weight, device)``: a copy
to the device whose gradient, ``storm.grad_to_host``, lands in the host parameter's ``.grad``.
The model's code is not changed; ``state_dict`` and ``load_state_dict`` keep the model's own
keys; any optimizer over ``model.parameters()`` updates the host copies (a CPU optimizer such as
``torch.optim.AdamW(..., fused=True)`` runs where they live).

Under ``torch.compile(backend=storm(...))`` the device copy of a weight is never saved for the
backward: the joint-graph pass ``refetch_weights`` tags every fetch for recomputation, so the
partitioner fetches it again where the backward first needs it; and the gradients of a weight
read more than once (tied embeddings) are summed on the device and sent home once
(``sum_tied_gradients``). Eager mode and other backends run the same copies in program order:
correct, with nothing hidden.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from torch import fx, nn
from torch.nn.utils import parametrize

from storm_compile.fx.torch_private import DisableTorchFunctionSubclass, is_in_torch_dispatch_mode
from storm_compile.fx.vocabulary import (
    GIB,
    MIB,
    graph_constants,
    is_view,
    rebuilds_weight,
    tensor_bytes,
)
from storm_compile.runtime import ops
from storm_compile.runtime.cycles import OVERLAPPABLE, ParameterStep
from storm_compile.runtime.streams import _TENSOR_GRAD, get_runtime, indexed, pin_quickly
from storm_compile.weights.host_residency import HostResidentParametrizationList, keep_on_host
from storm_compile.weights.quantize import Packed, StormQuantizeError, check, dequantize, quantize

DEFAULT_RESIDENT_BYTES = 1 * MIB
"""Parameters smaller than this stay on the device: a copy pays ~25 µs of fixed latency on the
H100 whatever its size (norm weights, biases), and together they are a few MiB."""

HOST_COPIES = 2
"""Host bytes per streamed parameter byte that exist whatever the optimizer: the parameter and
its gradient."""

ADAMW_STATES = 2
"""Tensors of the parameter's size that Adam and AdamW keep per parameter (the two moments):
``stream_parameters``' default ``optimizer_states``."""


class StormHostMemoryError(MemoryError):
    """The host cannot hold what streaming puts there."""


_TENSOR_DATA = torch.Tensor.data


class HostParameter(nn.Parameter):
    """A parameter :func:`stream_parameters` keeps in host memory (the same object, its class
    changed, so optimizers made before or after hold it; a parameter of another class, such as
    a fake tensor planned for another machine, keeps its class, and a backward then waits for
    its additions). Two routes to it bypass what storm tracks, so they go through storm first:

    * ``.grad`` waits for the gradient additions still running on storm's host thread (a
      backward returns before they are done); between a backward and the optimizer step it
      reads as a :class:`~storm_compile.runtime.cycles.HeldGrad`, whose writes storm judges
      (:mod:`storm_compile.runtime.cycles`); setting it to None (``zero_grad``) starts a new
      count of backwards;
    * ``.data``, read or replaced, makes every device copy kept of a host weight be copied again
      before its next read: writes through ``.data`` move no version counter.
    """

    storm_streamed = True

    @property
    def grad(self) -> torch.Tensor | None:
        return get_runtime().read_grad(self)

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        get_runtime().grad_replaced(self, cleared=value is None)
        _TENSOR_GRAD.__set__(self, value)

    @grad.deleter
    def grad(self) -> None:
        get_runtime().grad_replaced(self, cleared=False)
        _TENSOR_GRAD.__delete__(self)

    @property
    def data(self) -> torch.Tensor:
        get_runtime().note_host_write()
        return _TENSOR_DATA.__get__(self)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        get_runtime().note_host_write()
        _TENSOR_DATA.__set__(self, value)


class StormWriteError(RuntimeError):
    """A write into ``module.weight`` of a streamed parameter: a device copy made for that read,
    so the write would be lost."""


_DATA_GET = torch.Tensor.data.__get__
_DATA_SET = torch.Tensor.data.__set__


class DeviceCopy(torch.Tensor):
    """What reading ``module.weight`` of a streamed parameter returns outside a compiled graph:
    the copy :func:`stream_parameters` fetched for that read. Any op reads it as a plain tensor
    (and returns plain tensors); ``.data`` and in-place ops raise :class:`StormWriteError`,
    since a write into a copy made for one read is lost (peft's ``merge_and_unload``,
    ``nn.init`` on ``module.weight``, ``module.weight.data = ...``)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        kwargs = kwargs or {}
        written = args[0] if args else next(iter(kwargs.values()), None)  # nn.init: tensor=
        in_place = name.endswith("_") and not name.endswith("__") \
            and isinstance(written, DeviceCopy)
        if in_place or func == _DATA_GET or func == _DATA_SET:
            raise StormWriteError(
                "storm: module.weight of a streamed parameter is a device copy fetched for this "
                "read, so a write into it (.data, in-place ops, merging adapters, nn.init) is "
                "lost; write into the host parameter, module.parametrizations.weight.original, "
                "under torch.no_grad()")
        with DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


class _Fetch(nn.Module):
    """The parametrization of a streamed parameter: its device copy (a :class:`DeviceCopy`
    where it is a real tensor read outside a compile or a trace)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return _outside_traces(self.read(weight))

    def read(self, weight: torch.Tensor) -> torch.Tensor:
        """The weight on the device, as a traced graph computes it."""
        return torch.ops.storm.fetch_weight(weight, self.device)


class _Dequantize(_Fetch):
    """The parametrization of a frozen streamed parameter held in a host format
    (:mod:`storm_compile.weights.quantize`): its packed bytes copied to the device and rebuilt
    there."""

    def __init__(self, device: torch.device, packed: Packed) -> None:
        super().__init__(device)
        self.packed = packed

    def read(self, weight: torch.Tensor) -> torch.Tensor:
        return dequantize(torch.ops.storm.fetch_weight(weight, self.device), self.packed)


def _outside_traces(copy: torch.Tensor) -> torch.Tensor:
    """``copy`` as a :class:`DeviceCopy` where it is a real tensor read outside a compile or a
    trace."""
    traced = torch.compiler.is_compiling() or is_in_torch_dispatch_mode() \
        or type(copy) is not torch.Tensor
    return copy if traced else copy.as_subclass(DeviceCopy)


_CHAIN = "_storm_chain_{}"
"""The instance attribute holding a streamed weight's parametrization list, which its getter
reads: in the instance's ``__dict__``, so a deep copy reads its own list."""


class _StreamedList(HostResidentParametrizationList):
    """The parametrization list of a weight whose getter storm replaced (:func:`_read_streamed`).
    Any change to the list (a parametrization stacked on the weight by
    ``register_parametrization``, or the list edited by hand) gives the weight back to torch's
    getter, which calls the list: the fast getter only knows storm's own parametrization.

    Plain attributes in its ``__dict__`` (no submodule registered twice), read by the getter
    where they are Dynamo's cheapest to trace and guard:

    * ``storm_fetch``: its ``_Fetch``, whose ``packed`` a weight in a host format reads;
    * ``storm_device``: that ``_Fetch``'s device, which ``_apply`` may change and keeps equal;
    * ``storm_torch_getter``: ``(owner, name, torch's property)``, what a change puts back on
      the owning module's class, after giving the owner a class of its own where it shares one
      (:func:`_share_class`), so that the other modules keep storm's getter.
    """

    def _apply(self, fn, recurse: bool = True) -> _StreamedList:
        super()._apply(fn, recurse)
        self.__dict__["storm_device"] = self.storm_fetch.device
        return self

    def _changed(self) -> None:
        owner, name, torch_getter = self.storm_torch_getter
        if getattr(type(owner), _SHARED, False):
            owner.__class__ = _own_class(type(owner))
        setattr(type(owner), name, torch_getter)

    def append(self, module: nn.Module) -> _StreamedList:
        super().append(module)
        self._changed()
        return self

    def extend(self, modules) -> _StreamedList:
        super().extend(modules)
        self._changed()
        return self

    def insert(self, index: int, module: nn.Module) -> None:
        super().insert(index, module)
        self._changed()

    def __setitem__(self, index, module: nn.Module) -> None:
        super().__setitem__(index, module)
        self._changed()

    def __delitem__(self, index) -> None:
        super().__delitem__(index)
        self._changed()


def _read_streamed(module: nn.Module, name: str) -> None:
    """Make ``module.<name>`` fetch its weight without calling modules, where storm's
    ``_Fetch`` is its only parametrization.

    Torch's getter calls the parametrization list and then ``_Fetch``; Dynamo inlines both at
    every read of every streamed weight, at every process start (a warm start included). This
    getter reads the list from the module's ``__dict__`` and calls storm's op on the list's
    ``original`` itself: on a 28-layer Llama with all 252 weights streamed, Dynamo steps through
    7140 bytecodes more than unstreamed, against 39780 with torch's getter. A change to the list
    puts torch's getter back (:class:`_StreamedList`); torch's setter is kept."""
    torch_property = getattr(type(module), name)
    chain = module.parametrizations[name]
    key = _CHAIN.format(name)
    module.__dict__[key] = chain
    chain.__class__ = _StreamedList
    chain.__dict__.update(storm_torch_getter=(module, name, torch_property),
                          storm_fetch=chain[0], storm_device=chain[0].device)

    if isinstance(chain[0], _Dequantize):
        def read(owner: nn.Module) -> torch.Tensor:
            chain = getattr(owner, key)
            weight = dequantize(torch.ops.storm.fetch_weight(chain.original, chain.storm_device),
                                chain.storm_fetch.packed)
            return weight if torch.compiler.is_compiling() else _outside_traces(weight)
    else:
        def read(owner: nn.Module) -> torch.Tensor:
            chain = getattr(owner, key)
            weight = torch.ops.storm.fetch_weight(chain.original, chain.storm_device)
            return weight if torch.compiler.is_compiling() else _outside_traces(weight)

    setattr(type(module), name, property(read, torch_property.fset))


@dataclasses.dataclass(frozen=True)
class Streamed:
    """What :func:`stream_parameters` did."""

    names: tuple[str, ...]
    """Parameters now in host memory, by their ``named_parameters`` names before streaming."""
    host_bytes: int
    """Bytes those parameters hold in host memory (in their host format)."""
    resident: tuple[str, ...]
    """Parameters left on the device (smaller than ``resident_bytes``)."""
    formats: dict[str, str] = dataclasses.field(default_factory=dict)
    """The streamed parameters held in a host format (``"int8"``, ``"nf4"``), by name; the
    others keep their dtype."""


_SHARED = "_storm_shared"
"""Set on a parametrized class :func:`_share_class` gives to several modules."""

_SHARED_CLASSES: dict[tuple, type] = {}
"""The shared parametrized class of each (module class, streamed names and whether each is
rebuilt from a host format)."""


def _share_class(module: nn.Module, names: tuple[str, ...]) -> None:
    """Give ``module`` the parametrized class of every module of its class that streams the
    same weights the same way.

    ``register_parametrization`` gives each module a class of its own, and Dynamo guards a
    module's class: a model compiled block by block (``block.compile()``, regional compilation)
    then traces, plans and compiles each of its identical blocks anew, and past Dynamo's
    recompile limit (8) runs the rest uncompiled. Storm's getters (:func:`_read_streamed`)
    read everything from the instance, so modules that stream the same weights the same way
    can share one class, and identical blocks one compiled graph. A change to one module's
    parametrizations gives that module a class of its own first (:class:`_StreamedList`)."""
    kinds = tuple((name, isinstance(module.parametrizations[name][0], _Dequantize))
                  for name in names)
    key = (type(module).__bases__[0], kinds)
    shared = _SHARED_CLASSES.setdefault(key, type(module))
    setattr(shared, _SHARED, True)
    module.__class__ = shared


def _own_class(shared: type) -> type:
    """A class of its own for a module leaving ``shared``: the same attributes."""
    attributes = {k: v for k, v in vars(shared).items()
                  if k not in ("__dict__", "__weakref__", _SHARED)}
    return type(shared.__name__, shared.__bases__, attributes)


def available_host_bytes() -> int:
    """Host memory the kernel can still give (``MemAvailable``), or physical memory where that
    is not reported."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _packing(module: nn.Module, name: str) -> Packed | None:
    fetch = module.parametrizations[name][0]
    return fetch.packed if isinstance(fetch, _Dequantize) else None


def _saved(module: nn.Module, prefix: str, names: tuple[str, ...], state: dict) -> None:
    """``state_dict``: each streamed weight under the model's own key; one held in a host
    format as the weight the model computes with (rebuilt on the host, in its dtype)."""
    for name in names:
        original = f"{prefix}parametrizations.{name}.original"
        if original not in state:
            continue
        value = state.pop(original)
        packed = _packing(module, name)
        state[f"{prefix}{name}"] = value if packed is None else dequantize(value, packed)


def _loading(module: nn.Module, prefix: str, names: tuple[str, ...], state: dict) -> None:
    """``load_state_dict``: each streamed weight from the model's own key; one held in a host
    format packed into it first."""
    for name in names:
        plain = f"{prefix}{name}"
        if plain not in state:
            continue
        value = state.pop(plain)
        packed = _packing(module, name)
        if packed is not None:
            if tuple(value.shape) != packed.shape:
                raise ValueError(f"load_state_dict: {plain} has shape {tuple(value.shape)}; "
                                 f"the model's packed weight holds {packed.shape}")
            value = quantize(value.to(packed.dtype), packed.format)[0]
        state[f"{prefix}parametrizations.{name}.original"] = value


def _register_state_dict_names(module: nn.Module, names: tuple[str, ...]) -> None:
    """Keep the model's own state_dict keys (``weight``, not
    ``parametrizations.weight.original``) on save and on load."""
    module._register_state_dict_hook(
        lambda mod, state, prefix, metadata: _saved(mod, prefix, names, state))
    module.register_load_state_dict_pre_hook(
        lambda mod, state, prefix, *rest: _loading(mod, prefix, names, state))


HostFormats = str | dict[str, str | None] | None
"""``stream_parameters``' ``host_format``: one format for every streamed parameter, or one per
module name (the longest name that is the parameter's module or a module above it wins; ``""``
is the whole model; None keeps the dtype)."""


def _format_of(host_format: HostFormats, module_name: str) -> str | None:
    if not isinstance(host_format, dict):
        return host_format
    owners = [key for key in host_format
              if key == "" or module_name == key or module_name.startswith(key + ".")]
    return host_format[max(owners, key=len)] if owners else None


class _Source:
    """Where a streamed parameter's values come from: itself, or (on the meta device) the
    ``weights`` mapping :func:`stream_parameters` was given."""

    def __init__(self, weights) -> None:
        self.weights = weights

    def check(self, params: list[tuple[str, torch.Tensor]]) -> None:
        """Raise ``ValueError``, before anything loads, when a parameter on the meta device
        has no tensor in ``weights``."""
        missing = [name for name, param in params if param.is_meta
                   and (self.weights is None or name not in self.weights)]
        if missing:
            given = "no weights were given" if self.weights is None else "weights lacks them"
            raise ValueError(f"stream_parameters: {', '.join(missing)} are on the meta device "
                             f"and {given}; pass weights= (a mapping such as "
                             f"checkpoint_weights(path)) holding every parameter built there")

    def value(self, name: str, param: torch.Tensor) -> torch.Tensor:
        if not param.is_meta:
            return param.data
        value = self.weights[name]
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(f"stream_parameters: weights[{name!r}] has shape "
                             f"{tuple(value.shape)}, the model's parameter {tuple(param.shape)}")
        return value.to(param.dtype)


def _set_data(model: nn.Module, param: nn.Parameter, value: torch.Tensor,
              streamed: bool) -> nn.Parameter:
    """Give ``param`` the data ``value``, returning the parameter that now holds it: ``param``
    itself (a :class:`HostParameter` where it is ``streamed``), or, for a parameter on
    the meta device (whose data cannot change device), a new one put in its place in every
    module of ``model`` that holds it."""
    if not param.is_meta:
        param.data = value
        held = param
    else:
        held = nn.Parameter(value, requires_grad=param.requires_grad)
        for module in model.modules():
            for name, owned in module._parameters.items():
                if owned is param:
                    module._parameters[name] = held
    if streamed and type(held) is nn.Parameter:
        held.__class__ = HostParameter
    return held


def _host_bytes(param: torch.Tensor, format: str | None) -> int:
    if format is None:
        return param.numel() * param.element_size()
    return Packed(format, tuple(param.shape), param.dtype).nbytes


def stream_parameters(model: nn.Module, device: torch.device | str,
                      resident_bytes: int = DEFAULT_RESIDENT_BYTES, *,
                      optimizer_states: int = ADAMW_STATES,
                      host_check: bool = True, host_format: HostFormats = None,
                      weights=None) -> Streamed:
    """Move ``model``'s parameters of at least ``resident_bytes`` to host memory, read on
    ``device`` through ``storm.fetch_weight``; smaller ones move to ``device`` and stay there.
    A CUDA ``device`` without an index is the current device at this call, as ``.to("cuda")``
    reads it.

    ``host_format`` holds frozen streamed parameters (``requires_grad=False``) in 8 or 4 bits
    (``"int8"``, ``"nf4"``; :mod:`storm_compile.weights.quantize`): for the whole model, or per
    module (:data:`HostFormats`). Their packed bytes cross the link and are rebuilt on the device;
    the model computes with the rebuilt weights, and ``state_dict`` gives them (and
    ``load_state_dict`` packs what it is given). Trainable parameters keep their dtype
    (:attr:`Streamed.formats` lists what was packed); a module named in a ``host_format`` dict whose
    own parameter trains raises :class:`~storm_compile.weights.quantize.StormQuantizeError`, as does
    a weight the format cannot hold (fewer than 2 dimensions; for nf4, a size not a multiple of its
    block).

    A model built on the meta device is materialised one parameter at a time from ``weights``
    (a mapping from ``named_parameters`` names to tensors, such as :func:`checkpoint_weights`
    of a safetensors checkpoint), each put straight into (pinned) host memory, packed on the
    way where it has a host format, or on ``device`` where it stays resident: the model is never
    held whole in its dtype.

    Raises :class:`StormHostMemoryError`, before anything moves or loads, when the host does not
    have room for the streamed parameters (in their host formats), the gradients of the
    trainable ones and ``optimizer_states`` tensors of their size per trainable parameter that
    the optimizer over them will keep on the host (2 for Adam and AdamW, 1 for SGD with
    momentum, 0 for plain SGD or an optimizer elsewhere); its state is made at its first step,
    after the first forward and backward, where running out of host memory would lose that
    work. ``host_check=False`` skips the check, for a model of fake tensors planned for another
    machine. Raises ``ValueError`` when ``model`` already streams or ``optimizer_states`` is
    negative."""
    if isinstance(optimizer_states, bool) or not isinstance(optimizer_states, int) \
            or optimizer_states < 0:
        raise ValueError(f"stream_parameters: optimizer_states must be an int >= 0, got "
                         f"{optimizer_states!r}")
    device = indexed(torch.device(device))
    if any(parametrize.is_parametrized(m) for m in model.modules()):
        raise ValueError("stream_parameters: the model already has parametrizations (streamed "
                         "already?); call it once, on a plain model")
    streamed, resident = [], []
    owners: dict[nn.Module, list[str]] = {}
    formats: dict[int, str] = {}
    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{name}" if module_name else name
            big = param.numel() * param.element_size() >= resident_bytes
            (streamed if big else resident).append((full, param))
            if not big:
                continue
            owners.setdefault(module, []).append(name)
            format = _format_of(host_format, module_name)
            if format is not None and param.requires_grad:
                if isinstance(host_format, dict) and host_format.get(module_name) is not None:
                    raise StormQuantizeError(
                        f"stream_parameters: host_format names {module_name!r} "
                        f"({host_format[module_name]!r}), whose {full} trains "
                        f"(requires_grad=True); trainable weights are never quantized: freeze "
                        f"it first, or leave its module out")
                continue
            if format is not None:
                check(format, tuple(param.shape), full)
                formats[id(param)] = format
    meta_buffers = [name for name, buffer in model.named_buffers() if buffer.is_meta]
    if meta_buffers:
        raise ValueError(f"stream_parameters: buffers on the meta device "
                         f"({', '.join(meta_buffers)}) are not loaded from weights; build them "
                         f"on a real device")
    unique = {id(p): (n, p) for n, p in streamed}
    stored = {key: _host_bytes(p, formats.get(key)) for key, (_, p) in unique.items()}
    host_bytes = sum(stored.values())
    trainable = sum(stored[key] for key, (_, p) in unique.items() if p.requires_grad)
    available = available_host_bytes()
    needed = host_bytes + (HOST_COPIES - 1 + optimizer_states) * trainable
    if host_check and needed > available:
        raise StormHostMemoryError(
            f"stream_parameters: the streamed parameters ({host_bytes} bytes in host memory), "
            f"the gradients of the trainable ones and {optimizer_states} optimizer state "
            f"tensor(s) each (optimizer_states) need {needed} bytes ({needed / GIB:.2f} GiB) "
            f"of host memory; {available} bytes ({available / GIB:.2f} GiB) are available")
    source = _Source(weights)
    source.check([*streamed, *resident])
    pin = torch.cuda.is_available()
    if pin:
        pin_quickly()
    packed: dict[int, Packed] = {}
    ids = {key: key for key in unique}
    for key, (name, param) in unique.items():
        value = source.value(name, param)
        if key in formats:
            data, packed[key] = quantize(value, formats[key])
            host = data.to("cpu")
        else:
            host = value.to("cpu")
        ids[id(_set_data(model, param, host.pin_memory() if pin else host, True))] = key
        del value
    get_runtime().watch_optimizers()
    for name, param in resident:
        _set_data(model, param, source.value(name, param).to(device), False)
    for module, names in owners.items():
        for name in names:
            key = ids[id(getattr(module, name))]
            fetch = _Dequantize(device, packed[key]) if key in packed else _Fetch(device)
            parametrize.register_parametrization(module, name, fetch, unsafe=True)
            keep_on_host(module, name)
            _read_streamed(module, name)
        _share_class(module, tuple(names))
        _register_state_dict_names(module, tuple(names))
    return Streamed(names=tuple(n for n, _ in streamed), host_bytes=host_bytes,
                    resident=tuple(n for n, _ in resident),
                    formats={n: formats[id(p)] for n, p in streamed if id(p) in formats})


def checkpoint_weights(path: str | os.PathLike) -> Mapping[str, torch.Tensor]:
    """The tensors of a safetensors checkpoint (one ``.safetensors`` file, or a directory with
    ``model.safetensors`` or a sharded ``model.safetensors.index.json``), read from disk one at
    a time when looked up: for :func:`stream_parameters`' ``weights``. Needs the
    ``safetensors`` package (``pip install storm-compile[checkpoints]``; transformers installs
    it too): without it, ``ImportError`` saying so."""
    try:
        from safetensors import safe_open
    except ImportError as error:
        raise ImportError("checkpoint_weights reads safetensors checkpoints: pip install "
                          "storm-compile[checkpoints] (or safetensors)") from error
    return _Checkpoint(Path(path), safe_open)


class _Checkpoint(Mapping):
    def __init__(self, path: Path, safe_open) -> None:
        if path.is_dir():
            index = path / "model.safetensors.index.json"
            if index.exists():
                shards = json.loads(index.read_text())["weight_map"]
                files = {name: path / shard for name, shard in shards.items()}
            else:
                path = path / "model.safetensors"
                files = None
        else:
            files = None
        if files is None:
            with safe_open(str(path), framework="pt") as handle:
                files = dict.fromkeys(handle.keys(), path)
        self.files = files
        self.open = safe_open

    def __getitem__(self, name: str) -> torch.Tensor:
        with self.open(str(self.files[name]), framework="pt") as handle:
            return handle.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)


def overlap_optimizer(optimizer: torch.optim.Optimizer, enabled: bool = True, *,
                      backwards_per_step: int | None = None) -> torch.optim.Optimizer:
    """Set how ``optimizer`` steps streamed parameters; returns ``optimizer``.

    Without this call storm learns it (:mod:`storm_compile.runtime.cycles`): once ``optimizer`` has
    stepped twice after the same number of backwards with nothing writing into the streamed
    gradients in between, the last backward of each later step also steps each streamed
    parameter as soon as its gradient is complete, while the GPU finishes that backward.
    ``enabled=False`` keeps every step in ``optimizer.step()`` (for a loop that clips or scales
    the gradients before it only now and then); ``backwards_per_step`` states the count, trusted
    from the first step, counted from this call or the last ``zero_grad``; then a
    multiplication of the gradients by exactly one (``clip_grad_norm_`` with an infinite
    ``max_norm``, as the Hugging Face ``Trainer`` runs it for its logs) is skipped, and a write
    that changes the gradient of a parameter already stepped raises
    :class:`~storm_compile.runtime.cycles.StormOverlapError`. Each call forgets what
    was learned: call it when the number of backwards per step changes, since a learned count that
    grows is an error (a parameter stepped during a backward that turned out not to be the last
    cannot be stepped back). Raises ``ValueError`` for a count below 1, or for an optimizer storm
    cannot step one parameter at a time (:data:`storm_compile.runtime.cycles.OVERLAPPABLE`)."""
    if backwards_per_step is not None and (isinstance(backwards_per_step, bool) or not
                                           isinstance(backwards_per_step, int)
                                           or backwards_per_step < 1):
        raise ValueError(f"overlap_optimizer: backwards_per_step must be an int >= 1, got "
                         f"{backwards_per_step!r}")
    if enabled and not isinstance(optimizer, OVERLAPPABLE):
        raise ValueError(f"overlap_optimizer: {type(optimizer).__name__} may not step one "
                         f"parameter at a time; storm overlaps "
                         f"{', '.join(c.__name__ for c in OVERLAPPABLE)}")
    runtime = get_runtime()
    runtime.cycles.configure(optimizer, enabled, backwards_per_step)
    runtime.backwards = 0
    return optimizer


class OverlappedOptimizer:
    """Steps ``optimizer`` for each streamed parameter during the backward that completes its
    gradient, on the host thread that adds the gradients, while the GPU finishes that backward:
    the optimizer's host time overlaps the backward instead of following it. The plain loop
    does this by itself once storm has learned it (:func:`overlap_optimizer`); this class
    says which backward, from the first step, and for any number of backwards per step
    (storm learns nothing of an optimizer wrapped in it).

    Use it around the backward of an optimizer step's last micro-batch::

        overlapped = OverlappedOptimizer(optimizer)
        for i, batch in enumerate(micro_batches):
            loss = compiled(batch) / len(micro_batches)
            if i < len(micro_batches) - 1:
                loss.backward()
            else:
                with overlapped.final_backward():
                    loss.backward()     # streamed parameters stepped, their .grad set to None
        optimizer.step()                # steps the rest (parameters left on the device)
        optimizer.zero_grad()

    A streamed parameter is stepped once all of its gradient has arrived (known from the
    backwards before, or once the whole backward has been launched) and no copy launched from
    it is still reading it; ``backward()``
    returns after every step. Its ``.grad`` is None afterwards, so ``optimizer.step()`` skips
    it, and LR schedulers and ``state_dict`` work on ``optimizer`` as usual. Gradient clipping
    over streamed parameters needs their whole gradient before any step: clip without this
    class. The optimizer must step each parameter independently of the others (AdamW, Adam,
    SGD and the like, not LBFGS).
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = overlap_optimizer(optimizer, enabled=False)

    @contextlib.contextmanager
    def final_backward(self) -> Iterator[None]:
        """Step the streamed parameters during the backward run inside this block."""
        runtime = get_runtime()
        if runtime.stepper is not None:
            raise RuntimeError("OverlappedOptimizer.final_backward: already inside one")
        runtime.stepper = ParameterStep(self.optimizer)
        try:
            yield
        finally:
            runtime.stepper = None


@contextlib.contextmanager
def gradient_accumulation() -> Iterator[None]:
    """Gradient accumulation over micro-batches without waiting between them: inside this
    block, a backward returns once its kernels and copies are launched and the backward before
    it has its gradients added: the host thread adds a micro-batch's streamed gradients while
    the next micro-batch runs, and a host slower than the GPU holds the GPU back rather than
    queueing every micro-batch's gradients in pinned memory. The block's end waits for every
    addition (and raises the first error one hit), and so does any
    ``optimizer.step()``::

        with gradient_accumulation():
            for batch in micro_batches:
                (compiled(batch) / len(micro_batches)).backward()
        optimizer.step()

    Inside the block a streamed parameter's ``.grad`` is not complete: read it (clip, log)
    after the block, and call ``zero_grad`` outside it. Outside the block each backward returns
    with its gradients added. :meth:`OverlappedOptimizer.final_backward` works inside the
    block: that backward waits for its steps as usual.
    """
    with get_runtime().deferred():
        yield


@dataclasses.dataclass(frozen=True)
class DeviceWeights:
    """What a forward graph holds on the device besides activations, at most: its resident
    inputs (parameters left on the device, buffers, the batch) and, for a graph that streams
    weights, up to the prefetch window of streamed weights copied ahead and the largest
    streamed weight while it is read."""

    resident_bytes: int
    in_flight_bytes: int = 0
    largest: fx.Node | None = None
    """The largest streamed weight: a graph input in host memory (None: the graph streams
    none)."""
    largest_bytes: int = 0

    @property
    def streams(self) -> bool:
        return self.largest is not None

    @property
    def nbytes(self) -> int:
        return self.resident_bytes + self.in_flight_bytes + self.largest_bytes

    def describe(self) -> str:
        if self.largest is None:
            return f"its parameters, buffers and inputs ({self.resident_bytes} bytes)"
        value = self.largest.meta["val"]
        shape = "×".join(str(d) for d in value.shape)
        return (f"its resident parameters and inputs ({self.resident_bytes} bytes), up to "
                f"{self.in_flight_bytes} bytes of streamed weights copied ahead "
                f"(prefetch_window_bytes) and its largest streamed weight while it is read "
                f"({self.largest.name}, {shape} {value.dtype}, {self.largest_bytes} bytes)")


def device_weights(forward: fx.GraphModule, window: int) -> DeviceWeights:
    """The weights ``forward`` holds on the device (:class:`DeviceWeights`). A streamed weight
    is a graph input read through ``storm.fetch_weight`` or, once storm rewrote the graph,
    ``storm.prefetch`` (the forward prefetches nothing else)."""
    inputs = forward.graph.find_nodes(op="placeholder")
    copies = (ops.fetch_weight, ops.prefetch)
    streamed = [n for n in inputs if any(u.target in copies for u in n.users)]
    sizes = {n: tensor_bytes(n.meta.get("val")) for n in inputs}
    resident = sum(sizes[n] for n in inputs if n not in streamed)
    if not streamed:
        return DeviceWeights(resident)
    constants = graph_constants(forward.graph)
    read = {n: sizes[n] + _rebuilt_bytes(n, constants) for n in streamed}
    largest = max(streamed, key=read.__getitem__)
    return DeviceWeights(
        resident_bytes=resident,
        in_flight_bytes=min(window, sum(sizes[n] for n in streamed) - sizes[largest]),
        largest=largest, largest_bytes=read[largest])


def _rebuilt_bytes(weight: fx.Node, constants: set[fx.Node]) -> int:
    """Device bytes a streamed weight's rebuild writes besides its copy while it is read: the
    largest value written by the ops that rebuild it from its copy (:func:`rebuilds_weight`,
    the ops ``refetch_weights`` fetches again: a weight held in a host format rebuilt in its
    dtype, a cast; ``constants`` are its graph's :func:`graph_constants`); 0 when it is read
    as copied."""
    from storm_compile.cost.cost_model import materialized

    rebuilt, largest, frontier = {weight}, 0, [weight]
    while frontier:
        for user in frontier.pop().users:
            if user in rebuilt or not rebuilds_weight(user, rebuilt, constants):
                continue
            rebuilt.add(user)
            frontier.append(user)
            if not is_view(user) and user.target not in (ops.fetch_weight, ops.prefetch) \
                    and materialized(user):
                largest = max(largest, tensor_bytes(user.meta.get("val")))
    return largest
