import pytest
import torch
import torch._dynamo


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch: no cached graphs or recompile limits leak across."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

