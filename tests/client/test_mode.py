"""The client's mode as one state machine (``client._mode``): every transition, and what the
fleet reads of it."""

from __future__ import annotations

import pytest

from fleetgate.client._mode import TRANSITIONS, ClientMode, Event, Mode

EVENTS: tuple[Event, ...] = ("answered", "outage", "writable", "resumed", "close")


def at(mode: Mode) -> ClientMode:
    """A ClientMode brought to ``mode`` by the events that lead there."""
    path: dict[Mode, tuple[Event, ...]] = {
        Mode.CONNECTING: (),
        Mode.FLEET: ("answered",),
        Mode.FALLBACK: ("answered", "outage"),
        Mode.RECOVERING: ("answered", "outage", "writable"),
        Mode.CLOSING: ("close",),
    }
    m = ClientMode()
    for event in path[mode]:
        assert m.fire(event)
    assert m.mode is mode
    return m


@pytest.mark.parametrize("start", list(Mode))
@pytest.mark.parametrize("event", EVENTS)
def test_every_event_in_every_mode(start: Mode, event: Event) -> None:
    m = at(start)
    changed = m.fire(event)
    want = TRANSITIONS.get((start, event), start)
    assert m.mode is want and changed == (want is not start)


def test_an_outage_and_the_way_back() -> None:
    m = ClientMode()
    assert (m.fallback_active, m.recovering, m.reached) == (False, False, False)
    assert m.fire("answered") and m.reached and m.mode is Mode.FLEET
    assert m.fire("outage") and m.fallback_active and not m.recovering
    assert not m.fire("outage")  # a second failed call: the same outage
    # PING answers but writes wait (CLIENT PAUSE WRITE): nothing changes until a write answers
    assert m.fire("writable") and m.fallback_active and m.recovering
    assert m.fire("outage") and not m.recovering  # failed again while adopting: local again
    assert m.fire("writable") and m.fire("resumed")
    assert m.mode is Mode.FLEET and not m.fallback_active


def test_a_pod_that_never_reached_redis_falls_back_and_closes_from_there() -> None:
    m = ClientMode()
    assert m.fire("outage") and m.fallback_active and not m.reached
    assert not m.fire("answered") and m.reached  # the first contact answers late: a fact
    assert m.fire("close") and m.closing
    assert m.fallback_active  # closing from the fallback: nothing is listed in the registry
    assert not m.fire("resumed") and not m.fire("outage") and m.closing  # final


def test_closing_from_fleet_mode_is_not_a_fallback() -> None:
    m = at(Mode.FLEET)
    assert m.fire("close") and m.closing and not m.fallback_active
