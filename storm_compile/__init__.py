"""storm-compile: a torch.compile backend that moves activations saved for the backward to pinned
host memory on dedicated copy streams, so models whose activations do not fit still train."""

from storm_compile.backend import StormBackend, storm
from storm_compile.config import StormConfig

__version__ = "0.1.0"

__all__ = ["storm", "StormBackend", "StormConfig", "__version__"]
