"""Option validation at the backend edge, and registration under the "storm" name."""

from importlib.metadata import entry_points

import pytest

from storm_compile import StormConfig, storm
from storm_compile.config import (
    BUDGET_FORMS,
    GIB,
    HOST_MEMORY_FRACTION,
    LOCAL_RANKS_ENV,
    PEAK_MARGIN,
    MemoryBudget,
    StormOptionError,
    parse_bytes,
    physical_memory_bytes,
)


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
    ({"memory_budget": "12 parsecs"}, "storm option 'memory_budget': cannot use '12 parsecs': "
                                      "unknown size unit 'parsecs'"),
    ({"memory_budget": 0.5, "offload": "all"}, "'memory_budget' and offload='all' conflict"),
    ({"max_overhead": -0.1}, "storm option 'max_overhead': expected a finite fraction >= 0"),
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
    (None, MemoryBudget()), ("auto", MemoryBudget(auto=True)),
    *((given, MemoryBudget(fraction=fraction)) for given, fraction in (
        (1, 1.0), (1.0, 1.0), ("1", 1.0), (0.5, 0.5), ("0.5", 0.5), (" 0.25 ", 0.25))),
    *((given, MemoryBudget(nbytes=nbytes)) for given, nbytes in (
        (2, 2), (12 * GIB, 12 * GIB), ("12GiB", 12 * GIB), ("512 MB", 512_000_000), ("0B", 0),
        ("2048B", 2048))),
])
def test_memory_budget_forms(budget, resolved):
    """A number without a unit is a fraction, a size or a Python int above 1 is bytes: read once
    into one typed record, which parses to itself and reads back from its text."""
    value = StormConfig.from_options(memory_budget=budget).memory_budget
    assert value == resolved
    assert type(value.fraction) is (float if resolved.fraction is not None else type(None))
    assert MemoryBudget.parse(value) is value
    again = str(value) if value.given else None
    assert StormConfig.from_options(memory_budget=again).memory_budget == value


def test_a_byte_budget_is_planned_less_its_margin_and_other_forms_as_given():
    """Storm plans a byte budget's peak :data:`PEAK_MARGIN` below it, once: the planned budget
    plans as itself; fractions and "auto" are planned as given; a margin outside [0, 1) is an
    option error."""
    planned = MemoryBudget.parse("1000000B").planned
    assert planned.nbytes == int(1000000 * (1 - PEAK_MARGIN)) < 1000000
    assert planned.planned == planned
    for given in (MemoryBudget.parse(0.5), MemoryBudget.parse("auto"), MemoryBudget()):
        assert given.planned == given
    with pytest.raises(StormOptionError, match="margin"):
        MemoryBudget(nbytes=100, margin=1.0)


def test_memory_budget_one_form():
    """A budget is one form: a record setting two, or a config given an unparsed value, is an
    option error."""
    with pytest.raises(StormOptionError, match="more than one form"):
        MemoryBudget(auto=True, nbytes=2)
    with pytest.raises(StormOptionError, match="build the config with from_options"):
        StormConfig(memory_budget=0.5)


FRACTION = "a number without a unit is a fraction, which must be in (0, 1]"
NEEDS_UNIT = "a number without a unit is a fraction in (0, 1]: give bytes with a unit"


@pytest.mark.parametrize("budget, problem", [
    (True, "a bool is not a budget"), (False, "a bool is not a budget"),
    (0, FRACTION), (0.0, FRACTION),
    ("0", FRACTION), (-1, FRACTION),
    (-0.5, FRACTION), ("-0.5", FRACTION),
    (1.5, FRACTION), (2.5e9, FRACTION),
    ("2048", NEEDS_UNIT), ("1e3", NEEDS_UNIT),
    (float("nan"), "not a finite number"), (float("inf"), "not a finite number"),
    (float("-inf"), "not a finite number"), ("nan", "not a finite number"),
    ("inf", "not a finite number"), ("-inf", "not a finite number"),
    ("12 parsecs", "unknown size unit 'parsecs'"), ("-1GiB", "not a number, a size or 'auto'"),
    ("", "not a number, a size or 'auto'"), ("half", "not a number, a size or 'auto'"),
    ([0.5], "a list is not a budget"),
])
def test_bad_memory_budget_names_value_and_accepted_forms(budget, problem):
    with pytest.raises(StormOptionError) as error:
        storm(memory_budget=budget)
    message = str(error.value)
    assert message.startswith(f"storm option 'memory_budget': cannot use {budget!r}: {problem}")
    assert f"Accepted forms: {'; '.join(BUDGET_FORMS)}" in message


@pytest.mark.parametrize("overhead", [float("nan"), float("inf"), float("-inf"), -0.1, True,
                                      "0.05", None])
def test_bad_max_overhead(overhead):
    with pytest.raises(StormOptionError, match=r"storm option 'max_overhead': expected a finite "
                                               r"fraction >= 0 \(0.02 is 2 %\), got "):
        storm(max_overhead=overhead)


@pytest.mark.parametrize("overhead", [0, 0.05, 1])
def test_max_overhead_accepts_finite_fractions(overhead):
    assert StormConfig.from_options(max_overhead=overhead).max_overhead == overhead


def test_default_host_memory_is_shared_among_local_ranks(monkeypatch):
    monkeypatch.delenv(LOCAL_RANKS_ENV, raising=False)
    alone = StormConfig.from_options().host_memory_limit
    assert alone == int(physical_memory_bytes() * HOST_MEMORY_FRACTION)
    monkeypatch.setenv(LOCAL_RANKS_ENV, "4")
    assert StormConfig.from_options().host_memory_limit == int(alone / 4)
    assert StormConfig.from_options(host_memory_limit="1GiB").host_memory_limit == GIB


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_bad_local_world_size_is_an_option_error(monkeypatch, value):
    monkeypatch.setenv(LOCAL_RANKS_ENV, value)
    with pytest.raises(StormOptionError, match="LOCAL_WORLD_SIZE"):
        StormConfig.from_options()
