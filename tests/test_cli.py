"""``storm schedule``: the table, JSON, and one-line errors with exit status 2 on bad input."""

import json
import subprocess
import sys

import pytest

from storm_compile.cli import EXIT_USAGE, main

TINY_GPT = ["--d-model", "64", "--layers", "1", "--heads", "4", "--seq", "64", "--batch", "2",
            "--min-offload-bytes", "0"]

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
    for column in ("graph", "node", "op", "stream", "event", "decision"):
        assert column in out
    assert "offload.default" in out and "prefetch.default" in out
    assert "d2h" in out and "h2d" in out and "record ev0" in out and "wait ev0" in out
    assert "offloaded_bytes" in out


def test_schedule_json(capsys):
    assert main(["schedule", "gpt", *TINY_GPT, "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["summary"]["offloaded_storages"] > 0
    streams = {row["stream"] for row in doc["nodes"]}
    assert {"compute", "d2h", "h2d"} <= streams


def test_schedule_factory(factory_file, capsys):
    assert main(["schedule", f"{factory_file}:good", "--min-offload-bytes", "0"]) == 0
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


def test_gpt_knobs_rejected_for_factories(factory_file, capsys):
    assert main(["schedule", f"{factory_file}:good", "--layers", "3"]) == EXIT_USAGE
    assert "gpt model only" in capsys.readouterr().err


def test_console_script_exit_code_and_no_traceback():
    result = subprocess.run([sys.executable, "-m", "storm_compile.cli", "schedule",
                             "nowhere.py:f"], capture_output=True, text=True)
    assert result.returncode == EXIT_USAGE
    assert "Traceback" not in result.stderr
