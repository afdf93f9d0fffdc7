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

from storm_compile.backend import StormBackend, storm  # noqa: E402  (needs the passes above)
from storm_compile.config import StormConfig  # noqa: E402

__version__ = "0.1.0"

__all__ = ["storm", "StormBackend", "StormConfig", "__version__"]
