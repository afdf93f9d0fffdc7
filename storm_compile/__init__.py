"""storm-compile: a torch.compile backend that moves activations saved for the backward to pinned
host memory on dedicated copy streams, so models whose activations do not fit still train."""

import importlib.util
import sys
from pathlib import Path

_SOURCE_PASSES = Path(__file__).resolve().parent.parent / "passes" / "__init__.py"
"""The passes in a source checkout. A build maps ``passes/`` to ``storm_compile.passes``; an
install that only puts the checkout on the path (``setup.py develop``, which pip runs for
``pip install -e .`` with setuptools older than 64) does not, so the package loads them from
there itself."""

if importlib.util.find_spec(f"{__name__}.passes") is None and _SOURCE_PASSES.is_file():
    _spec = importlib.util.spec_from_file_location(
        f"{__name__}.passes", _SOURCE_PASSES,
        submodule_search_locations=[str(_SOURCE_PASSES.parent)])
    sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules[_spec.name])

__version__ = "0.1.0"

__all__ = ["storm", "StormBackend", "StormConfig", "stream_parameters", "overlap_optimizer",
           "StormAutogradError", "StormOverlapError", "__version__"]

_LAZY = {"storm": "storm_compile.compiler.backend",
         "StormBackend": "storm_compile.compiler.backend",
         "StormConfig": "storm_compile.config",
         "stream_parameters": "storm_compile.weights.streaming",
         "overlap_optimizer": "storm_compile.weights.streaming",
         "StormAutogradError": "storm_compile.runtime.streams",
         "StormOverlapError": "storm_compile.runtime.cycles"}
"""The module that defines each public name but the version. Those modules import torch, so a
name is imported on its first use (:func:`__getattr__`), and importing the package does not load
torch: ``storm --help`` and ``storm --version`` print at once."""


def __getattr__(name: str) -> object:
    """A public name of :data:`_LAZY`, imported from its module (PEP 562); the backend's module
    needs the passes above."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
