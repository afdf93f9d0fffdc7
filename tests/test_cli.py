"""``storm schedule`` and ``storm pareto``: the storage view, the node table, JSON, models of any
output structure, and one-line errors with exit status 2 on bad input."""

import collections
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

import storm_compile
from benchmarks.activation_memory import CONFIGS, QUICK_CONFIG
from storm_compile.cli import commands
from storm_compile.cli import EXIT_BROKEN_PIPE, EXIT_USAGE, main
from storm_compile.cli.models import LLAMA_PRESETS, GPTShape, ModelSpecError, build_llama
from storm_compile.compiler.backend import StormBackend
from storm_compile.config import CPU_PLANNING, GIB, StormConfig, StormOptionError
from storm_compile.runtime import ops
from storm_compile.weights.streaming import stream_parameters

TINY_GPT = ["--d-model", "64", "--layers", "2", "--heads", "4", "--seq", "64", "--batch", "2",
            "--min-offload-bytes", "0", "--profile", "cpu-test", "--offload", "all"]
TINY_SHAPE = [a for a in TINY_GPT if a not in ("--offload", "all")]
SUMMARY_KEYS = {"predicted_step_ms", "baseline_step_ms", "exposed_transfer_ms", "activation_bytes",
                "baseline_activation_bytes", "peak_bytes", "baseline_peak_bytes",
                "offloaded_bytes"}

FACTORY = """
import collections
import dataclasses
from typing import NamedTuple, Optional

import torch
from torch import nn


def good():
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 4)), (torch.randn(8, 16),)

def wrong():
    return 42

def raises():
    raise RuntimeError("no weights here")


@dataclasses.dataclass
class Plain:
    logits: torch.Tensor
    extra: tuple


@dataclasses.dataclass
class ModelOutput(collections.OrderedDict):
    \"\"\"Like Hugging Face's: a dataclass that is an OrderedDict of its fields that are set.\"\"\"
    loss: Optional[torch.Tensor] = None
    logits: Optional[torch.Tensor] = None

    def __post_init__(self):
        for field in dataclasses.fields(self):
            if getattr(self, field.name) is not None:
                self[field.name] = getattr(self, field.name)


class Pair(NamedTuple):
    logits: torch.Tensor
    norm: torch.Tensor


class Structured(nn.Module):
    \"\"\"Returns its head's output ``y`` in the structure ``kind`` names.\"\"\"

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.body = nn.Linear(16, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        y = self.head(torch.tanh(self.body(x)))
        return {
            "dict": lambda: {"logits": y, "ids": y.argmax(-1)},
            "dataclass": lambda: Plain(y, (y * 2, 3)),
            "model_output": lambda: ModelOutput(logits=y),
            "model_output_loss": lambda: ModelOutput(loss=y.square().mean(), logits=y),
            "namedtuple": lambda: Pair(y, y.norm(dim=-1)),
            "tuple": lambda: (y, y.argmax(-1)),
            "list": lambda: [y, [y.exp()]],
            "ids": lambda: y.argmax(-1),
        }[self.kind]()


def structured(kind):
    return lambda: (Structured(kind), (torch.randn(8, 16),))


for kind in ("dict", "dataclass", "model_output", "model_output_loss", "namedtuple", "tuple",
             "list"):
    globals()[kind] = structured(kind)


class TwoHeads(nn.Module):
    \"\"\"A loss from one head and a tanh from the other, under the key ``key``.\"\"\"

    def __init__(self, key):
        super().__init__()
        self.key = key
        self.a = nn.Linear(16, 4)
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        return {self.key: self.a(x).square().mean(), "aux": torch.tanh(self.b(x))}


def with_loss():
    return TwoHeads("loss"), (torch.randn(8, 16),)

def without_loss():
    return TwoHeads("total"), (torch.randn(8, 16),)


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        if x.sum() > 0:
            return self.lin(x)
        return -self.lin(x)


def branchy():
    return Branchy(), (torch.randn(8, 16),)

def two_inputs():
    return nn.Linear(16, 4), (torch.randn(8, 16), torch.randn(8, 16))

def wrong_shape():
    return nn.Linear(16, 4), (torch.randn(8, 15),)

integer_output = structured("ids")
"""


@pytest.fixture
def factory_file(tmp_path):
    path = tmp_path / "models.py"
    path.write_text(FACTORY)
    return path


def test_schedule_gpt_node_table(capsys):
    assert main(["schedule", "gpt", *TINY_GPT, "--nodes"]) == 0
    out = capsys.readouterr().out
    forward, backward, summary = out.split("\n\n")
    for title, table in (("forward", forward), ("backward", backward)):
        lines = table.splitlines()
        assert lines[0] == title
        assert lines[1].split() == ["node", "op", "lane", "µs", "copy", "copy", "µs", "event",
                                    "memory", "decision"]
    assert all(key in summary for key in SUMMARY_KEYS)
    assert " offload " in forward and " prefetch " in backward
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


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto is the present GPU with CUDA")
def test_default_gpt_is_the_first_benchmark_config_and_storm_offloads_there(capsys):
    """``storm schedule gpt`` as the README runs it, on a machine without CUDA: the default
    profile, auto, plans for the h100, and storm's defaults offload on the default shape."""
    assert GPTShape() == CONFIGS[QUICK_CONFIG]
    assert main(["schedule", "gpt", "--format", "json"]) == 0
    summary = json.loads(capsys.readouterr().out)["summary"]
    assert summary["profile"] == "h100"
    assert summary["offloaded_bytes"] > 0 and summary["offloaded_storages"] > 0
    assert summary["exposed_transfer_ms"] == 0
    assert summary["activation_bytes"] < summary["baseline_activation_bytes"]
    assert summary["peak_bytes"] <= summary["baseline_peak_bytes"]


def test_cli_resolves_profiles_as_the_backend_does(monkeypatch):
    """One default, ``auto``, resolved by ``profile_for``: the present GPU's calibration for
    both; without CUDA the backend's graphs run on the CPU (cpu-test) while the CLI plans for a
    GPU (h100). Names and paths resolve alike, and so do their errors."""
    assert StormConfig().profile == "auto"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert commands.planning_context().cost.profile.name == "h100"
    assert StormBackend(StormConfig()).ctx.cost.profile.name == "cpu-test"
    assert commands.planning_context(profile="h200").cost.profile.name == "h200"
    assert StormBackend(StormConfig(profile="h200")).ctx.cost.profile.name == "h200"
    message = "storm option 'profile': unknown device profile 'tpu-v9'"
    with pytest.raises(StormOptionError, match=message):
        commands.planning_context(profile="tpu-v9")
    with pytest.raises(StormOptionError, match=message):
        StormBackend(StormConfig(profile="tpu-v9"))


def test_schedule_timings_prints_each_pass_record(capsys):
    """``--timings``: after the schedule, one row per pass run in order, from the graphs' pass
    records (the joint graph as captured and its passes, then ``split``; a budget that
    recomputes rebuilds values in the backward), and the same records under ``"passes"`` in JSON."""
    argv = ["schedule", "gpt", *TINY_SHAPE, "--memory-budget", "0.3"]
    assert main([*argv, "--timings"]) == 0
    out = capsys.readouterr().out
    schedule, timings = out.split("\n\npass ")
    assert schedule.splitlines()[0].split() == ["gpt", "profile", "cpu-test"]
    lines = ("pass " + timings).splitlines()
    assert lines[0].split() == ["pass", "seconds", "changed"]
    rows = [line.split() for line in lines[2:]]
    assert [r[0] for r in rows] == ["capture", "refetch_weights", "sum_tied_gradients", "split",
                                    "annotate_costs", "plan_offload", "plan_memory",
                                    "rematerialize", "annotate_costs", "plan_offload",
                                    "plan_memory", "plan_weights", "place_transfers",
                                    "insert_transfers"]
    assert all(float(r[1]) >= 0 for r in rows)
    assert " ".join(rows[7][2:]) == "recomputed values rebuilt in the backward"
    assert main([*argv, "--timings", "--format", "json"]) == 0
    passes = json.loads(capsys.readouterr().out)["passes"]
    assert [p["name"] for p in passes] == [r[0] for r in rows]
    assert set(passes[0]) == {"name", "seconds", "changed"}
    assert main(argv) == 0
    assert "\npass " not in capsys.readouterr().out, "the pass table is behind --timings"


def test_default_view_is_a_summary_and_one_row_per_saved_activation(capsys):
    assert main(["schedule", "gpt", *TINY_SHAPE, "--memory-budget", "0.3"]) == 0
    out = capsys.readouterr().out
    assert main(["schedule", "gpt", *TINY_SHAPE, "--memory-budget", "0.3",
                 "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    lines = out.splitlines()
    assert lines[0].split() == ["gpt", "profile", "cpu-test"]
    for label in ("predicted step", "activation memory", "peak memory", "offloaded",
                  "recomputed", "saved storages", "activation target"):
        assert any(line.startswith(label) for line in lines[1:9]), label
    assert "ms with storm" in out and "ms without" in out and "→" in out
    assert max(map(len, lines)) <= 100
    assert "copy µs" not in out, "the node table is behind --nodes"
    header = lines.index(next(line for line in lines if line.split() == ["storage", "bytes",
                                                                          "decision", "reason"]))
    rows = [line.split()[0] for line in lines[header + 2:]]
    activations = [r for r in doc["storages"] if not r["graph_input"]]
    assert rows == [r["storage"] for r in activations]
    summary = doc["summary"]
    for key, action in (("offloaded_storages", "offload"), ("recomputed_storages", "recompute"),
                        ("kept_storages", "keep")):
        assert summary[key] == sum(r["decision"] == action for r in doc["storages"])
    assert summary["recomputed_storages"] > 0
    assert {"storage", "bytes", "decision", "reason", "graph_input"} == set(doc["storages"][0])


def test_schedule_factory(factory_file, capsys):
    assert main(["schedule", f"{factory_file}:good", "--min-offload-bytes", "0",
                 "--profile", "cpu-test", "--offload", "all", "--no-recompute", "--nodes"]) == 0
    assert " offload " in capsys.readouterr().out.split("\n\n")[0]


@pytest.mark.parametrize("kind", ["dict", "dataclass", "model_output", "model_output_loss",
                                  "namedtuple", "tuple", "list"])
def test_schedule_factory_of_any_output_structure(kind, factory_file, capsys):
    assert main(["schedule", f"{factory_file}:{kind}", "--min-offload-bytes", "0",
                 "--profile", "cpu-test", "--format", "json"]) == 0
    storages = {r["storage"] for r in json.loads(capsys.readouterr().out)["storages"]}
    assert "tanh" in storages, "the head's input is saved for the backward"


def test_only_the_loss_is_differentiated_when_there_is_one(factory_file, capsys):
    """The aux head's tanh is saved for its own backward only when the aux output is
    differentiated too, i.e. when the output has no ``loss`` entry."""
    saved = {}
    for name in ("with_loss", "without_loss"):
        assert main(["schedule", f"{factory_file}:{name}", "--min-offload-bytes", "0",
                     "--profile", "cpu-test", "--format", "json"]) == 0
        saved[name] = {r["storage"] for r in json.loads(capsys.readouterr().out)["storages"]}
    assert "tanh" not in saved["with_loss"] and "tanh" in saved["without_loss"]


class _Pair(NamedTuple):
    logits: torch.Tensor
    ids: torch.Tensor


@dataclasses.dataclass
class _Out:
    hidden: torch.Tensor
    rest: list


class _ModelOutput(collections.OrderedDict):
    def __init__(self, **fields):
        super().__init__(**fields)
        self.__dict__.update(fields)


def test_differentiated_outputs_rule():
    y, z, ids, loss = torch.randn(2), torch.randn(3), torch.arange(2), torch.tensor(1.0)
    assert commands.differentiated(y, "m") == (y,)
    assert commands.differentiated({"loss": loss, "logits": y}, "m") == (loss,)
    assert commands.differentiated(_ModelOutput(loss=loss, logits=y), "m") == (loss,)
    assert commands.differentiated({"loss": None, "logits": y, "ids": ids}, "m") == (y,)
    assert commands.differentiated(_Pair(y, ids), "m") == (y,)
    assert commands.differentiated(_Out(y, [ids, (z, 3)]), "m") == (y, z)
    assert commands.differentiated([y, {"z": z}], "m") == (y, z)
    with pytest.raises(ModelSpecError, match="no floating-point tensor"):
        commands.differentiated((ids, 3), "m")


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("storm: error:"), err
    return err


@pytest.mark.parametrize("spec, message", [
    ("missing.py:build", "no such file"),
    ("{factory}:nothere", "has no callable 'nothere'"),
    ("{factory}:wrong", "must return (torch.nn.Module, tuple of example inputs)"),
    ("{factory}:raises", "raised RuntimeError: no weights here"),
    ("resnet", "expected one of gpt, llama or path/to/file.py:factory"),
    ("{factory}:branchy", "its forward has a data-dependent branch (Python control flow on a "
                          "tensor's value, or .item()), which cannot be traced with fake tensors: "
                          "DataDependentOutputException"),
    ("{factory}:two_inputs", "its forward failed on the example inputs: TypeError: "),
    ("{factory}:wrong_shape", "its forward failed on the example inputs: RuntimeError: "),
    ("{factory}:integer_output", "its output holds no floating-point tensor to differentiate"),
])
def test_bad_model_is_one_line_exit_2(spec, message, factory_file, capsys):
    assert main(["schedule", spec.format(factory=factory_file), "--profile",
                 "cpu-test"]) == EXIT_USAGE
    assert message in _one_line_error(capsys)


def test_a_bug_in_storm_keeps_its_traceback(factory_file, monkeypatch):
    """Only errors of the user's forward become one-line errors, not those of storm's passes
    running in the same trace."""
    def broken(*args, **kwargs):
        raise RuntimeError("storm bug")

    monkeypatch.setattr("storm_compile.compiler.backend.storm_partition", broken)
    with pytest.raises(RuntimeError, match="storm bug"):
        main(["schedule", f"{factory_file}:good", "--profile", "cpu-test"])


@pytest.mark.parametrize("knob, value, message", [
    ("heads", 3, "gpt d_model (2048) must be divisible by heads (3)"),
    ("seq", 0, "gpt seq must be a positive int, got 0"),
    ("batch", -1, "gpt batch must be a positive int, got -1"),
    ("layers", 0, "gpt layers must be a positive int, got 0"),
    ("d_model", 0, "gpt d_model must be a positive int, got 0"),
    ("hidden", 0, "gpt hidden must be a positive int, got 0"),
    ("dtype", "int8", "gpt dtype must be one of float32, bfloat16, float16, float64, got 'int8'"),
])
def test_bad_gpt_shape_is_one_line_exit_2_as_in_python(knob, value, message, capsys):
    assert main(["schedule", "gpt", f"--{knob.replace('_', '-')}", str(value)]) == EXIT_USAGE
    assert message in _one_line_error(capsys)
    with pytest.raises(ModelSpecError, match=re.escape(message)):
        GPTShape(**{knob: value})


@pytest.mark.parametrize("argv, message", [
    (["schedule", "gpt", "--trace", "{tmp}/no/such/trace.json"], "--trace '{tmp}/no/such/"
                                                                "trace.json': no such folder "
                                                                "'{tmp}/no/such'"),
    (["pareto", "gpt", "--plot", "{tmp}/missing/f.svg"], "--plot '{tmp}/missing/f.svg': no "
                                                        "such folder '{tmp}/missing'"),
])
def test_output_into_a_missing_folder_is_one_line_exit_2(argv, message, tmp_path, capsys):
    assert main([a.format(tmp=tmp_path) for a in argv]) == EXIT_USAGE
    assert message.format(tmp=tmp_path) in _one_line_error(capsys)
    assert not (tmp_path / "no").exists() and not (tmp_path / "missing").exists()


def test_argparse_errors_are_one_line_exit_2(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["schedule", "gpt", "--seq", "abc"])
    assert exited.value.code == EXIT_USAGE
    assert "argument --seq: invalid int value: 'abc'" in _one_line_error(capsys)


@pytest.mark.parametrize("profile, message", [
    ("tpu-v9", "unknown device profile 'tpu-v9'; built-in profiles: h100"),
    ("{missing}", "missing field 'matmul_flops'"),
    ("{negative}", "field 'h2d_bandwidth' must be a finite, non-negative number, got -1"),
    ("{nan}", "field 'launch_s' must be a finite, non-negative number, got nan"),
    ("{infinite}", "field 'd2h_bandwidth' must be a finite, non-negative number, got inf"),
])
def test_bad_profile_is_one_line_exit_2(profile, message, tmp_path, capsys):
    missing = tmp_path / "missing.json"
    missing.write_text(json.dumps({"name": "x"}))
    fields = {"name": "x", "matmul_flops": 1, "fp32_flops": 1, "memory_bandwidth": 1,
              "launch_s": 0, "h2d_bandwidth": 1, "d2h_bandwidth": 1, "duplex_bandwidth": 1,
              "copy_latency_s": 0, "transfer_host_s": 0}
    bad = {"negative": ("h2d_bandwidth", -1), "nan": ("launch_s", float("nan")),
           "infinite": ("d2h_bandwidth", float("inf"))}
    paths = {"missing": missing}
    for name, (field, value) in bad.items():
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps({**fields, field: value}))  # NaN and Infinity literals
    assert main(["schedule", "gpt", "--profile", profile.format(**paths)]) == EXIT_USAGE
    assert message in _one_line_error(capsys)


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


WITHOUT_TORCH = """
import sys
from storm_compile.cli import main
try:
    status = main(sys.argv[1:])
except SystemExit as exited:
    status = exited.code
assert "torch" not in sys.modules, "the command line imported torch"
sys.exit(status)
"""
"""Runs ``storm`` with the arguments after ``-c`` in a fresh interpreter, and fails if anything
it imported loaded torch."""


def _without_torch(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITHOUT_TORCH, *argv], capture_output=True,
                          text=True)


@pytest.mark.parametrize("argv, status, printed", [
    (["--help"], 0, "usage: storm [-h] [--version]"),
    (["schedule", "--help"], 0, "usage: storm schedule"),
    (["pareto", "--help"], 0, "usage: storm pareto"),
    (["throughput", "--help"], 0, "usage: storm throughput"),
    (["calibrate", "--help"], 0, "usage: storm calibrate"),
    (["schedule", "gpt", "--seq", "abc"], EXIT_USAGE, "argument --seq: invalid int value"),
])
def test_help_and_usage_errors_print_without_importing_torch(argv, status, printed):
    result = _without_torch(argv)
    assert result.returncode == status, result.stderr
    assert printed in result.stdout + result.stderr


def test_version_prints_the_package_version_without_importing_torch():
    result = _without_torch(["--version"])
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"storm-compile {storm_compile.__version__}\n"


def test_package_version_is_pyproject_version():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in Python 3.11 and later")
    with (Path(__file__).resolve().parent.parent / "pyproject.toml").open("rb") as pyproject:
        assert storm_compile.__version__ == tomllib.load(pyproject)["project"]["version"]


def test_throughput_help_offers_only_the_built_in_models(capsys):
    with pytest.raises(SystemExit):
        main(["throughput", "--help"])
    assert "file.py:factory" not in capsys.readouterr().out


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
    assert main(["pareto", "gpt", *TINY_SHAPE, "--budgets", "1.0,0.5"]) == 0
    header, rule, full, half = capsys.readouterr().out.splitlines()
    assert header.split() == ["budget", "step", "ms", "×", "no", "storm", "activations", "peak",
                              "offloaded", "recomputed", "frontier"]
    assert set(rule) == {"-", " "}
    assert full.split()[-5:] == ["0", "B", "0", "B", "yes"], "all kept: nothing moved"
    assert half.split()[-5:] != full.split()[-5:]


@pytest.mark.parametrize("argv", [
    ["schedule", "llama", "--preset", "1b", "--layers", "1", "--seq", "256", "--stream",
     "--memory-budget", "0.5", "--nodes"],
    ["pareto", "llama", "--preset", "3b", "--layers", "2", "--budgets", "1.0,0.5"],
    ["throughput", "llama", "--preset", "3b", "--layers", "2", "--stream", "--tokens",
     "4096,16384", "--micro-batches", "1,16"],
])
def test_tables_fit_120_columns_with_sizes_in_binary_units(argv, capsys):
    """``storm schedule --nodes`` (long node and op names cut around "…"), ``storm pareto``
    and ``storm throughput`` print each size once, in binary units, in lines of at most 120
    columns (the JSON keeps the bytes and the names)."""
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) <= 120
    assert "iB" in out and " bytes" not in out and "GiB)" not in out


def test_schedule_host_memory_limit_bounds_the_offloads(capsys):
    """A limit below what the plan at 0.3 offloads, with nothing that may be recomputed, is an
    error naming it (``tests/test_plan.py`` checks the recomputation that takes the rest)."""
    argv = ["schedule", "gpt", *TINY_SHAPE, "--memory-budget", "0.3", "--format", "json"]
    assert main([*argv, "--no-recompute"]) == 0
    offloaded = json.loads(capsys.readouterr().out)["summary"]["offloaded_bytes"]
    assert offloaded > 0
    assert main([*argv, "--no-recompute", "--host-memory-limit", str(offloaded // 2)]) \
        == EXIT_USAGE
    assert "Raise host_memory_limit" in _one_line_error(capsys)


def test_schedule_fp8_offloads_move_fewer_bytes(capsys):
    argv = ["schedule", "gpt", *TINY_SHAPE, "--offload", "all", "--no-recompute", "--format",
            "json"]
    moved = []
    for extra in ([], ["--offload-format", "fp8"]):
        assert main([*argv, *extra]) == 0
        moved.append(json.loads(capsys.readouterr().out)["summary"]["offloaded_bytes"])
    exact, packed = moved
    assert 0 < packed < exact


@pytest.mark.parametrize("budget, message", [
    ("12parsecs", "cannot use '12parsecs': unknown size unit 'parsecs'"),
    ("1KiB", "below the minimum feasible"),
    ("2048", "a number without a unit is a fraction in (0, 1]: give bytes with a unit"),
    ("0", "cannot use '0': a number without a unit is a fraction, which must be in (0, 1]"),
    ("-0.5", "cannot use '-0.5': a number without a unit is a fraction"),
    ("1.5", "cannot use '1.5': a number without a unit is a fraction"),
    ("nan", "cannot use 'nan': not a finite number"),
    ("inf", "cannot use 'inf': not a finite number"),
])
def test_bad_budget_is_one_line_exit_2(budget, message, capsys):
    assert main(["schedule", "gpt", *TINY_SHAPE, "--memory-budget", budget]) == EXIT_USAGE
    assert message in _one_line_error(capsys)


@pytest.mark.parametrize("overhead", ["nan", "inf", "-0.1"])
def test_bad_max_overhead_is_one_line_exit_2(overhead, capsys):
    assert main(["schedule", "gpt", *TINY_SHAPE, "--memory-budget", "auto",
                 "--max-overhead", overhead]) == EXIT_USAGE
    assert "storm option 'max_overhead': expected a finite fraction >= 0" in \
        _one_line_error(capsys)


@pytest.mark.parametrize("typed, python", [("1", 1), ("1", 1.0), ("0.5", 0.5),
                                           ("2GiB", "2GiB"), ("2GiB", 2 * GIB)])
def test_cli_reads_a_budget_as_python_does(typed, python, monkeypatch, capsys):
    configs = []
    from_options = StormConfig.from_options

    def spy(**options):
        configs.append(from_options(**options))
        return configs[-1]

    monkeypatch.setattr(StormConfig, "from_options", spy)
    assert main(["schedule", "gpt", *TINY_SHAPE, "--memory-budget", typed,
                 "--format", "json"]) == 0
    summary = json.loads(capsys.readouterr().out)["summary"]
    (config,) = configs
    expected = from_options(memory_budget=python).memory_budget
    assert config.memory_budget == expected
    if expected.fraction is not None:
        assert summary["budget_bytes"] == int(expected.fraction
                                              * summary["baseline_activation_bytes"])


def test_pareto_skips_budgets_below_the_minimum_with_a_note(factory_file, capsys):
    """Nothing of the tiny model reaches the default min_offload_bytes, so its minimum is all
    of its activation memory and every default fraction below 1 is skipped."""
    spec = f"{factory_file}:good"
    assert main(["pareto", spec, "--profile", "cpu-test", "--format", "json"]) == 0
    captured = capsys.readouterr()
    (point,) = json.loads(captured.out)
    notes = captured.err.strip().splitlines()
    assert [n.split()[3] for n in notes] == ["0.9", "0.75", "0.5", "0.25", "0.1"]
    minimum = point["activation_bytes"]
    assert all(n.startswith("storm: note: budget ") and
               n.endswith(f"skipped: below the minimum of {minimum} bytes for this model")
               for n in notes)
    assert main(["pareto", spec, "--profile", "cpu-test", "--budgets", "1,1KiB"]) == 0
    assert "budget 1KiB (1024 bytes) skipped" in capsys.readouterr().err
    assert main(["pareto", spec, "--profile", "cpu-test", "--budgets", "0.5,1KiB"]) == EXIT_USAGE
    assert "every budget is below the minimum" in capsys.readouterr().err.splitlines()[-1]


def test_pareto_default_sweep_ends_at_the_minimum(factory_file, capsys):
    assert main(["pareto", f"{factory_file}:good", "--profile", "cpu-test",
                 "--min-offload-bytes", "0", "--format", "json"]) == 0
    captured = capsys.readouterr()
    points = json.loads(captured.out)
    assert points[0]["step_ratio"] == 1.0
    assert points[-1]["budget_bytes"] == points[-1]["activation_bytes"] == \
        min(p["activation_bytes"] for p in points)
    assert "budget 0.1 " in captured.err, "0.1 of this model is below its minimum"


def test_schedule_llama_preset_plans_its_loss(capsys):
    assert main(["schedule", "llama", "--preset", "tiny", "--format", "json",
                 "--min-offload-bytes", "0", "--memory-budget", "0.5"]) == 0
    doc = json.loads(capsys.readouterr().out)
    summary = doc["summary"]
    assert summary["activation_bytes"] <= summary["budget_bytes"] < \
        summary["baseline_activation_bytes"]


@pytest.mark.parametrize("argv, message", [
    (["llama", "--d-model", "64"], "--d-model applies to the built-in gpt only"),
    (["gpt", "--preset", "tiny"], "--preset applies to the built-in llama only"),
])
def test_llama_knobs_are_checked(argv, message, capsys):
    assert main(["schedule", *argv]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


STREAMED_LLAMA = ["llama", "--preset", "1b", "--layers", "1", "--seq", "256", "--stream"]
"""The smallest built-in whose matrices pass stream_parameters' 1 MiB: one 1B-shaped block."""
BF16_BYTES = 2


def test_schedule_of_a_streamed_model_reports_weights_and_tokens_per_second(capsys):
    assert main(["schedule", *STREAMED_LLAMA, "--format", "json"]) == 0
    summary = json.loads(capsys.readouterr().out)["summary"]
    shape = dataclasses.replace(LLAMA_PRESETS["1b"], layers=1)
    assert shape.tie_embeddings
    norms = shape.d_model * (2 * shape.layers + 1)
    assert summary["streamed_weight_bytes"] == (shape.parameters - norms) * BF16_BYTES, \
        "the tied embedding is one weight, streamed once, as torch.compile traces it"
    assert summary["tokens"] == 256
    assert summary["predicted_tokens_per_s"] == pytest.approx(
        256 / (summary["predicted_step_ms"] / 1e3))
    assert main(["schedule", *STREAMED_LLAMA]) == 0
    table = capsys.readouterr().out
    assert "streamed weights" in table and "tokens/s predicted" in table


def test_throughput_plans_each_micro_batch_size(capsys):
    assert main(["throughput", *STREAMED_LLAMA, "--tokens", "256,512", "--format",
                 "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["tokens"], r["micro_batches"]) for r in rows] == [(256, 1), (512, 1)]
    assert rows[1]["activation_bytes"] > rows[0]["activation_bytes"]
    assert all(r["streamed_weight_bytes"] == rows[0]["streamed_weight_bytes"] > 0 for r in rows)
    for row in rows:
        assert row["optimizer_step_ms"] == pytest.approx(row["micro_batch_ms"]
                                                         + row["optimizer_ms"])
        assert row["predicted_tokens_per_s"] == pytest.approx(
            row["tokens"] / row["optimizer_step_ms"] * 1e3)


def test_a_tied_weight_gets_the_gradients_of_all_its_uses():
    """Traced once, the tied embedding's gradient sent home is the sum of the embedding's and
    the output projection's, as under torch.compile."""
    graphs = commands.plan_model("llama", commands.planning_context(), stream=True, preset="1b",
                                 layers=1, seq=256)
    vocab = LLAMA_PRESETS["1b"].vocab
    (sent,) = [n for n in graphs.backward.graph.nodes if n.target is ops.send_grad
               and n.meta["val"].shape[0] == vocab]
    total = sent.args[0]
    assert total.target is torch.ops.aten.add.Tensor
    uses = []
    for use in total.args:
        while use.target is torch.ops.aten.t.default:
            use = use.args[0]
        uses.append(str(use.target))
    assert sorted(uses) == ["aten.embedding_dense_backward.default", "aten.mm.default"]


def test_throughput_plans_each_size_as_a_step_of_its_own(capsys):
    budget = ["--memory-budget", "2GiB", "--format", "json"]
    assert main(["throughput", *STREAMED_LLAMA, "--tokens", "256,512", *budget]) == 0
    together = json.loads(capsys.readouterr().out)[1]
    assert main(["throughput", *STREAMED_LLAMA, "--tokens", "512", *budget]) == 0
    (alone,) = json.loads(capsys.readouterr().out)
    assert together == alone


def test_throughput_over_micro_batches_spreads_the_host_optimizer(capsys):
    argv = ["throughput", *STREAMED_LLAMA, "--tokens", "256", "--micro-batches", "1,4",
            "--format", "json"]
    assert main(argv) == 0
    one, four = json.loads(capsys.readouterr().out)
    assert (one["micro_batches"], four["micro_batches"]) == (1, 4)
    assert one["optimizer_ms"] == four["optimizer_ms"] > 0
    assert four["optimizer_step_ms"] == pytest.approx(
        four["first_micro_batch_ms"] + 2 * four["micro_batch_ms"] + four["last_micro_batch_ms"]
        + four["optimizer_ms"])
    assert four["first_micro_batch_ms"] < four["micro_batch_ms"], "its gradients are not added"
    assert four["predicted_tokens_per_s"] > one["predicted_tokens_per_s"]
    assert main([*argv, "--overlap-optimizer"]) == 0
    overlapped = json.loads(capsys.readouterr().out)
    assert all(r["optimizer_ms"] == 0 for r in overlapped)
    assert overlapped[0]["optimizer_step_ms"] <= one["optimizer_step_ms"]
    assert main([*argv, "--accumulate"]) == 0
    deferred = json.loads(capsys.readouterr().out)
    assert four["host_wait_ms"] > 0
    assert all(r["host_wait_ms"] == 0 for r in deferred)
    assert deferred[1]["optimizer_step_ms"] < four["optimizer_step_ms"]
    assert deferred[0]["optimizer_step_ms"] == pytest.approx(one["optimizer_step_ms"]), \
        "one micro-batch is its own last: it waits"


def test_trace_of_a_streamed_model_has_the_host_threads_work(capsys, tmp_path):
    trace = tmp_path / "trace.json"
    assert main(["schedule", *STREAMED_LLAMA, "--trace", str(trace)]) == 0
    events = json.loads(trace.read_text())["traceEvents"]
    (track,) = [e["tid"] for e in events if e["ph"] == "M"
                and e["args"]["name"] == "host thread"]
    adds = [e for e in events if e["ph"] == "X" and e["tid"] == track]
    assert adds and all(e["name"].startswith("add ") and e["args"]["bytes"] > 0 for e in adds)


@pytest.mark.parametrize("argv, message", [
    (["llama", "--preset", "tiny", "--tokens", "48"], "multiples of the sequence length 32"),
    (["llama", "--preset", "tiny", "--tokens", "32,x"], "multiples of the sequence length 32"),
    (["{factory}:good", "--tokens", "64"], "throughput needs a built-in model"),
    (["llama", "--preset", "tiny", "--tokens", "32", "--micro-batches", "0"],
     "--micro-batches 0: expected comma-separated positive integers"),
])
def test_throughput_bad_input_is_one_line(argv, message, factory_file, capsys):
    assert main(["throughput", *(a.format(factory=factory_file) for a in argv)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_a_reader_that_stops_early_ends_the_command_quietly():
    """``storm schedule --nodes | head``: the command stops with 128 + SIGPIPE and no
    traceback when the reader closes the pipe. Eight layers' table (about 150 KB) is more than
    a pipe holds (64 KiB on Linux), so the write meets the closed end."""
    process = subprocess.Popen([sys.executable, "-m", "storm_compile.cli", "schedule", "gpt",
                                "--layers", "8", "--nodes"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout.readline() == b"forward\n"
    process.stdout.close()
    assert process.wait(timeout=300) == EXIT_BROKEN_PIPE
    assert process.stderr.read() == b""


def test_schedule_stages_shows_what_each_pass_did_to_the_code(capsys):
    """``--stages``: every pass in order, the joint graph whole as captured, the streamed
    weights' fetches tagged, the tied embedding's two gradients summed into one copy home, the
    pair whole at ``split``, and insert_transfers' diff adding storm's typed copies; in JSON,
    each record's code by graph. Without ``--stages`` no record keeps code."""
    argv = ["schedule", *STREAMED_LLAMA, "--memory-budget", "0.5", "--profile", "cpu-test"]
    assert main([*argv, "--stages"]) == 0
    out = capsys.readouterr().out.split("\n== capture", 1)[1]
    heads = [line for line in out.splitlines() if line.startswith("== ")]
    assert [h.split()[1] for h in heads][:3] == ["refetch_weights", "sum_tied_gradients", "split"]
    assert heads[-1].split()[1] == "insert_transfers"
    assert "recompute tags" in heads[0] and "joint +2 -2 nodes" in heads[1]
    tied = out.split("== sum_tied_gradients", 1)[1].split("\n== ", 1)[0]
    assert sum(line.startswith("-") and "grad_to_host" in line for line in tied.splitlines()) == 2
    assert sum(line.startswith("+") and "grad_to_host" in line for line in tied.splitlines()) == 1
    inserted = out.split("== insert_transfers", 1)[1]
    assert "+++ forward after" in inserted and "+++ backward after" in inserted
    assert any(line.startswith("+") and "storm.wait_event" in line
               for line in inserted.splitlines())
    assert main([*argv, "--stages", "--format", "json"]) == 0
    stages = json.loads(capsys.readouterr().out)["stages"]
    assert list(stages[0]["code"]) == ["joint"] and "fetch_weight" in stages[0]["code"]["joint"]
    assert {tuple(s["code"]) for s in stages[3:]} == {("forward", "backward")}
    graphs = commands.plan_model(STREAMED_LLAMA[0], commands.planning_context(
        profile="cpu-test"), stream=True, preset="1b", layers=1, seq=256)
    assert [r.code for r in graphs.records] == [()] * len(graphs.records)


def test_frozen_weights_in_a_host_format_cross_the_link_packed(capsys):
    """--lora freezes the model beside adapters; --host-format packs the frozen streamed
    weights: nf4 moves under 30 % of the bf16 bytes (4.5 bits of 16), and the table says so."""
    def weight_bytes(*extra):
        assert main(["schedule", *STREAMED_LLAMA, "--lora", "8", *extra, "--format",
                     "json"]) == 0
        summary = json.loads(capsys.readouterr().out)["summary"]
        return summary, summary["streamed_weight_bytes"] + summary["resident_weight_bytes"]

    plain, bf16 = weight_bytes()
    packed, nf4 = weight_bytes("--host-format", "nf4")
    assert plain["host_format"] is None and packed["host_format"] == "nf4"
    assert 0.25 * bf16 < nf4 < 0.3 * bf16
    assert main(["schedule", *STREAMED_LLAMA, "--lora", "8", "--host-format", "int8"]) == 0
    assert "(frozen weights in int8)" in capsys.readouterr().out
    assert main(["throughput", *STREAMED_LLAMA, "--lora", "8", "--host-format", "nf4",
                 "--tokens", "256"]) == 0
    assert capsys.readouterr().out.startswith("frozen streamed weights in nf4\n")
    assert main(["throughput", *STREAMED_LLAMA, "--lora", "8", "--host-format", "nf4",
                 "--tokens", "256", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["host_format"] == "nf4"


@pytest.mark.parametrize("weights", [["--stream", "--host-format", "nf4"],
                                     ["--lora", "4", "--host-format", "nf4"]])
def test_a_host_format_needs_streamed_frozen_weights(capsys, weights):
    assert main(["schedule", *STREAMED_LLAMA[:-1], *weights]) == EXIT_USAGE
    assert "--host-format nf4 holds frozen streamed weights" in capsys.readouterr().err


def test_the_parser_offers_the_host_formats_quantize_packs():
    from storm_compile.cli.arguments import HOST_FORMATS
    from storm_compile.weights.quantize import FORMATS
    assert HOST_FORMATS == FORMATS


class _Planned(Exception):
    """Stops a compile once storm has planned its graphs (Inductor need not compile them)."""


def _ops(graphs) -> collections.Counter:
    return collections.Counter(str(n.target) for gm in (graphs.forward, graphs.backward)
                               for n in gm.graph.nodes if n.op == "call_function")


@pytest.mark.parametrize("stream", [False, True])
def test_schedule_plans_the_graphs_the_backend_plans(stream):
    """The CLI traces as Inductor hands storm the joint graph (its decompositions and
    joint-graph passes), so ``storm schedule`` plans the ops the backend plans, under a byte
    budget with streamed weights and under a fraction without."""
    budget = "2GiB" if stream else 0.5
    options = {"memory_budget": budget, "profile": "h100", "min_offload_bytes": 0}
    shape = {"preset": "1b", "layers": 1, "seq": 64}
    cli = commands.plan_model("llama", commands.planning_context(**options), stream=stream,
                              **shape)
    captured = []

    def planned(graphs):
        captured.append(graphs)
        raise _Planned

    torch.manual_seed(0)
    llama = dataclasses.replace(LLAMA_PRESETS["1b"], layers=1, seq=64)
    model, inputs = build_llama(llama)
    if stream:
        stream_parameters(model, "cpu")
    backend = StormBackend(StormConfig.from_options(**{**CPU_PLANNING, **options}),
                           observer=planned)
    with pytest.raises(Exception) as raised:
        torch.compile(model, backend=backend)(*inputs)
    assert captured, f"the backend did not plan: {raised.value}"
    assert _ops(cli) == _ops(captured[0])
