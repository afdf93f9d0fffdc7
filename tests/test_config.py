"""Option validation at the backend edge, and registration under the "storm" name."""

from importlib.metadata import entry_points

import pytest

from storm_compile import StormConfig, storm
from storm_compile.config import GIB, parse_bytes


def test_defaults_resolve_host_limit():
    config = StormConfig.from_options()
    assert config.host_memory_limit > 0
    assert config.inner == "inductor"


@pytest.mark.parametrize("options, message", [
    ({"bogus": 1}, "unknown storm option(s) 'bogus'"),
    ({"inner": "tvm"}, "storm option 'inner': expected one of ('inductor', 'eager')"),
    ({"min_offload_bytes": -1}, "storm option 'min_offload_bytes': must be >= 0"),
    ({"prefetch_distance": 1.5}, "storm option 'prefetch_distance': expected an int"),
    ({"offload_wait_distance": True}, "storm option 'offload_wait_distance': expected an int"),
    ({"transfer_cpu_tensors": "yes"}, "storm option 'transfer_cpu_tensors': expected a bool"),
    ({"host_memory_limit": "12 parsecs"}, "storm option 'host_memory_limit': cannot read"),
    ({"host_memory_limit": 2.5}, "storm option 'host_memory_limit': expected bytes"),
])
def test_bad_options_raise_value_error_naming_the_option(options, message):
    with pytest.raises(ValueError) as error:
        storm(**options)
    assert message in str(error.value)


def test_unknown_option_lists_known_ones():
    with pytest.raises(ValueError, match="known options: .*min_offload_bytes"):
        storm(prefetch=3)


@pytest.mark.parametrize("text, expected", [
    ("12GiB", 12 * GIB), ("512 MiB", 512 << 20), ("1.5gb", 1_500_000_000), (4096, 4096),
    ("100", 100),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text, "x") == expected


def test_config_is_frozen():
    config = StormConfig.from_options()
    with pytest.raises(AttributeError):
        config.inner = "eager"


def test_backend_is_registered_by_entry_point():
    (entry,) = [e for e in entry_points(group="torch_dynamo_backends") if e.name == "storm"]
    assert callable(entry.load())
