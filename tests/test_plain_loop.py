"""The loop people write over streamed parameters: ``backward()`` per micro-batch, then
``optimizer.step()`` and ``zero_grad()``. It trains as the unstreamed model does, takes the fast
path by itself once storm has learned it (:mod:`storm_compile.runtime.cycles`), and every other
route to a streamed parameter (``.data``, ``copy_``, ``load_state_dict``, hooks, ``autograd.grad``,
``backward(inputs=...)``) is either right or a one-line error."""

import copy
import dataclasses
import warnings

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from helpers import CPU_TEST_OPTIONS, streamed, unstreamed_name
from storm_compile import StormOverlapError, overlap_optimizer, storm
from storm_compile.cost.cost_model import CostModel
from storm_compile.cost.profiles import DeviceProfile
from storm_compile.runtime.cycles import STABLE_CYCLES
from storm_compile.runtime.streams import get_runtime
from storm_compile.weights import streaming
from storm_compile.weights.streaming import StormWriteError
from storm_compile.cli.models import build_llama
from test_streaming import MICRO_BATCHES, RESIDENT_BYTES, SHAPE, _budget_with_room, _pair

STEPS = STABLE_CYCLES + 2
"""Steps that learn the loop, then steps that take the fast path."""
LR = 1e-2


def _loop(net, batch, backend, *, clip: float | None = None, configure=None,
          after_backward=None, micro_batches: int = MICRO_BATCHES
          ) -> tuple[list[float], list[torch.Tensor], list[bool]]:
    """STEPS steps of ``micro_batches`` micro-batches in the plain loop with fused AdamW
    (gradients clipped to ``clip``); each step's last loss, the final weights, and for each step
    whether storm stepped streamed parameters during its last backward. ``configure(optimizer)``
    runs first; ``after_backward(step)`` after each step's last backward."""
    get_runtime().backwards = 0
    optimizer = torch.optim.AdamW(net.parameters(), lr=LR, fused=True)
    if configure is not None:
        configure(optimizer)
    run = torch.compile(net, backend=backend)
    losses, overlapped = [], []
    for step in range(STEPS):
        for _ in range(micro_batches):
            loss = run(*batch) / micro_batches
            loss.backward()
        owner = [get_runtime().cycles.owner(p) for p in streamed(net)]
        overlapped.append(any(o is not None and o[1].stepped for o in owner))
        if after_backward is not None:
            after_backward(step)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in net.parameters()], overlapped


REPEAT_SHAPE = dataclasses.replace(SHAPE, d_model=512, hidden=1408, heads=8, kv_heads=4,
                                   seq=512, batch=4, dtype="bfloat16")
"""Matrices of 0.25-1.4 MiB: copies and host steps long enough to overlap one another."""


def _twice_on(device: str, backend) -> list[tuple[list[float], list[torch.Tensor], list[bool]]]:
    """Two runs of the plain loop, one micro-batch a step, each from the same weights of the
    REPEAT_SHAPE model streamed to ``device`` and on the same batch."""
    torch.manual_seed(0)
    reference, batch = build_llama(REPEAT_SHAPE)
    batch = tuple(t.to(device) for t in batch)
    runs = []
    for _ in range(2):
        torch._dynamo.reset()
        model = copy.deepcopy(reference)
        streaming.stream_parameters(model, device, resident_bytes=RESIDENT_BYTES)
        runs.append(_loop(model, batch, backend, micro_batches=1))
    return runs


@pytest.mark.gpu
def test_streamed_training_on_the_gpu_is_bitwise_the_same_twice():
    """Two runs of the plain loop on the GPU from the same weights and batch give the same
    losses and weights to the last bit, the later steps on the fast path: a host step that ran
    while a copy still read its weight, or a gradient read before its copy home landed, would
    make them differ. Attention runs through its math kernels, whose backward adds in one
    order (a fused kernel's may not)."""
    with sdpa_kernel(SDPBackend.MATH):
        (losses, params, overlapped), (again, params_again, _) = _twice_on(
            "cuda", storm(min_offload_bytes=0))
    assert overlapped[-1], "the last step did not step its parameters during the backward"
    assert losses == again
    for param, other in zip(params, params_again):
        assert torch.equal(param, other)


def _reference(clip: float | None = None):
    reference, model, batch = _pair()
    expected = _loop(reference, batch, storm(**CPU_TEST_OPTIONS), clip=clip)
    return model, batch, expected


def _assert_trains_like(result, expected) -> None:
    losses, params, _ = result
    assert losses == pytest.approx(expected[0])
    for param, want in zip(params, expected[1]):
        torch.testing.assert_close(param, want)


def test_plain_loop_trains_like_the_unstreamed_model_and_takes_the_fast_path_once_learned():
    model, batch, expected = _reference()
    result = _loop(model, batch, storm(**CPU_TEST_OPTIONS))
    _assert_trains_like(result, expected)
    assert result[2] == [False] * STABLE_CYCLES + [True] * (STEPS - STABLE_CYCLES)


def test_the_fast_path_runs_the_optimizers_step_hooks_once_per_step_and_keeps_its_groups():
    """A parameter stepped on the host thread during the backward steps through a copy of the
    optimizer: the optimizer's own step hooks run once per ``optimizer.step()``, as unstreamed,
    and its groups, read during the backward, are the user's."""
    model, batch, expected = _reference()
    calls, groups_seen = [], []

    def configure(optimizer):
        optimizer.register_step_pre_hook(lambda *args: calls.append("pre"))
        optimizer.register_step_post_hook(lambda *args: calls.append("post"))
        groups = [len(g["params"]) for g in optimizer.param_groups]
        for param in model.parameters():
            param.register_post_accumulate_grad_hook(lambda _: groups_seen.append(
                [len(g["params"]) for g in optimizer.param_groups] == groups))

    result = _loop(model, batch, storm(**CPU_TEST_OPTIONS), configure=configure)
    _assert_trains_like(result, expected)
    assert result[2][-1], "the fast path ran"
    assert calls == ["pre", "post"] * STEPS
    assert groups_seen and all(groups_seen)


def _folding(model, profile: str) -> int:
    """How many gradients of streamed parameters a backward of ``model`` sends home with their
    weights, to fold, under ``profile``."""
    cost = CostModel(DeviceProfile.from_json(profile))
    return sum(cost.folds_faster(p.numel() * p.element_size()) for p in streamed(model))


@pytest.mark.usefixtures("small_fold_chunks")
def test_a_steps_last_backward_folds_its_gradients_into_their_host_sums_and_trains_right(
        slow_host_profile):
    """Once storm knows a step's last backward, each streamed gradient it brings is added into
    its ``.grad`` (the step's earlier gradients) where it was made, chunk by chunk, and the host
    thread adds nothing, where the host adds slower than the link; the training is the
    unstreamed model's."""
    model, batch, expected = _reference()
    runtime = get_runtime()
    folds = runtime.folds
    result = _loop(model, batch, storm(**{**CPU_TEST_OPTIONS, "profile": slow_host_profile}))
    _assert_trains_like(result, expected)
    assert runtime.folds - folds == _folding(model, slow_host_profile) * (STEPS - STABLE_CYCLES)


@pytest.mark.usefixtures("small_fold_chunks")
def test_a_folded_gradients_norm_is_taken_where_it_was_summed(slow_host_profile):
    """After a norm was read once, the fold takes the 2-norm of each sum it makes, and
    ``clip_grad_norm_``'s reads after the last backward are answered with it."""
    reference, model, batch = _pair()
    want, got = [], []
    expected = _loop(reference, batch, storm(**CPU_TEST_OPTIONS),
                     after_backward=_norms(reference, want))
    served = get_runtime().norms_served
    result = _loop(model, batch, storm(**{**CPU_TEST_OPTIONS, "profile": slow_host_profile}),
                   after_backward=_norms(model, got))
    _assert_trains_like(result, expected)
    assert got == pytest.approx(want)
    assert get_runtime().norms_served - served == \
        _folding(model, slow_host_profile) * (STEPS - STABLE_CYCLES)


def test_a_stated_count_takes_the_fast_path_from_the_first_step():
    model, batch, expected = _reference()
    result = _loop(model, batch, storm(**CPU_TEST_OPTIONS),
                   configure=lambda o: overlap_optimizer(o, backwards_per_step=MICRO_BATCHES))
    _assert_trains_like(result, expected)
    assert all(result[2])


def test_overlap_turned_off_steps_in_optimizer_step():
    model, batch, expected = _reference()
    result = _loop(model, batch, storm(**CPU_TEST_OPTIONS),
                   configure=lambda o: overlap_optimizer(o, enabled=False))
    _assert_trains_like(result, expected)
    assert not any(result[2])


def test_clipping_keeps_the_slow_path_with_one_warning_and_trains_right():
    model, batch, expected = _reference(clip=1e-3)
    with pytest.warns(RuntimeWarning, match="written between the last backward") as caught:
        result = _loop(model, batch, storm(**CPU_TEST_OPTIONS), clip=1e-3)
    assert len([w for w in caught if "written between" in str(w.message)]) == 1
    _assert_trains_like(result, expected)
    assert not any(result[2])


def _norms(net, into: list):
    """An ``after_backward`` that logs the norm of every gradient of ``net``."""
    return lambda step: into.append(torch.nn.utils.get_total_norm(
        [p.grad for p in net.parameters() if p.grad is not None]).item())


def test_reading_the_gradients_after_the_last_backward_keeps_the_fast_path_and_reads_them_whole():
    """A norm for the logs, read after the backward that already stepped the streamed
    parameters: it reads their whole gradients, and optimizer.step() does not step them again."""
    reference, model, batch = _pair()
    want, got = [], []
    expected = _loop(reference, batch, storm(**CPU_TEST_OPTIONS),
                     after_backward=_norms(reference, want))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = _loop(model, batch, storm(**CPU_TEST_OPTIONS), after_backward=_norms(model, got))
    _assert_trains_like(result, expected)
    assert got == pytest.approx(want)
    assert result[2] == [False] * STABLE_CYCLES + [True] * (STEPS - STABLE_CYCLES)


def test_a_gradient_copied_home_alone_has_its_norm_taken_where_it_was_made():
    """One backward per step: each streamed ``.grad`` is one gradient copied home, and from the
    step after a norm was first read, storm takes each one's 2-norm where it is made, before
    the copy, and answers ``clip_grad_norm_``'s reads with it."""
    reference, model, batch = _pair()
    want, got = [], []
    expected = _loop(reference, batch, storm(**CPU_TEST_OPTIONS), micro_batches=1,
                     after_backward=_norms(reference, want))
    served = get_runtime().norms_served
    result = _loop(model, batch, storm(**CPU_TEST_OPTIONS), micro_batches=1,
                   after_backward=_norms(model, got))
    _assert_trains_like(result, expected)
    assert got == pytest.approx(want)
    assert get_runtime().norms_served - served >= len(streamed(model)) * (STEPS - 1)
    assert result[2] == [False] * STABLE_CYCLES + [True] * (STEPS - STABLE_CYCLES)


def test_clipping_a_gradient_the_backward_already_stepped_is_an_error():
    _, model, batch = _pair()
    with pytest.raises(StormOverlapError, match="written.*overlap_optimizer.*enabled=False"):
        _loop(model, batch, storm(**CPU_TEST_OPTIONS), clip=1e-3,
              configure=lambda o: overlap_optimizer(o, backwards_per_step=MICRO_BATCHES))


def _halve_through(route: str):
    """An ``after_backward`` that halves every gradient through ``route``: ``.data``,
    ``detach()`` or a view, which a write into ``.grad`` itself does not cover."""
    def halve(grad):
        if route == "data":
            grad.data.mul_(0.5)
        elif route == "detach":
            grad.detach().mul_(0.5)
        else:
            grad.view(-1).mul_(0.5)
    return lambda net: (lambda step: [halve(p.grad) for p in net.parameters()
                                      if p.grad is not None])


@pytest.mark.parametrize("route", ["data", "detach", "view"])
def test_a_write_through_an_alias_of_a_stepped_gradient_is_an_error(route):
    _, model, batch = _pair()
    with pytest.raises(StormOverlapError, match="written.*enabled=False"):
        _loop(model, batch, storm(**CPU_TEST_OPTIONS), after_backward=_halve_through(route)(model),
              configure=lambda o: overlap_optimizer(o, backwards_per_step=MICRO_BATCHES))


@pytest.mark.parametrize("route", ["data", "detach", "view"])
def test_a_write_through_an_alias_while_storm_learns_keeps_the_slow_path(route):
    reference, model, batch = _pair()
    expected = _loop(reference, batch, storm(**CPU_TEST_OPTIONS),
                     after_backward=_halve_through(route)(reference))
    with pytest.warns(RuntimeWarning, match="written between the last backward"):
        result = _loop(model, batch, storm(**CPU_TEST_OPTIONS),
                       after_backward=_halve_through(route)(model))
    _assert_trains_like(result, expected)
    assert not any(result[2])


def test_a_gradient_read_through_data_reads_the_stepped_gradient():
    reference, model, batch = _pair()
    want, got = [], []

    def norms(net, into):
        return lambda step: into.append(sum(float(p.grad.data.float().square().sum())
                                            for p in net.parameters() if p.grad is not None))

    expected = _loop(reference, batch, storm(**CPU_TEST_OPTIONS),
                     after_backward=norms(reference, want))
    result = _loop(model, batch, storm(**CPU_TEST_OPTIONS), after_backward=norms(model, got),
                   configure=lambda o: overlap_optimizer(o, backwards_per_step=MICRO_BATCHES))
    _assert_trains_like(result, expected)
    assert got == pytest.approx(want)
    assert all(result[2])


def test_an_infinite_clip_keeps_a_stated_fast_path_and_trains_right():
    """The Hugging Face Trainer's grad-norm log, ``clip_grad_norm_(..., inf)``, multiplies
    every gradient by one: with the count stated, storm skips it."""
    model, batch, expected = _reference(clip=float("inf"))
    result = _loop(model, batch, storm(**CPU_TEST_OPTIONS), clip=float("inf"),
                   configure=lambda o: overlap_optimizer(o, backwards_per_step=MICRO_BATCHES))
    _assert_trains_like(result, expected)
    assert all(result[2])


def test_an_infinite_clip_while_storm_learns_keeps_the_slow_path():
    """Multiplied by one, the gradients might be clipped by a finite bound later: while it
    learns, storm counts the multiplication as a write."""
    model, batch, expected = _reference(clip=float("inf"))
    with pytest.warns(RuntimeWarning, match="written between the last backward"):
        result = _loop(model, batch, storm(**CPU_TEST_OPTIONS), clip=float("inf"))
    _assert_trains_like(result, expected)
    assert not any(result[2])


def test_more_backwards_than_learned_is_an_error():
    _, model, batch = _pair()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    overlap_optimizer(optimizer, backwards_per_step=1)
    run = torch.compile(model, backend=storm(**CPU_TEST_OPTIONS))
    run(*batch).backward()
    with pytest.raises(StormOverlapError, match="backwards_per_step"):
        run(*batch).backward()


def test_the_explicit_overlapped_optimizer_serves_any_number_of_backwards_per_step():
    """Storm learns nothing of an optimizer wrapped in OverlappedOptimizer: steps of two, then
    of three backwards train as the unstreamed model does."""
    reference, model, batch = _pair()
    params = {}
    for net in (reference, model):
        optimizer = torch.optim.AdamW(net.parameters(), lr=LR, fused=True)
        overlapped = streaming.OverlappedOptimizer(optimizer)
        run = torch.compile(net, backend=storm(**CPU_TEST_OPTIONS))
        for backwards in [2] * STEPS + [3]:
            for index in range(backwards):
                loss = run(*batch) / backwards
                if index < backwards - 1 or net is reference:
                    loss.backward()
                    continue
                with overlapped.final_backward():
                    loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        params[id(net)] = [p.detach() for p in net.parameters()]
    for param, want in zip(params[id(model)], params[id(reference)]):
        torch.testing.assert_close(param, want)


def test_a_step_given_a_closure_is_never_stepped_during_its_backwards():
    """Lightning's loop: the last micro-batch's backward runs inside ``optimizer.step(closure)``,
    after the step's pre-hook, so storm cannot count the step's backwards and leaves the
    steps to ``optimizer.step``."""
    reference, model, batch = _pair()
    params = {}
    for net in (reference, model):
        get_runtime().backwards = 0
        optimizer = torch.optim.AdamW(net.parameters(), lr=LR, fused=True)
        run = torch.compile(net, backend=storm(**CPU_TEST_OPTIONS))

        def closure(run=run):
            loss = run(*batch) / MICRO_BATCHES
            loss.backward()
            return loss

        for _ in range(STEPS):
            for _ in range(MICRO_BATCHES - 1):
                (run(*batch) / MICRO_BATCHES).backward()
            optimizer.step(closure)
            optimizer.zero_grad()
        params[id(net)] = [p.detach() for p in net.parameters()]
    for param, want in zip(params[id(model)], params[id(reference)]):
        torch.testing.assert_close(param, want)


@pytest.mark.parametrize("args", [{"backwards_per_step": 0}, {"backwards_per_step": True}])
def test_overlap_optimizer_rejects_a_bad_count(args):
    optimizer = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=1.0)
    with pytest.raises(ValueError, match="backwards_per_step must be an int >= 1"):
        overlap_optimizer(optimizer, **args)


def test_overlap_optimizer_refuses_an_optimizer_that_needs_every_gradient():
    optimizer = torch.optim.LBFGS([torch.zeros(2, requires_grad=True)])
    with pytest.raises(ValueError, match="LBFGS may not step one parameter at a time"):
        overlap_optimizer(optimizer)
    assert overlap_optimizer(optimizer, enabled=False) is optimizer


def _write_through_state_dict(net, updates: dict[int, torch.Tensor]) -> None:
    """Subtract each ``updates[id(param)]`` from its parameter through ``load_state_dict``."""
    state = net.state_dict()
    keys: dict[int, list[str]] = {}
    for key, value in state.items():
        keys.setdefault(value.data_ptr(), []).append(key)
    new = {key: value.clone() for key, value in state.items()}
    for param in net.parameters():
        for key in keys[param.data_ptr()]:
            new[key] -= updates[id(param)]
    net.load_state_dict(new)


WRITES = {
    "data": lambda net, updates: [p.data.sub_(updates[id(p)]) for p in net.parameters()],
    "data-assigned": lambda net, updates: [setattr(p, "data", p.data - updates[id(p)])
                                           for p in net.parameters()],
    "copy_": lambda net, updates: [p.copy_(p - updates[id(p)]) for p in net.parameters()],
    "load_state_dict": _write_through_state_dict,
}
"""Ways to change host weights outside an optimizer, each under ``torch.no_grad()``."""


@pytest.mark.parametrize("route", WRITES)
def test_host_weight_changes_reach_the_device_copy_before_its_next_read(route):
    """Manual SGD on a streamed model whose weights are all kept on the device under a byte
    budget: every route that changes a host weight reaches the device copy, so the losses are
    the unstreamed model's."""
    reference, model, batch = _pair()
    budget = f"{_budget_with_room(1 << 30)}B"
    backends = {id(reference): storm(**CPU_TEST_OPTIONS),
                id(model): storm(**{**CPU_TEST_OPTIONS, "offload": "hidden",
                                    "memory_budget": budget})}
    losses = {}
    for net in (reference, model):
        run = torch.compile(net, backend=backends[id(net)])
        seen = []
        for _ in range(3):
            loss = run(*batch)
            loss.backward()
            seen.append(loss.item())
            with torch.no_grad():
                WRITES[route](net, {id(p): LR * p.grad for p in net.parameters()})
            net.zero_grad()
        losses[id(net)] = seen
    assert losses[id(model)] == pytest.approx(losses[id(reference)])


@pytest.mark.parametrize("route", ["none", *WRITES])
def test_a_frozen_weight_kept_on_the_device_is_copied_once_unless_written(route, monkeypatch):
    """A frozen base kept on the device under a byte budget beside trained norms (LoRA's
    shape): once compiled (the first call's compile reads the streamed weights' ``.data``,
    so the first two steps copy them again), the norms' AdamW steps copy no base weight again,
    a write to the base after the third step (through ``route``) reaches the device copies
    before the next read, and the losses are the unstreamed model's."""
    torch.manual_seed(0)
    reference, batch = build_llama(SHAPE)
    for param in reference.parameters():
        param.requires_grad_(param.numel() * param.element_size() < RESIDENT_BYTES)
    model = copy.deepcopy(reference)
    streaming.stream_parameters(model, "cpu", resident_bytes=RESIDENT_BYTES)
    budget = f"{_budget_with_room(1 << 30)}B"
    runtime = get_runtime()
    copies = []
    copy_from_host = runtime.copy_from_host
    monkeypatch.setattr(runtime, "copy_from_host",
                        lambda dst, host: (copies.append(host), copy_from_host(dst, host)))
    losses, copied = {}, []
    for net, backend in ((reference, storm(**CPU_TEST_OPTIONS)),
                         (model, storm(**{**CPU_TEST_OPTIONS, "offload": "hidden",
                                          "memory_budget": budget}))):
        optimizer = torch.optim.AdamW(net.parameters(), lr=LR, fused=True)   # frozen too
        run = torch.compile(net, backend=backend)
        losses[net] = []
        for step in range(5):
            copies.clear()
            loss = run(*batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[net].append(loss.item())
            if net is model:
                copied.append(len(copies))
            if step == 2 and route != "none":
                with torch.no_grad():
                    WRITES[route](net, {id(p): torch.full_like(p, LR) for p in net.parameters()})
    frozen = sum(not p.requires_grad for p in model.parameters())
    written = frozen if route != "none" else 0
    assert copied[2:] == [0, written, 0], "a frozen weight copied after a write, not after " \
                                          "the norms' steps"
    assert losses[model] == pytest.approx(losses[reference])


def test_autograd_grad_over_a_streamed_parameter_is_an_error_and_leaves_grad_alone():
    _, model, batch = _pair()
    weight = streamed(model)[0]
    run = torch.compile(model, backend=storm(**CPU_TEST_OPTIONS))
    with pytest.raises(Exception, match="autograd.grad cannot return the gradient"):
        torch.autograd.grad(run(*batch), [weight])
    assert all(p.grad is None for p in streamed(model))


@pytest.mark.parametrize("backend", ["eager", "storm"])
def test_backward_with_inputs_fills_only_those_inputs(backend):
    reference, model, batch = _pair()
    backends = {"eager": None, "storm": storm(**CPU_TEST_OPTIONS)}
    chosen = streamed(model)[:1]
    others = streamed(model)[1:]
    run = model if backends[backend] is None else torch.compile(model, backend=backends[backend])
    run(*batch).backward(inputs=chosen)
    reference(*batch).backward()
    assert all(p.grad is None for p in others)
    names = {id(p): unstreamed_name(n) for n, p in model.named_parameters()}
    expected = dict(reference.named_parameters())
    for param in chosen:
        torch.testing.assert_close(param.grad, expected[names[id(param)]].grad)


def test_autograd_grad_over_other_tensors_leaves_streamed_grads_alone():
    _, model, batch = _pair()
    resident = [p for n, p in model.named_parameters() if "norm" in n]
    run = torch.compile(model, backend=storm(**CPU_TEST_OPTIONS))
    (grad,) = torch.autograd.grad(run(*batch), resident[:1])
    assert grad is not None
    assert all(p.grad is None for p in streamed(model))


def test_a_tensor_hook_on_a_streamed_parameter_is_an_error():
    _, model, batch = _pair()
    streamed(model)[0].register_hook(lambda grad: grad)
    run = torch.compile(model, backend=storm(**CPU_TEST_OPTIONS))
    with pytest.raises(Exception, match="register_post_accumulate_grad_hook"):
        run(*batch).backward()


def test_a_post_accumulate_grad_hook_sees_the_whole_gradient():
    reference, model, batch = _pair()
    reference(*batch).backward()
    expected = {n: p.grad for n, p in reference.named_parameters()}
    seen = {}
    for name, param in model.named_parameters():
        if getattr(param, "storm_streamed", False):
            param.register_post_accumulate_grad_hook(
                lambda p, name=unstreamed_name(name): seen.__setitem__(name, p.grad.clone()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.compile(model, backend=storm(**CPU_TEST_OPTIONS))(*batch).backward()
    assert len(seen) == len(streamed(model))
    for name, grad in seen.items():
        torch.testing.assert_close(grad, expected[name])


WEIGHT_WRITES = {
    "data": lambda w: w.data,
    "data-assigned": lambda w: setattr(w, "data", torch.zeros_like(w)),
    "in-place": lambda w: w.add_(1.0),
    "nn.init": torch.nn.init.normal_,
    "requires_grad_": lambda w: w.requires_grad_(False),
}
"""Writes into ``module.weight`` of a streamed parameter (a device copy), each a lost write."""


@pytest.mark.parametrize("write", WEIGHT_WRITES)
def test_a_write_into_a_streamed_modules_weight_is_an_error(write):
    _, model, _ = _pair()
    layer = next(m for m in model.modules() if isinstance(m, torch.nn.Linear)
                 and getattr(m.parametrizations.weight.original, "storm_streamed", False))
    before = layer.parametrizations.weight.original.detach().clone()
    with torch.no_grad(), pytest.raises(StormWriteError, match="parametrizations.weight.original"):
        WEIGHT_WRITES[write](layer.weight)
    torch.testing.assert_close(layer.parametrizations.weight.original.detach(), before)
    assert type(layer.weight.sum()) is torch.Tensor, "ops read the copy as a plain tensor"
