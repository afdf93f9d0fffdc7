"""Streamed parameters stay in host memory through every ``nn.Module._apply``.

``model.to(device)``, ``.cuda()``, ``.half()``, ``.to(dtype)`` and everything built on them
(the Hugging Face ``Trainer``, ``Accelerator.prepare``, Lightning's strategies and precision
plugins) convert each tensor of the model with a function ``fn`` passed to
``nn.Module._apply``. Left alone, that function copies a streamed parameter (the ``original``
of its ``ParametrizationList``) to the device whole: the model then trains unstreamed, or runs
out of device memory, with nothing saying why.

:func:`keep_on_host` gives a streamed parameter's ``ParametrizationList`` an ``_apply`` that
never runs ``fn`` on a tensor ``fn`` would move off the host. It applies ``fn`` to an empty
probe of the same dtype, dimensions and device first: where the probe stays on the host (a
dtype change, ``.cpu()``, ``share_memory()``), ``fn`` runs on the tensor as usual and a
pinned tensor is pinned again; where the probe leaves the host, the tensor stays there,
converted to the probe's dtype (pinned when it was pinned). The parametrizations that read the
tensor on a device follow the rest of the model: each one's ``device`` goes where ``fn`` sends
an empty tensor on that device, so after ``model.to("cuda")`` a model streamed for the CPU
computes on the GPU. The parameter stays the same object, of the same class, whatever
``torch.__future__`` says about swapping or overwriting parameters on conversion (an optimizer
built before the move still holds it); its ``.grad`` is kept and converted the same way, and
``state_dict`` keys do not change. A weight packed in a host format
(:mod:`storm_compile.weights.quantize`) stays packed, and is rebuilt in the dtype ``fn`` gives its
dtype (``model.half()`` rebuilds it in float16).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.utils import parametrize

from storm_compile.weights.quantize import Packed

Convert = Callable[[torch.Tensor], torch.Tensor]


def _probe(fn: Convert, dtype: torch.dtype, dims: int,
           device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """An empty tensor of ``dtype`` and ``dims`` dimensions on ``device``, and what ``fn``
    makes of it: where and in which dtype ``fn`` puts such a tensor, without allocating
    anything (a probe sent to a device may initialise its context, as the move it stands for
    would)."""
    with torch.no_grad():
        probe = torch.empty((0,) * dims, dtype=dtype, device=device)
        return probe, fn(probe)


def _host_version(fn: Convert, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` after ``fn``, kept on the host: ``fn(tensor)`` where ``fn`` leaves a host
    tensor on the host, else ``tensor`` converted to the dtype ``fn`` gives. Pinned when
    ``tensor`` was."""
    _, target = _probe(fn, tensor.dtype, tensor.dim(), tensor.device)
    pinned = tensor.is_pinned()
    if target.device == tensor.device:
        converted = fn(tensor)
        if pinned and converted is not tensor and not converted.is_pinned():
            converted = converted.pin_memory()
        return converted
    if target.dtype == tensor.dtype:
        return tensor
    return torch.empty_like(tensor, dtype=target.dtype, pin_memory=pinned).copy_(tensor)


class HostResidentParametrizationList(parametrize.ParametrizationList):
    """A ``ParametrizationList`` whose original tensor stays in host memory whatever ``_apply``
    is given; see the module's docstring."""

    def _apply(self, fn: Convert, recurse: bool = True) -> HostResidentParametrizationList:
        original = self.original if self.is_tensor else self.original0
        for parametrization in self:
            device = getattr(parametrization, "device", None)
            if isinstance(device, torch.device):
                probe, moved = _probe(fn, original.dtype, original.dim(), device)
                if moved.device != probe.device:
                    parametrization.device = moved.device
            packed = getattr(parametrization, "packed", None)
            if isinstance(packed, Packed):
                _, converted = _probe(fn, packed.dtype, len(packed.shape), original.device)
                parametrization.packed = dataclasses.replace(packed, dtype=converted.dtype)
        if recurse:
            for module in self.children():
                module._apply(fn)
        with torch.no_grad():
            for param in self._parameters.values():
                grad = param.grad
                param.data = _host_version(fn, param)
                if grad is not None:
                    param.grad = _host_version(fn, grad)
            for key, buffer in self._buffers.items():
                self._buffers[key] = _host_version(fn, buffer)
        return self


def keep_on_host(module: nn.Module, name: str) -> None:
    """Keep parametrized tensor ``name`` of ``module`` in host memory through every
    ``nn.Module._apply`` (``to``, ``cuda``, ``half``, ...), as the module's docstring says.

    Assumes ``name`` is parametrized on ``module`` (``module.parametrizations[name]`` exists)
    and its original tensor is in host memory; the parametrizations that read it on a device
    say which in a ``device`` attribute holding a ``torch.device`` (storm's ``_Fetch``).
    Parametrizations registered on ``name`` later keep the behaviour."""
    module.parametrizations[name].__class__ = HostResidentParametrizationList
