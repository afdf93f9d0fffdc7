import dataclasses
import os
import shutil
import tempfile

CACHE_DIR = tempfile.mkdtemp(prefix="storm-tests-inductor-")
"""Every test run compiles into a cache of its own, removed at the end: entries left by an
earlier version of storm's ops (another schema) are never loaded."""
os.environ["TORCHINDUCTOR_CACHE_DIR"] = CACHE_DIR

import pytest  # noqa: E402
import torch  # noqa: E402
import torch._dynamo  # noqa: E402

from storm_compile.cost.profiles import PROFILES  # noqa: E402
from storm_compile.runtime.streams import get_runtime  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch: no cached graphs or recompile limits leak across."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


FOLD_TEST_CHUNK_BYTES = 1024
"""Four rows of the tiny Llama's matrices (64 float32 columns): each gradient a step's last
backward folds into its host sum goes in several chunks, through both fold buffers."""


@pytest.fixture
def small_fold_chunks():
    """Gradients folded on the device in chunks of :data:`FOLD_TEST_CHUNK_BYTES`."""
    runtime = get_runtime()
    chunk = runtime.fold_chunk_bytes
    runtime.fold_chunk_bytes = FOLD_TEST_CHUNK_BYTES
    yield
    runtime.fold_chunk_bytes = chunk


SLOW_HOST_ADD_BANDWIDTH = 1e9
"""A host that adds gradients at a tenth of the CPU test profile's link rate: the cost model folds
them on the device (``CostModel.folds_faster``)."""


@pytest.fixture
def slow_host_profile(tmp_path) -> str:
    """A device profile file: the CPU test profile with a host that adds slower than the link."""
    path = tmp_path / "slow-host.json"
    dataclasses.replace(PROFILES["cpu-test"], name="cpu-test-slow-host",
                        host_add_bandwidth=SLOW_HOST_ADD_BANDWIDTH).to_json(path)
    return str(path)


MULTI_GPU = 2
"""Devices the ``multi_gpu`` tests run on: one rank each."""


def pytest_collection_modifyitems(config, items):
    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "gpu" in item.keywords and not devices:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        elif "multi_gpu" in item.keywords and devices < MULTI_GPU:
            item.add_marker(pytest.mark.skip(reason=f"needs {MULTI_GPU} CUDA devices"))



def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(CACHE_DIR, ignore_errors=True)
