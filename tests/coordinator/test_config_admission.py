"""The coordinator config's admission keys (max_queued_per_tenant, shed_below, tenant_weights):
decoding, the settings they reach, errors naming the field, the documented examples."""

from __future__ import annotations

import pytest

from fleetgate.coordinator.config import GateConfig
from fleetgate.errors import ConfigError

from ._config import BASE, EXAMPLE, error_of, parse

ADMISSION_GATE = """\
[[gates]]
name = "llm"
floor = 8
max_queued = 1000
max_queued_per_tenant = 200
shed_below = -10

[gates.tenant_weights]
search = 3
batch = 1
"weird name/with space" = 1000
"""


def test_admission_keys_decode_and_reach_the_settings() -> None:
    gate = parse(ADMISSION_GATE).gates[0]
    assert gate.max_queued_per_tenant == 200 and gate.shed_below == -10
    assert dict(gate.tenant_weights) == {"search": 3, "batch": 1, "weird name/with space": 1000}
    s = gate.settings
    assert (s.max_queued_per_tenant, s.shed_below) == (200, -10)
    assert s.as_cfg()["tenant_weights"] == "batch}1}search}3}weird name/with space}1000"
    assert s.argv()[5:] == [
        200, -10, "", "", 1, "", "", "batch}1}search}3}weird name/with space}1000"
    ]  # fmt: skip


def test_a_token_budget_decodes_and_reaches_the_settings() -> None:
    gate = parse(BASE + "token_limit = 120000\ntoken_ceiling = 200000\n").gates[-1]
    assert (gate.settings.token_limit, gate.settings.token_ceiling) == (120_000, 200_000)
    assert gate.settings.as_cfg()["token_limit"] == 120_000
    assert parse(BASE).gates[0].settings.as_cfg()["token_limit"] == ""  # unset: deleted
    with pytest.raises(ConfigError, match="token_ceiling: 5 without a token_limit"):
        parse(BASE + "token_ceiling = 5\n")
    with pytest.raises(ConfigError, match=r"token_ceiling: expected >= token_limit \(50\)"):
        parse(BASE + "token_limit = 50\ntoken_ceiling = 5\n")
    with pytest.raises(ConfigError, match="token_limit"):
        parse(BASE + "token_limit = 0\n")


def test_admission_keys_default() -> None:
    gate = parse(BASE).gates[0]
    assert (gate.max_queued_per_tenant, gate.shed_below, dict(gate.tenant_weights)) == (None, 0, {})
    assert gate.settings.as_cfg()["max_queued_per_tenant"] == ""  # unset: deleted by publish


def test_config_with_tenant_weights_stays_hashable() -> None:
    config = parse(ADMISSION_GATE)
    assert hash(config) == hash(parse(ADMISSION_GATE))


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        (
            "max_queued_per_tenant = 200",
            "max_queued_per_tenant = -1",
            "gates[0].max_queued_per_tenant: expected int >= 0, got -1",
        ),
        (
            "max_queued_per_tenant = 200",
            'max_queued_per_tenant = "200"',
            "gates[0].max_queued_per_tenant: expected int | null, got str",
        ),
        ("shed_below = -10", "shed_below = -101", "gates[0].shed_below: expected int >= -100"),
        ("shed_below = -10", "shed_below = 101", "gates[0].shed_below: expected int <= 100"),
        ("shed_below = -10", "shed_below = 1.5", "gates[0].shed_below: expected int, got float"),
        (
            "search = 3",
            "search = 0",
            "gates[0].tenant_weights['search']: expected int in [1, 1000]",
        ),
        (
            "search = 3",
            "search = 1001",
            "gates[0].tenant_weights['search']: expected int in [1, 1000], got 1001",
        ),
        ("search = 3", 'search = "3"', "gates[0].tenant_weights['search']: expected int, got str"),
        (
            "search = 3",
            "search = true",
            "gates[0].tenant_weights['search']: expected int, got bool",
        ),
        (
            "search = 3",
            '"a b{" = 3',
            "gates[0].tenant_weights['a b{']: tenant 'a b{' contains '{': braces and control "
            "characters are not allowed",
        ),
        ("search = 3", '"" = 3', "gates[0].tenant_weights['']: tenant must not be empty"),
        (
            "search = 3",
            '"a\\tb" = 3',
            "gates[0].tenant_weights['a\\tb']: tenant 'a\\tb' contains '\\t'",
        ),
        (
            "[gates.tenant_weights]",
            "[gates.tenant_weight]",
            "gates[0].tenant_weight: unknown field (did you mean 'tenant_weights'?)",
        ),
        ("shed_below = -10", "shedbelow = -10", "gates[0].shedbelow: unknown field (did you mean"),
    ],
)
def test_admission_errors_name_the_field(old: str, new: str, expected: str) -> None:
    assert old in ADMISSION_GATE
    assert error_of(ADMISSION_GATE.replace(old, new, 1)).startswith(expected)


def test_tenant_weights_shape_and_size() -> None:
    gate = '[[gates]]\nname = "x"\nfloor = 1\n'
    assert (
        error_of(gate + "tenant_weights = [1]")
        == "gates[0].tenant_weights: expected table, got array"
    )
    assert (
        error_of(gate + "tenant_weights = 3") == "gates[0].tenant_weights: expected table, got int"
    )
    many = "\n".join(f"t{i} = 1" for i in range(10_001))
    assert error_of(gate + "[gates.tenant_weights]\n" + many) == (
        "gates[0].tenant_weights: at most 10000 tenants, got 10001"
    )
    ok = "\n".join(f"t{i} = 1" for i in range(10_000))
    assert len(parse(gate + "[gates.tenant_weights]\n" + ok).gates[0].tenant_weights) == 10_000


def test_structs_validate_admission_keys_when_built_directly() -> None:
    with pytest.raises(ConfigError, match=r"^tenant_weights\['a\{'\]: tenant 'a\{' contains"):
        GateConfig(name="x", floor=1, tenant_weights={"a{": 2})
    gate = GateConfig(name="x", floor=1, tenant_weights={"b": 2, "a": 1})
    assert list(gate.tenant_weights) == ["a", "b"] and hash(gate)


def test_documented_admission_example_decodes() -> None:
    """The commented admission keys of example.toml and deploy/coordinator.toml are valid
    once uncommented."""
    root = EXAMPLE.parent.parent
    for path in (EXAMPLE, root / "deploy" / "coordinator.toml"):
        lines = path.read_text().splitlines()
        keys = ("max_queued_per_tenant", "shed_below", "[gates.tenant_weights]", "search", "batch")
        out = [
            line[2:] if line.startswith("# ") and line[2:].startswith(keys) else line
            for line in lines
        ]
        assert out != lines, path
        gate = parse("\n".join(out)).gate("bge-m3")
        assert gate.max_queued_per_tenant == 200 and gate.shed_below == 0
        assert gate.tenant_weights["search"] == 3


def test_deadline_admission_by_the_start_or_the_end_of_the_call() -> None:
    assert parse(BASE).gates[0].settings.argv()[9] == 1  # on, by the start
    gate = parse(BASE + 'deadline_admission = "finish"\n').gates[-1]
    assert gate.settings.as_cfg()["deadline_admission"] == 2
    assert parse(BASE + "deadline_admission = false\n").gates[-1].settings.argv()[9] == 0
    with pytest.raises(ConfigError, match="deadline_admission"):
        parse(BASE + 'deadline_admission = "end"\n')


def test_revoke_after_decodes_and_reaches_the_settings() -> None:
    assert parse(BASE).gates[0].settings.as_cfg()["revoke_after_ms"] == ""  # never
    gate = parse(BASE + "revoke_after = 2.5\n").gates[-1]
    assert gate.settings.revoke_after == 2.5 and gate.settings.as_cfg()["revoke_after_ms"] == 2500
    with pytest.raises(ConfigError, match="revoke_after"):
        parse(BASE + "revoke_after = 0.01\n")
