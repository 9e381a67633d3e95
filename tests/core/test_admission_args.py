"""fleetgate.admission: a permit's weight, priority and tenant checked (errors name the argument)
and encoded as the Lua scripts read them (round trips). Pure functions, no Redis."""

from __future__ import annotations

import pytest

from fleetgate.admission import (
    MAX_PRIORITY,
    MAX_TENANT_WEIGHT,
    MIN_PRIORITY,
    TenantWeights,
    class_member,
    decode_tenant_weights,
    encode_tenant_weights,
    lane_class,
    member_id,
    parse_lane_class,
    parse_waiter_member,
    validate_priority,
    validate_tenant,
    validate_tenant_weights,
    validate_weight,
    waiter_member,
    weight_of,
    weighted_id,
)
from fleetgate.errors import ConfigError
from fleetgate.keys import validate_gate_name

# ------------------------------------------------------------------------------ validation


def test_constants() -> None:
    assert (MIN_PRIORITY, MAX_PRIORITY, MAX_TENANT_WEIGHT) == (-100, 100, 1000)


@pytest.mark.parametrize("weight", [1, 2, 512, 10**6])
def test_weight_ok(weight: int) -> None:
    assert validate_weight(weight) == weight


@pytest.mark.parametrize("weight", [0, -1, True, False, 1.0, "2", None, 2.5])
def test_weight_refused_names_the_argument(weight: object) -> None:
    with pytest.raises(ConfigError, match=r"^weight: expected int >= 1, got "):
        validate_weight(weight)


def test_weight_above_the_ceiling_can_never_be_granted() -> None:
    assert validate_weight(8, ceiling=8) == 8
    with pytest.raises(ConfigError) as info:
        validate_weight(9, ceiling=8)
    message = str(info.value)
    assert message.startswith("weight: 9 is above the gate's ceiling (8)")
    assert "can never be granted on this gate" in message


@pytest.mark.parametrize("priority", [-100, -1, 0, 1, 100])
def test_priority_ok(priority: int) -> None:
    assert validate_priority(priority) == priority


@pytest.mark.parametrize("priority", [-101, 101, True, 1.0, "1", None])
def test_priority_refused_names_the_argument(priority: object) -> None:
    with pytest.raises(ConfigError, match=r"^priority: expected int in \[-100, 100\], got "):
        validate_priority(priority)


@pytest.mark.parametrize("tenant", [None, "a", "search", "team/a b", "ü" * 100, "x" * 200])
def test_tenant_ok(tenant: str | None) -> None:
    assert validate_tenant(tenant) == tenant


@pytest.mark.parametrize(
    ("tenant", "message"),
    [
        ("", "tenant must not be empty (None is the default tenant)"),
        (3, "tenant must be a string, got int"),
        (b"a", "tenant must be a string, got bytes"),
        ("a{b", "tenant 'a{b' contains '{': braces and control characters are not allowed"),
        ("a}b", "tenant 'a}b' contains '}'"),
        ("a\nb", "tenant 'a\\nb' contains '\\n'"),
        (
            "x" * 201,
            "tenant 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx'... is longer than 200 bytes",
        ),
        ("\udc80", "tenant '\\udc80' is not valid Unicode text"),
    ],
)
def test_tenant_refused_names_the_argument(tenant: object, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate_tenant(tenant)
    assert str(info.value).startswith(message)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("", "gate name must not be empty"),
        (3, "gate name must be a string, got int"),
        ("a{b}", "gate name 'a{b}' contains '{': braces and control characters are not allowed"),
        ("x" * 201, "gate name 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx'... is longer than 200"),
        ("\udc80", "gate name '\\udc80' is not valid Unicode text"),
    ],
)
def test_gate_name_errors_unchanged(name: object, message: str) -> None:
    """Tenant names share the gate-name rules; the gate-name messages stay as they were."""
    with pytest.raises(ConfigError) as info:
        validate_gate_name(name)
    assert str(info.value).startswith(message)


def test_tenant_weights_validated() -> None:
    tw = validate_tenant_weights({"b": 2, "a": MAX_TENANT_WEIGHT})
    assert isinstance(tw, TenantWeights) and list(tw.items()) == [("a", 1000), ("b", 2)]
    assert validate_tenant_weights(tw) is tw
    with pytest.raises(ConfigError, match=r"^tenant_weights\['a'\]: expected int"):
        validate_tenant_weights(TenantWeights({"a": 0}))  # built unchecked, checked here
    assert validate_tenant_weights({}) == TenantWeights()
    for bad, message in (
        ({"a": 0}, "tenant_weights['a']: expected int in [1, 1000], got 0"),
        ({"a": 1.0}, "tenant_weights['a']: expected int in [1, 1000], got 1.0"),
        ({"a{": 1}, "tenant_weights['a{']: tenant 'a{' contains '{'"),
        (None, "tenant_weights: expected a mapping of tenant name -> int, got NoneType"),
    ):
        with pytest.raises(ConfigError) as info:
            validate_tenant_weights(bad)
        assert str(info.value).startswith(message)


# --------------------------------------------------------------------------------- encoding


def test_lane_class() -> None:
    assert lane_class(0, None) == ""
    assert lane_class(0, "search") == "100}search"
    assert lane_class(10, None) == "090}"
    assert lane_class(100, "a") == "000}a"
    assert lane_class(-100, "a") == "200}a"
    assert lane_class(-5, None) == "105}"


def test_lane_class_orders_higher_priority_first() -> None:
    classes = [lane_class(p, "t") for p in range(MIN_PRIORITY, MAX_PRIORITY + 1)]
    assert sorted(classes) == classes[::-1]
    assert all(len(c.partition("}")[0]) == 3 for c in classes)


@pytest.mark.parametrize("priority", [-100, -1, 0, 1, 7, 100])
@pytest.mark.parametrize("tenant", [None, "a", "team/x y"])
def test_lane_class_round_trip(priority: int, tenant: str | None) -> None:
    assert parse_lane_class(lane_class(priority, tenant)) == (priority, tenant)


def test_waiter_member() -> None:
    assert waiter_member(0, None, 7, "pa:17") == "}100}00000000000000000007}pa:17"
    assert waiter_member(10, "search", 12, "pa:17w8") == "search}090}00000000000000000012}pa:17w8"


def test_waiter_members_sort_by_priority_then_arrival_within_a_tenant() -> None:
    """Lex order (Python's str order is Redis' byte order for these) groups a tenant's waiters
    (``tenant}`` prefix), highest priority first, then by arrival."""
    arrivals = [(0, "b"), (5, "a"), (0, "a"), (5, "a"), (-3, None), (7, None), (-3, "a")]
    members = [waiter_member(p, t, seq, f"p:{seq}") for seq, (p, t) in enumerate(arrivals, 1)]
    order = [parse_waiter_member(m)[:3] for m in sorted(members)]
    by_tenant: dict[str | None, list[tuple[int, int]]] = {}
    for p, t, seq in order:
        by_tenant.setdefault(t, []).append((p, seq))
    assert by_tenant == {
        "a": [(5, 2), (5, 4), (0, 3), (-3, 7)],
        "b": [(0, 1)],
        None: [(7, 6), (-3, 5)],
    }
    tenants = [parse_waiter_member(m)[1] for m in sorted(members)]
    assert tenants == sorted(tenants, key=lambda t: (t or "") + "}")  # contiguous per tenant


@pytest.mark.parametrize(
    ("priority", "tenant", "seq", "lease_id"),
    [(0, None, 0, "p:1"), (-100, "a", 10**19, "pod-x:99w3"), (100, "t/z", 5, "h:1")],
)
def test_waiter_member_round_trip(
    priority: int, tenant: str | None, seq: int, lease_id: str
) -> None:
    member = waiter_member(priority, tenant, seq, lease_id)
    assert parse_waiter_member(member) == (priority, tenant, seq, lease_id)


@pytest.mark.parametrize("priority", [-100, -1, 0, 1, 100])
@pytest.mark.parametrize("tenant", [None, "a", "team/x y"])
def test_class_member_is_the_waiter_member(priority: int, tenant: str | None) -> None:
    member = class_member(lane_class(priority, tenant), 42, "pa:7w3")
    assert member == waiter_member(priority, tenant, 42, "pa:7w3")
    assert member_id(member) == "pa:7w3"


def test_tenant_weights_encoding() -> None:
    assert encode_tenant_weights({}) == ""
    assert encode_tenant_weights({"b": 2, "a": 10, "c": 1}) == "a}10}b}2}c}1"
    assert encode_tenant_weights(TenantWeights({"b": 2, "a": 10})) == "a}10}b}2"
    assert TenantWeights({"b": 2, "a": 10}).encoded == "a}10}b}2"


@pytest.mark.parametrize(
    "mapping", [{}, {"a": 1}, {"z": 1000, "a b": 3, "ü": 2}, {f"t{i}": i + 1 for i in range(50)}]
)
def test_tenant_weights_round_trip(mapping: dict[str, int]) -> None:
    assert decode_tenant_weights(encode_tenant_weights(mapping)) == mapping


def test_tenant_weights_decode_refuses_odd_fields() -> None:
    with pytest.raises(ValueError, match="pairs"):
        decode_tenant_weights("a}1}b")


def test_tenant_weights_mapping() -> None:
    tw = TenantWeights({"b": 2, "a": 3})
    assert tw == {"a": 3, "b": 2} and tw == TenantWeights([("a", 3), ("b", 2)])
    assert hash(tw) == hash(TenantWeights({"a": 3, "b": 2}))
    assert tw != {"a": 3} and tw != TenantWeights()
    assert tw["a"] == 3 and len(tw) == 2 and "b" in tw and tw.get("c", 1) == 1
    assert repr(tw) == "TenantWeights({'a': 3, 'b': 2})"
    assert (tw == 3) is False


@pytest.mark.parametrize("weight", [1, 2, 3, 48, 1000, 10**6])
@pytest.mark.parametrize("base", ["pa:17", "pod-1.ns:0", "a:b:c:99"])
def test_weighted_id_round_trip(base: str, weight: int) -> None:
    lease_id = weighted_id(base, weight)
    assert weight_of(lease_id) == weight
    assert lease_id == (base if weight == 1 else f"{base}w{weight}")


@pytest.mark.parametrize(
    ("lease_id", "weight"),
    [
        ("pa:17", 1),
        ("pa:17w8", 8),
        ("pawn:17", 1),  # a 'w' in the pod id is not a weight
        ("p:w8", 1),  # no sequence number before the w
        ("p:1w", 1),
        ("p17w8", 1),  # no ':'
        ("p:1w８", 1),  # non-ASCII digits
        ("x:1w2:3", 1),
    ],
)
def test_weight_of(lease_id: str, weight: int) -> None:
    assert weight_of(lease_id) == weight
