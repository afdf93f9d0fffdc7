"""Golden printed graphs and schedule on a tiny function with the ``cpu-test`` profile.

Offload: ``relu`` (2 KiB) passes min_offload_bytes=1024 and, with ``offload="all"`` and
``recompute=False``, is offloaded even though its copies cannot hide (negative slack); ``tanh``'s
saved view (256 B) stays. The forward waits after ``sum_1``, the last compute node; the backward
prefetches right after its inputs and moves the saved view's replays after the wait.

Recompute: under ``memory_budget=0.5`` relu must leave; rebuilding it (``mm`` and ``relu``,
1 µs each) beats its 10 µs copy, so ``rematerialize`` saves the graph inputs instead and reruns
both ops in the backward right before their first use.

fp8: the offload case with ``offload_format="fp8"``: the forward packs relu (its power-of-two
scale's exponent in a byte, then relu over the scale in fp8: one uint8 tensor of 513 bytes) right
after relu and
offloads the packed tensor, whose wait now keeps it alive; the backward rebuilds relu in float32
from the prefetched bytes right after the wait, before the saved view's replays.

Streamed: the same function as a module whose two weights live in host memory
(``stream_parameters``, cpu-test profile, defaults otherwise): each graph prefetches every weight
it reads (prefetch, record, wait right before the first read); the backward sends each weight's
gradient home (send_grad after it is produced, wait_event keeping it alive, accumulate_grad
handing it to the host thread that adds it into the weight's ``.grad``), and one wait_host
before the output waits for those additions.

Kept and summed: the streamed module under a byte budget with room for everything
(``memory_budget="1GiB"``): both weights are read through ``resident_weight`` instead of
prefetched, and each gradient's ``send_grad`` is given its weight, so that a step's backwards but
its last sum it on the device.

The expected texts live in ``tests/goldens/<case>_<part>.txt``. After an intended change, rerun
with ``STORM_ACCEPT_GOLDENS=1`` to rewrite them from the actual output, then review their diff.
"""

import difflib
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from helpers import cost_model
from storm_compile.cli.report import annotate, format_table
from storm_compile.compiler.backend import StormBackend
from storm_compile.config import StormConfig
from storm_compile.fx.plan import Action, Decision, Eligibility, Rule
from storm_compile.weights.streaming import stream_parameters

BASE_OPTIONS = dict(inner="eager", transfer_cpu_tensors=True, min_offload_bytes=1024,
                    profile="cpu-test", host_memory_limit="1GiB")
GOLDEN_OPTIONS = dict(BASE_OPTIONS, offload="all", recompute=False)
RECOMPUTE_OPTIONS = dict(BASE_OPTIONS, memory_budget=0.5)
FP8_OPTIONS = dict(GOLDEN_OPTIONS, offload_format="fp8")
CASES = {"offload": GOLDEN_OPTIONS, "recompute": RECOMPUTE_OPTIONS, "fp8": FP8_OPTIONS}

GOLDEN_DIR = Path(__file__).parent / "goldens"
ACCEPT_ENV = "STORM_ACCEPT_GOLDENS"
ACCEPT_HINT = f"rerun with {ACCEPT_ENV}=1 to accept"


def assert_golden(name: str, actual: str) -> None:
    """Compare stripped ``actual`` with ``goldens/<name>.txt``; in accept mode rewrite the file."""
    path = GOLDEN_DIR / f"{name}.txt"
    actual = actual.strip()
    if os.environ.get(ACCEPT_ENV) == "1":
        path.write_text(actual + "\n", encoding="utf-8")
        return
    expected = path.read_text(encoding="utf-8").strip() if path.exists() else ""
    if actual != expected:
        diff = difflib.unified_diff(expected.splitlines(), actual.splitlines(),
                                    f"goldens/{name}.txt", "actual", lineterm="")
        raise AssertionError("\n".join([*diff, ACCEPT_HINT]))


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


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(8, 32))
        self.w2 = nn.Parameter(torch.randn(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tiny(x, self.w1, self.w2)


STREAMED_RESIDENT_BYTES = 256
"""Below both weights of the tiny function (1 KiB and 512 B): both are streamed."""


def test_golden_streamed_weights():
    graphs = _streamed_tiny(**BASE_OPTIONS)
    annotated = annotate(graphs, cost_model())
    annotated.pop("prediction")
    assert_golden("streamed_forward", graphs.forward.code)
    assert_golden("streamed_backward", graphs.backward.code)
    assert_golden("streamed_schedule", format_table(annotated))


def _streamed_tiny(**options):
    torch.manual_seed(0)
    model = _Tiny()
    stream_parameters(model, "cpu", resident_bytes=STREAMED_RESIDENT_BYTES)
    captured = []
    backend = StormBackend(StormConfig.from_options(**options), observer=captured.append)
    torch.compile(model, backend=backend)(torch.randn(16, 8)).sum().backward()
    (graphs,) = captured
    return graphs


def test_golden_streamed_weights_kept_and_summed():
    graphs = _streamed_tiny(**BASE_OPTIONS, memory_budget="1GiB")
    assert [w.summed for w in graphs.storages.resident] == [True, True]
    assert_golden("summed_forward", graphs.forward.code)
    assert_golden("summed_backward", graphs.backward.code)


@pytest.mark.parametrize("case", CASES)
def test_golden_graphs_and_schedule(case):
    graphs, table = capture_tiny(CASES[case])
    assert_golden(f"{case}_forward", graphs.forward.code)
    assert_golden(f"{case}_backward", graphs.backward.code)
    assert_golden(f"{case}_schedule", table)


def test_golden_mismatch_fails_with_accept_hint(monkeypatch):
    """Outside accept mode a wrong text fails with a diff and the hint to accept."""
    monkeypatch.delenv(ACCEPT_ENV, raising=False)
    with pytest.raises(AssertionError, match=ACCEPT_ENV) as failure:
        assert_golden("offload_forward", "not the forward graph")
    assert "+not the forward graph" in str(failure.value)


def _decisions(graphs) -> dict[str, Decision]:
    return {storage.name: decision for storage, decision in graphs.storages}


def test_offload_decision_fields():
    """relu crosses the link although its 10.2 µs copies cannot hide behind 1 µs nodes."""
    graphs, _ = capture_tiny(GOLDEN_OPTIONS)
    relu = _decisions(graphs)["relu"]
    assert relu.action is Action.OFFLOAD and relu.eligibility.movable
    assert relu.figures.recompute_s is None and relu.figures.no_recompute == "recompute=False"
    assert not relu.figures.hides
    assert relu.figures.offload_s == pytest.approx(1e-5 + 2048 / 1e10)
    assert relu.placement.offload_after.name == "relu"
    assert relu.placement.wait_after.name == "sum_1"
    assert relu.placement.prefetch_after is None
    assert relu.placement.d2h_slack_s < 0 and relu.placement.h2d_slack_s < 0
    kept = {name: d.eligibility for name, d in _decisions(graphs).items() if name != "relu"}
    assert kept["tanh"] == Eligibility(Rule.BELOW_MIN_BYTES, 1024)
    assert {e.rule for name, e in kept.items() if name != "tanh"} == {Rule.GRAPH_INPUT}


def test_recompute_decision_fields():
    """Rebuilding relu (mm and relu, 1 µs each) beats its 10.2 µs copy; the rebuilt pair saves
    neither, and the plan keeps the decision for the report."""
    graphs, _ = capture_tiny(RECOMPUTE_OPTIONS)
    assert "relu" not in _decisions(graphs)
    ((storage, relu),) = graphs.plan.recomputed
    assert storage.name == "relu" and storage.nbytes == 2048
    assert relu.action is Action.RECOMPUTE and relu.placement is None
    assert relu.figures.recompute_s == pytest.approx(2e-6)
    assert relu.figures.offload_s == pytest.approx(1e-5 + 2048 / 1e10)
    assert graphs.plan.recompute == ("relu", "mm")
