"""Gate names, fuzzed: a name is either accepted -- and then forms keys with exactly one
``{...}`` hash tag -- or refused with :class:`ConfigError`, whatever its code points."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.crc import key_slot

from fleetgate.errors import ConfigError
from fleetgate.keys import (
    MAX_GATE_NAME_BYTES,
    GateKeys,
    gate_group,
    name_problem,
    validate_gate_name,
)

_ANY_TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=80)


def _check_name(name: str) -> None:
    try:
        accepted = validate_gate_name(name)
    except ConfigError:
        return
    assert accepted == name
    key = GateKeys.of("fg", name).holders
    assert key.count("{") == 1 and key.count("}") == 1, key
    group = gate_group(name)
    if group is None:
        assert key == f"fg:{{{name}}}:holders"
    else:  # a grouped name: the group is the hash tag
        assert name.startswith(f"{{{group}}}") and key == f"fg:{name}:holders"
        assert group and name_problem(group, "group") is None
    assert 0 < len(name.encode("utf-8")) <= MAX_GATE_NAME_BYTES
    assert not any(ord(c) < 0x20 or ord(c) == 0x7F for c in name)


@settings(max_examples=500, deadline=None)
@given(st.one_of(st.text(max_size=250), st.text(st.sampled_from("ab{}:/ \x00\x7f\n"), max_size=9)))
def test_gate_names_accepted_form_one_hash_tag_or_config_error(name: str) -> None:
    _check_name(name)


def test_gate_name_with_lone_surrogate_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        validate_gate_name("gate\ud800")


@settings(max_examples=300, deadline=None)
@given(_ANY_TEXT.filter(lambda s: not any(0xD800 <= ord(c) <= 0xDFFF for c in s)))
def test_gate_names_any_code_point(name: str) -> None:
    _check_name(name)


def test_non_string_gate_names() -> None:
    for bad in (None, 3, b"bytes", ["x"]):
        with pytest.raises(ConfigError, match="must be a string"):
            validate_gate_name(bad)


def test_grouped_names_share_their_group_slot() -> None:
    """``{group}rest`` (grouped gate names): every key of every gate of a group in the group's
    slot; plain names keep their own tag."""
    a, b = GateKeys.of("fg", "{pool}chat"), GateKeys.of("fg", "{pool}embed")
    assert a.base == "fg:{pool}chat" and a.holders == "fg:{pool}chat:holders"
    slots = {key_slot(k.encode()) for keys in (a, b) for k in [keys.base, *keys.declared_keys()]}
    assert slots == {key_slot(b"pool")}
    assert a.wake("pod:1") == "fg:{pool}chat:wake:pod:1"
    assert GateKeys.of("fg", "chat").base == "fg:{chat}"
    assert gate_group("{pool}chat") == "pool" and gate_group("chat") is None


@pytest.mark.parametrize("bad", ["{}chat", "{pool}", "{pool}a}b", "{po{ol}chat", "{pool", "a{b}c"])
def test_malformed_grouped_names_are_refused(bad: str) -> None:
    with pytest.raises(ConfigError):
        validate_gate_name(bad)
