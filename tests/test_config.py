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
    ({"offload": "some"}, "storm option 'offload': expected one of ('hidden', 'all')"),
    ({"prefetch_window_bytes": True}, "storm option 'prefetch_window_bytes': expected bytes"),
    ({"profile": "tpu-v9"}, "storm option 'profile': unknown device profile 'tpu-v9'; built-in "
                            "profiles: h100, h200, a100-pcie, rtx4090, cpu-test"),
    ({"profile": 3}, "storm option 'profile': expected a profile name or path"),
    ({"cost": "guess"}, "storm option 'cost': expected one of ('roofline', 'measured')"),
    ({"transfer_cpu_tensors": "yes"}, "storm option 'transfer_cpu_tensors': expected a bool"),
    ({"host_memory_limit": "12 parsecs"}, "storm option 'host_memory_limit': cannot read"),
    ({"host_memory_limit": 2.5}, "storm option 'host_memory_limit': expected bytes"),
    ({"memory_budget": "12 parsecs"}, "storm option 'memory_budget': cannot read '12 parsecs'; "
                                      "accepted forms: an int of bytes; a size string"),
    ({"memory_budget": 1.5}, "storm option 'memory_budget': a fraction must be in (0, 1]"),
    ({"memory_budget": True}, "storm option 'memory_budget': got bool True; accepted forms"),
    ({"memory_budget": 0.5, "offload": "all"}, "'memory_budget' and offload='all' conflict"),
    ({"max_overhead": -0.1}, "storm option 'max_overhead': expected a fraction >= 0"),
    ({"recompute": "no"}, "storm option 'recompute': expected a bool"),
])
def test_bad_options_raise_value_error_naming_the_option(options, message):
    with pytest.raises(ValueError) as error:
        storm(**options)
    assert message in str(error.value)


def test_unknown_option_lists_known_ones():
    with pytest.raises(ValueError, match="known options: .*min_offload_bytes"):
        storm(prefetch=3)


def test_sizes_accept_strings():
    backend = storm(min_offload_bytes="4MiB", prefetch_window_bytes="2 GiB", profile="cpu-test")
    assert backend.config.min_offload_bytes == 4 << 20
    assert backend.config.prefetch_window_bytes == 2 * GIB


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


@pytest.mark.parametrize("budget, resolved", [
    ("12GiB", 12 * GIB), (1 << 20, 1 << 20), (0.5, 0.5), (1.0, 1.0), ("auto", "auto"),
    (None, None),
])
def test_memory_budget_forms(budget, resolved):
    assert StormConfig.from_options(memory_budget=budget).memory_budget == resolved
