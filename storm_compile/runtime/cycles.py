"""What storm learns of the training loop around streamed parameters: how many backwards each
optimizer step follows, and whether anything writes into their gradients before that step.

The plain loop::

    for batch in micro_batches:
        model(batch).backward()
    optimizer.step()
    optimizer.zero_grad()

is served as the fast loop by itself. Every backward returns without waiting for its own
gradients' host additions (any read of a streamed parameter's ``.grad`` waits for them), and
once an optimizer has stepped :data:`STABLE_CYCLES` times after the same number ``n`` of
backwards, with nothing writing into the streamed gradients between the last backward and the
step, the ``n``-th backward of every later step also steps that optimizer for each streamed
parameter as soon as its gradient is complete, on the host thread, while the GPU runs the
backward. ``optimizer.step()`` then steps only the parameters left on the device.

Reading the gradients between the last backward and the step (a norm for the logs) changes
nothing: a parameter stepped during the backward keeps its ``.grad`` until ``zero_grad``, and
``optimizer.step()`` skips it. Writing them there (clipping, a grad scaler) is what the overlap
cannot serve, since a step taken with the gradient as it was cannot be undone: a write seen while
storm learns keeps that optimizer on the slow path, with one warning; a write into the gradient
of a parameter already stepped raises :class:`StormOverlapError`, and so does a backward that
brings a gradient to a parameter already stepped in an earlier backward of the same step (more
backwards per step than storm learned). A multiplication by exactly one (``clip_grad_norm_``
with an infinite ``max_norm``, which the Hugging Face ``Trainer`` runs for its logs) writes
nothing once the count is stated; while storm learns it counts as a write, since the same call
with a finite ``max_norm`` multiplies by one only until the norm first exceeds it.
:func:`overlap_optimizer` turns the overlap off, or states the count up front.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from storm_compile.fx.torch_private import DisableTorchFunctionSubclass, foreach_mul_

STABLE_CYCLES = 2
"""Optimizer steps in a row that must follow the same number of backwards before storm steps
parameters during the last one: a first step taken after a different count (a warm-up or a
sanity step) is not trusted, because stepping a parameter too early cannot be undone."""

OVERLAPPABLE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax,
                torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.RMSprop,
                torch.optim.NAdam, torch.optim.RAdam, torch.optim.Rprop, torch.optim.ASGD)
"""torch's optimizers whose update of a parameter reads only that parameter, its gradient and
its own state, so they may step one parameter at a time. Others (LBFGS, which needs every
gradient at once; optimizers storm does not know) step in ``optimizer.step()``."""


class StormOverlapError(RuntimeError):
    """A loop did what an optimizer step already taken during a backward cannot serve."""


@dataclasses.dataclass
class Cycle:
    """One optimizer's learning state."""

    counts: list[int] = dataclasses.field(default_factory=list)
    """Backwards before each of its last :data:`STABLE_CYCLES` steps."""
    backwards_per_step: int | None = None
    """Stated by :func:`overlap_optimizer`: trusted from the first step."""
    enabled: bool = True
    """False once turned off by :func:`overlap_optimizer` or by a read while learning."""
    stepped: dict[int, int] = dataclasses.field(default_factory=dict)
    """``id(param)`` of each parameter stepped during a backward of the current step, to the
    number of backwards before that one."""

    def final_backward(self) -> int | None:
        """How many backwards come before the one that steps the streamed parameters, or None
        while not known."""
        return self.last_backward() if self.enabled else None

    def last_backward(self) -> int | None:
        """How many backwards come before a step's last, stated or learned, whether or not the
        optimizer steps during it; None while not known. A gradient summed on the device
        until then goes home once
        (:meth:`~storm_compile.runtime.streams.TransferRuntime.send_grad`): a step of fewer
        backwards sends the sums when it reads them or steps, so a wrong count costs time,
        never a gradient."""
        if self.backwards_per_step is not None:
            return self.backwards_per_step - 1
        if len(self.counts) == STABLE_CYCLES and len(set(self.counts)) == 1 \
                and self.counts[0] > 0:
            return self.counts[0] - 1
        return None

    def observe(self, backwards: int) -> None:
        """A step followed ``backwards`` backwards."""
        self.counts = [*self.counts, backwards][-STABLE_CYCLES:]
        self.stepped.clear()


IN_PLACE_OPERATORS = frozenset({
    "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
    "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__", "__setitem__",
})
"""Python's in-place operators and item assignment on a tensor: writes, like torch's ops whose
names end in one underscore."""
_DATA_GET = torch.Tensor.data.__get__
_DATA_SET = torch.Tensor.data.__set__
"""``.data`` replaced is a write; read, it is the same gradient, handed out guarded again, since a
write through it moves no version counter."""
_MULTIPLICATIONS = (torch.Tensor.mul_, foreach_mul_)


def _written(func, args: tuple, kwargs: dict) -> list:
    """The tensors ``func(*args, **kwargs)`` writes into: its first argument (or each tensor of
    it, for a ``_foreach`` op) when it works in place, and its ``out``."""
    name = getattr(func, "__name__", "")
    targets = []
    if args and (func == _DATA_SET or name in IN_PLACE_OPERATORS
                 or (name.endswith("_") and not name.endswith("__"))):
        targets += args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
    out = kwargs.get("out")
    targets += out if isinstance(out, (list, tuple)) else [out]
    return [t for t in targets if isinstance(t, HeldGrad)]


def _times_one(func, args: tuple) -> bool:
    """Whether ``func(*args)`` multiplies by exactly one."""
    if func not in _MULTIPLICATIONS or len(args) < 2:
        return False
    factor = args[1]
    if isinstance(factor, torch.Tensor):
        return factor.numel() == 1 and bool(factor == 1)
    return isinstance(factor, (int, float)) and factor == 1


def _two_norm(func, args: tuple, kwargs: dict) -> bool:
    """Whether ``func(*args, **kwargs)`` is the 2-norm of all of its first argument, as
    ``clip_grad_norm_`` takes it of each gradient."""
    if func is not torch.linalg.vector_norm or len(args) > 2 or set(kwargs) - {"ord"}:
        return False
    order = args[1] if len(args) == 2 else kwargs.get("ord", 2)
    return isinstance(order, (int, float)) and order == 2


class HeldGrad(torch.Tensor):
    """A streamed parameter's ``.grad`` as read between a backward and the optimizer step it
    leads to: the gradient itself (the same storage; ops on it return plain tensors), whose
    in-place writes are first reported to ``storm_on_write(times_one)`` (``times_one``: the
    write multiplies by exactly one), which raises, or returns whether to skip the write; its
    ``.data`` is guarded the same way; its 2-norm is ``storm_norm()`` where that gives one
    (computed on the device before the gradient came home), else computed here. A write
    through a view or ``detach()`` of it moves the gradient's version counter, which storm
    reads before the optimizer step."""

    storm_on_write: Callable[[bool], bool]
    storm_norm: Callable[[], torch.Tensor | None]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == _DATA_GET:
            with DisableTorchFunctionSubclass():
                data = func(*args, **kwargs)
            return held(data, args[0].storm_on_write, args[0].storm_norm)
        if _two_norm(func, args, kwargs) and isinstance(args[0], HeldGrad):
            norm = args[0].storm_norm()
            if norm is not None:
                return norm
        written = _written(func, args, kwargs)
        if written:
            times_one = _times_one(func, args)
            skip = [grad.storm_on_write(times_one) for grad in written]
            if all(skip):
                return None if func is foreach_mul_ else args[0]
        with DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def held(grad: torch.Tensor, on_write: Callable[[bool], bool],
         norm: Callable[[], torch.Tensor | None]) -> HeldGrad:
    """``grad`` as a :class:`HeldGrad` reporting its writes to ``on_write``, its 2-norm
    ``norm()`` where that is not None."""
    view = grad.as_subclass(HeldGrad)
    view.storm_on_write = on_write
    view.storm_norm = norm
    return view


def streamed_parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The streamed parameters (:class:`storm_compile.weights.streaming.HostParameter`)
    ``optimizer``
    steps."""
    return [p for group in optimizer.param_groups for p in group["params"]
            if getattr(p, "storm_streamed", False)]


def group_of(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict:
    """The parameter group of ``optimizer`` that holds ``param``. Raises ``ValueError`` when
    none does."""
    group = next((g for g in optimizer.param_groups if any(p is param for p in g["params"])),
                 None)
    if group is None:
        raise ValueError(f"storm: a streamed parameter of shape {tuple(param.shape)} is not in "
                         f"the optimizer that steps during the backward")
    return group


def step_alone(optimizer: torch.optim.Optimizer, group: dict) -> None:
    """Run ``optimizer``'s update over ``group`` (its settings and ``"params"``) alone, through
    a shallow copy of ``optimizer`` that holds only that group and shares its state: the
    host thread steps a parameter so while the user's code may read ``optimizer`` (its groups
    are never changed), and neither the global nor the optimizer's own step hooks run (they
    run once, in the user's ``optimizer.step()``)."""
    view = object.__new__(type(optimizer))
    view.__dict__.update(optimizer.__dict__)
    view.param_groups = [group]
    update = type(optimizer).step
    if getattr(update, "hooked", False):    # Optimizer.profile_hook_step, which runs the hooks
        update = update.__wrapped__
    update(view)


@dataclasses.dataclass(frozen=True)
class ParameterStep:
    """``optimizer``'s step of one parameter whose gradient is complete, with its group's
    settings (:func:`step_alone`); ``keep_grad``: the parameter keeps its ``.grad`` afterwards,
    hidden from ``optimizer.step()``, else its ``.grad`` is set to None so that the step skips
    it (done by whoever calls)."""

    optimizer: torch.optim.Optimizer
    keep_grad: bool = False

    def __call__(self, param: torch.Tensor) -> None:
        step_alone(self.optimizer, {**group_of(self.optimizer, param), "params": [param]})


class Cycles:
    """The :class:`Cycle` of every optimizer that steps streamed parameters, and the owner of
    each streamed parameter, learned at each step (weakly held: neither outlives the user's
    references)."""

    def __init__(self) -> None:
        self._cycles: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._owners = WeakIdKeyDictionary()

    def configure(self, optimizer: torch.optim.Optimizer, enabled: bool,
                  backwards_per_step: int | None) -> None:
        """Set ``optimizer``'s cycle (:func:`storm_compile.weights.streaming.overlap_optimizer`),
        forgetting what was learned of it."""
        self._cycles[optimizer] = Cycle(backwards_per_step=backwards_per_step, enabled=enabled)
        self._own(optimizer, streamed_parameters(optimizer))

    def _own(self, optimizer: torch.optim.Optimizer, streamed: list[torch.Tensor]) -> None:
        reference = weakref.ref(optimizer)
        for param in streamed:
            self._owners[param] = reference

    def observe(self, optimizer: torch.optim.Optimizer, streamed: list[torch.Tensor],
                backwards: int) -> Cycle | None:
        """``optimizer``, which steps ``streamed`` (its streamed parameters), is about to step
        after ``backwards`` backwards; its cycle, or None when it steps none. An optimizer storm
        cannot step one parameter at a time (not :data:`OVERLAPPABLE`) gets a cycle that never
        overlaps: its count alone serves (:meth:`Cycle.last_backward`)."""
        if not streamed:
            return None
        cycle = self._cycles.setdefault(optimizer,
                                        Cycle(enabled=isinstance(optimizer, OVERLAPPABLE)))
        self._own(optimizer, streamed)
        cycle.observe(backwards)
        return cycle

    def owner(self, param: torch.Tensor) -> tuple[torch.optim.Optimizer, Cycle] | None:
        """The optimizer last seen stepping ``param``, with its cycle."""
        reference = self._owners.get(param)
        optimizer = None if reference is None else reference()
        if optimizer is None or optimizer not in self._cycles:
            return None
        return optimizer, self._cycles[optimizer]
