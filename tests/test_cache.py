"""storm's compiles come from torch's caches in a later process, and never stale ones.

The process tests run ``tests/cache_child.py`` twice on one fresh Inductor cache directory:
the second process must hit AOTAutograd's cache and Inductor's FX graph cache for default
options, a fraction budget and a streamed model under a byte budget, restore each graph's
share of the budget as the first process planned it, and compute the same loss and gradients;
a changed option must miss.
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.exc import BackendCompilerFailed

from storm_compile import storm
from storm_compile.cli.models import LLAMA_PRESETS, build_llama
from storm_compile.compiler import backend
from storm_compile.compiler.backend import (
    StormBackend,
    StormCacheError,
    _decompositions,
    _default_backend,
    storm_backend,
)
from storm_compile.config import CPU_PLANNING, StormConfig, StormOptionError
from storm_compile.planner import plan_cache
from storm_compile.planner.step_budget import GraphShare
from storm_compile.weights.streaming import stream_parameters
from helpers import CPU_TEST_OPTIONS, step
from zoo import ZOO

CHILD = Path(__file__).parent / "cache_child.py"
CACHED = ("default", "fraction", "streamed", "siamese")
STREAMED_BYTES = 4096
"""Streams the tiny Llama's matrices (8 KiB and up)."""
CHILD_TIMEOUT_S = 900
"""The cold process compiles four variants of the tiny Llama with the C++ backend: about a
minute and a half on two cores."""


def _run(variants: tuple[str, ...], cache: Path) -> dict[str, dict]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    done = subprocess.run([sys.executable, str(CHILD), *variants], env=env,
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
                          cwd=CHILD.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {row["variant"]: row for row in rows}


@pytest.fixture(scope="module")
def processes(tmp_path_factory) -> tuple[dict, dict]:
    cache = tmp_path_factory.mktemp("inductor-cache")
    return _run(CACHED, cache), _run((*CACHED, "changed"), cache)


@pytest.mark.parametrize("variant", CACHED)
def test_a_second_process_hits_both_caches(processes, variant):
    cold, warm = processes
    assert cold[variant].get("autograd_cache_hit", 0) == 0
    compiled = cold[variant].get("autograd_cache_miss", 0)
    assert compiled == (2 if variant == "siamese" else 1)    # siamese: a run compiled again
    assert warm[variant].get("autograd_cache_hit") == compiled
    assert warm[variant].get("autograd_cache_miss", 0) == 0
    assert warm[variant].get("autograd_cache_bypass", 0) == 0
    assert warm[variant].get("fxgraph_cache_bypass", 0) == 0


@pytest.mark.parametrize("variant", CACHED)
def test_a_hit_restores_the_plan_and_its_numbers(processes, variant):
    cold, warm = processes
    assert warm[variant]["shares"] == cold[variant]["shares"]
    assert warm[variant]["loss"] == cold[variant]["loss"]
    assert warm[variant]["grads"] == cold[variant]["grads"]


def test_a_changed_option_misses(processes):
    _, warm = processes
    assert warm["changed"].get("autograd_cache_hit", 0) == 0
    assert warm["changed"].get("autograd_cache_miss") == 1


def _key(backend, ledger: str = "") -> str:
    backend.partitioner.ledger = ledger
    return backend.partitioner.key()


def test_the_key_covers_options_profile_ledger_and_version(monkeypatch):
    base = _key(storm(**CPU_TEST_OPTIONS))
    assert base == _key(storm(**CPU_TEST_OPTIONS))
    assert base != _key(storm(**{**CPU_TEST_OPTIONS, "min_offload_bytes": 1}))
    assert base != _key(storm(**{**CPU_TEST_OPTIONS, "profile": "h100"}))
    assert base != _key(storm(**CPU_TEST_OPTIONS), ledger="[((0, 0, 0), share)]")
    monkeypatch.setattr("storm_compile.__version__", "0.0.0-other")
    assert base != _key(storm(**CPU_TEST_OPTIONS))


def test_no_key_with_an_observer():
    backend = storm(**CPU_TEST_OPTIONS)
    backend.partitioner.observer = print
    assert backend.partitioner.uuid() is None


def test_the_decomposition_table_pickles_stably():
    table = _decompositions()
    assert torch.ops.aten.embedding_dense_backward.default not in table
    assert pickle.dumps(table) == pickle.dumps(_decompositions())
    assert pickle.loads(pickle.dumps(table)) == table


def test_a_plan_record_round_trips(tmp_path, monkeypatch):
    monkeypatch.setattr(plan_cache, "record_dir", lambda: tmp_path)
    record = plan_cache.PlanRecord(GraphShare(10, 1, 5, 0.5, 0.01, 2), ("storm: a warning",))
    plan_cache.store("k", record)
    assert plan_cache.load("k") == record
    assert plan_cache.load("missing") is None
    (tmp_path / "torn.json").write_text("{")
    assert plan_cache.load("torn") is None


def test_a_hit_without_its_record_is_a_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setattr(plan_cache, "record_dir", lambda: tmp_path)
    with pytest.raises(StormCacheError, match="plan record .* is missing"):
        storm(**CPU_TEST_OPTIONS)._replay("absent")


def test_a_replayed_record_restores_share_and_warnings(tmp_path, monkeypatch):
    monkeypatch.setattr(plan_cache, "record_dir", lambda: tmp_path)
    share = GraphShare(10, 1, 5, 0.5, 0.01)
    plan_cache.store("k", plan_cache.PlanRecord(share, ("storm: planned over budget",)))
    backend = storm(**{**CPU_TEST_OPTIONS, "offload": "hidden", "memory_budget": 0.5})
    with pytest.warns(RuntimeWarning, match="storm: planned over budget"):
        backend._replay("k")
    assert backend.step.share(backend.step.last) == share


CONVENTION_OPTIONS = {**CPU_TEST_OPTIONS, "offload": "hidden", "memory_budget": 0.5}


def test_options_work_as_storm_options():
    eager_loss, eager_grads, _ = step("mlp", None)
    storm_loss, storm_grads, _ = step("mlp", functools.partial(storm_backend,
                                                                options=CONVENTION_OPTIONS))
    variant = _default_backend().variant(None, dict(CONVENTION_OPTIONS))
    assert variant.config == storm(**CONVENTION_OPTIONS).config
    assert variant.step.last is not None
    torch.testing.assert_close(storm_loss, eager_loss)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(storm_grads[name], grad)


def test_options_are_validated_like_storm_options():
    model, inputs, _ = ZOO["mlp"]()
    with pytest.raises(BackendCompilerFailed) as caught:
        torch.compile(model, backend="storm", options={"memory_budget": 2.5})(*inputs)
    assert isinstance(caught.value.inner_exception, StormOptionError)
    assert "memory_budget" in str(caught.value.inner_exception)


def test_mode_is_inductors_and_checked():
    assert storm().variant("max-autotune-no-cudagraphs", None).config.mode == \
        "max-autotune-no-cudagraphs"
    with pytest.raises(StormOptionError, match="mode"):
        storm(mode="fastest")
    with pytest.raises(StormOptionError, match="conflict"):
        storm(inner="eager", mode="max-autotune")


def test_cuda_graphs_refuse_storms_copies():
    model, inputs, loss_fn = ZOO["mlp"]()
    options = {**CPU_PLANNING, "min_offload_bytes": 0, "profile": "cpu-test", "offload": "all",
               "recompute": False}
    with pytest.raises(BackendCompilerFailed) as caught:
        loss_fn(torch.compile(model, backend=storm(**options), mode="reduce-overhead")(*inputs)) \
            .backward()
    assert isinstance(caught.value.inner_exception, StormOptionError)
    assert "CUDA graphs" in str(caught.value.inner_exception)


def _dynamo_graph(model, batch):
    graphs = []
    torch.compile(model, backend=lambda gm, inputs: graphs.append(gm) or gm)(*batch)
    return graphs[0]


def test_inductors_decompositions_unless_storm_bounds_memory():
    """Without a budget or streamed weights the graph's kernels are torch.compile's; with
    either, the embedding's backward is aten's kernel (KEPT_WHOLE)."""
    plain = _dynamo_graph(*build_llama(LLAMA_PRESETS["tiny"]))
    model, batch = build_llama(LLAMA_PRESETS["tiny"])
    stream_parameters(model, "cpu", resident_bytes=STREAMED_BYTES)
    streamed = _dynamo_graph(model, batch)
    assert not storm(**CPU_PLANNING)._bounds_memory(plain)
    assert storm(**CPU_PLANNING, memory_budget=0.5)._bounds_memory(plain)
    assert storm(**CPU_PLANNING)._bounds_memory(streamed)


@pytest.mark.parametrize("options", [{}, {"memory_budget": 0.5}])
def test_inductors_buffer_pool_is_off_where_storm_bounds_memory(monkeypatch, options):
    """Inductor's pool of freed buffers holds them past their last use, which a budget's plan
    does not count (``BOUNDED_INDUCTOR_CONFIG``); without a budget Inductor's config stays."""
    patches = []
    monkeypatch.setattr(backend, "compile_fx",
                        lambda gm, inputs, **kwargs: patches.append(kwargs["config_patches"]) or gm)
    model, batch = build_llama(LLAMA_PRESETS["tiny"])
    config = StormConfig.from_options(**CPU_PLANNING, **options)
    torch.compile(model, backend=StormBackend(config, observer=lambda graphs: None))(*batch)
    assert len(patches) == 1
    assert patches[0].get("allow_buffer_reuse", True) is not bool(options)
