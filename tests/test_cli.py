"""``storm schedule``: the table, JSON, and one-line errors with exit status 2 on bad input."""

import json
import subprocess
import sys

import pytest
import torch

from storm_compile.cli import EXIT_USAGE, main

TINY_GPT = ["--d-model", "64", "--layers", "2", "--heads", "4", "--seq", "64", "--batch", "2",
            "--min-offload-bytes", "0", "--profile", "cpu-test", "--offload", "all"]
SUMMARY_KEYS = {"predicted_step_ms", "baseline_step_ms", "exposed_transfer_ms", "activation_bytes",
                "baseline_activation_bytes", "peak_bytes", "baseline_peak_bytes",
                "offloaded_bytes"}

FACTORY = """
import torch

def good():
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 4)), (torch.randn(8, 16),)

def wrong():
    return 42

def raises():
    raise RuntimeError("no weights here")
"""


@pytest.fixture
def factory_file(tmp_path):
    path = tmp_path / "models.py"
    path.write_text(FACTORY)
    return path


def test_schedule_gpt_table(capsys):
    assert main(["schedule", "gpt", *TINY_GPT]) == 0
    out = capsys.readouterr().out
    for column in ("graph", "node", "op", "stream", "compute_us", "transfer_bytes",
                   "transfer_us", "event", "memory_after", "decision", *SUMMARY_KEYS):
        assert column in out
    assert "offload.default" in out and "prefetch.default" in out
    assert "d2h" in out and "h2d" in out and "record ev0" in out and "wait ev0" in out


def test_schedule_json_and_trace(capsys, tmp_path):
    trace = tmp_path / "trace.json"
    assert main(["schedule", "gpt", *TINY_GPT, "--format", "json", "--trace", str(trace)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert SUMMARY_KEYS <= set(doc["summary"])
    assert doc["summary"]["offloaded_bytes"] > 0
    assert doc["summary"]["activation_bytes"] < doc["summary"]["baseline_activation_bytes"]
    streams = {row["stream"] for row in doc["nodes"]}
    assert {"compute", "d2h", "h2d"} <= streams
    events = json.loads(trace.read_text())["traceEvents"]
    lanes = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert lanes == {"compute", "d2h", "h2d"}
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["tid"] for e in spans} == {1, 2, 3}
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)


def test_default_profile_plans_hidden_copies_for_the_first_benchmark_config(capsys):
    args = ["--d-model", "2048", "--layers", "8", "--heads", "16", "--seq", "2048",
            "--batch", "4", "--dtype", "bfloat16", "--profile", "h100", "--format", "json"]
    assert main(["schedule", "gpt", *args]) == 0
    summary = json.loads(capsys.readouterr().out)["summary"]
    assert summary["offloaded_bytes"] > 0
    assert summary["exposed_transfer_ms"] == 0
    assert summary["peak_bytes"] <= summary["baseline_peak_bytes"]


def test_schedule_factory(factory_file, capsys):
    assert main(["schedule", f"{factory_file}:good", "--min-offload-bytes", "0",
                 "--profile", "cpu-test", "--offload", "all", "--no-recompute"]) == 0
    assert "offload.default" in capsys.readouterr().out


@pytest.mark.parametrize("spec, message", [
    ("missing.py:build", "no such file"),
    ("{factory}:nothere", "has no callable 'nothere'"),
    ("{factory}:wrong", "must return (torch.nn.Module, tuple of example inputs)"),
    ("{factory}:raises", "raised RuntimeError: no weights here"),
    ("resnet", "expected one of gpt or path/to/file.py:factory"),
])
def test_bad_model_is_one_line_exit_2(spec, message, factory_file, capsys):
    assert main(["schedule", spec.format(factory=factory_file)]) == EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("storm: error:")
    assert message in err


@pytest.mark.parametrize("profile, message", [
    ("tpu-v9", "unknown device profile 'tpu-v9'; built-in profiles: h100"),
    ("{missing}", "missing field 'matmul_flops'"),
    ("{negative}", "field 'h2d_bandwidth' must be a non-negative number"),
])
def test_bad_profile_is_one_line_exit_2(profile, message, tmp_path, capsys):
    missing = tmp_path / "missing.json"
    missing.write_text(json.dumps({"name": "x"}))
    negative = tmp_path / "negative.json"
    fields = {"name": "x", "matmul_flops": 1, "fp32_flops": 1, "memory_bandwidth": 1,
              "launch_s": 0, "h2d_bandwidth": -1, "d2h_bandwidth": 1, "duplex_bandwidth": 1,
              "copy_latency_s": 0}
    negative.write_text(json.dumps(fields))
    spec = profile.format(missing=missing, negative=negative)
    assert main(["schedule", "gpt", "--profile", spec]) == EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_calibrate_without_cuda_is_one_line_exit_2(capsys):
    assert main(["calibrate"]) == EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "needs a CUDA device" in err


def test_gpt_knobs_rejected_for_factories(factory_file, capsys):
    assert main(["schedule", f"{factory_file}:good", "--layers", "3"]) == EXIT_USAGE
    assert "gpt model only" in capsys.readouterr().err


def test_console_script_exit_code_and_no_traceback():
    result = subprocess.run([sys.executable, "-m", "storm_compile.cli", "schedule",
                             "nowhere.py:f"], capture_output=True, text=True)
    assert result.returncode == EXIT_USAGE
    assert "Traceback" not in result.stderr


TINY_SHAPE = [a for a in TINY_GPT if a not in ("--offload", "all")]


def test_schedule_memory_budget_shows_each_decision(capsys):
    assert main(["schedule", "gpt", *TINY_SHAPE, "--memory-budget", "0.3",
                 "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    summary = doc["summary"]
    assert summary["activation_bytes"] <= summary["budget_bytes"]
    assert summary["budget_bytes"] == int(0.3 * summary["baseline_activation_bytes"])
    assert summary["recomputed_bytes"] > 0 and summary["recomputed_storages"] > 0
    decisions = {row["decision"].split(":")[0] for row in doc["nodes"] if row["decision"]}
    assert "recompute" in decisions


def test_pareto_table_json_and_plot(capsys, tmp_path):
    plot = tmp_path / "frontier.svg"
    assert main(["pareto", "gpt", *TINY_SHAPE, "--budgets", "1.0,0.5", "--plot", str(plot),
                 "--format", "json"]) == 0
    points = json.loads(capsys.readouterr().out)
    assert [p["step_ratio"] for p in points][0] == 1.0
    assert points[1]["activation_bytes"] <= points[1]["budget_bytes"] < points[0]["budget_bytes"]
    assert all(p["frontier"] for p in points)
    assert plot.read_text().startswith("<svg") and plot.read_text().count("<circle") == 2
    assert main(["pareto", "gpt", *TINY_SHAPE, "--budgets", "0.5"]) == 0
    assert "recomputed_bytes" in capsys.readouterr().out


@pytest.mark.parametrize("budget, message", [
    ("12parsecs", "accepted forms: an int of bytes"),
    ("1KiB", "below the minimum feasible for this graph"),
])
def test_bad_budget_is_one_line_exit_2(budget, message, capsys):
    assert main(["schedule", "gpt", *TINY_SHAPE, "--memory-budget", budget]) == EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("storm: error:")
    assert message in err
