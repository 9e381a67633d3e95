"""The protocol's decoders: a wake and an acquire reply, each value given one meaning
(``fleetgate.protocol.decode_wake``, ``fleetgate.scripts.AcquireReply.decode``). What the
scripts send is tested against a real server in tests/lua; this is the wire grammar itself."""

from __future__ import annotations

import pytest

from fleetgate.protocol import GRANTED_WAKE, AcquireStatus, Wake, WakeNews, decode_wake
from fleetgate.scripts import AcquireReply


@pytest.mark.parametrize(
    ("wake", "news"),
    [
        ("pod-1:7=42", WakeNews("pod-1:7", GRANTED_WAKE, 42)),
        ("pod-1:7b090w2t500=x", WakeNews("pod-1:7b090w2t500", Wake.EVICTED, 0)),
        ("p:1=c4", WakeNews("p:1", Wake.TOO_HEAVY, 4)),
        ("p:1=k4000", WakeNews("p:1", Wake.TOO_MANY_TOKENS, 4000)),
        ("p:1=s2", WakeNews("p:1", Wake.OVER_SHARE, 2)),
        ("p:1=q9", None),  # a code the grammar has no word for
        ("p:1=c", None),  # a refusal without its bound
        ("=5", None),  # no id
        ("p:1", None),  # no value
    ],
)
def test_a_wake_decodes_to_one_meaning(wake: str, news: WakeNews | None) -> None:
    assert decode_wake(wake) == news


SHARED = (32, 10_000, 30_000, 0)  # limit, lease_ms, waiter_ms, fence_ms


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        ((1, 77, 5, 9_000, -1), {"fencing_token": 77, "holders": 5, "seq": 0}),
        ((2, 78, 3, 9_000, 1_500), {"seq": 78, "position": 3, "expected_wait_ms": 1_500}),
        ((0, 2_500, 100, 0, -1), {"bound": 100, "retry_after_ms": 2_500, "fencing_token": 0}),
        ((3, 0, 4, 0, -1), {"bound": 4, "retry_after_ms": 0}),
        ((7, 0, 1_800, 0, 600), {"expected_wait_ms": 1_800, "expected_hold_ms": 600, "bound": 0}),
        ((5, 0, 16, 0, -1), {"bound": 16, "expected_wait_ms": -1}),
    ],
)
def test_an_acquire_reply_names_each_value_by_its_meaning(
    row: tuple[int, ...], expected: dict[str, int]
) -> None:
    reply = AcquireReply.decode(row, *SHARED)
    assert reply.status == AcquireStatus(row[0])
    assert (reply.limit, reply.lease_ms, reply.waiter_ms) == SHARED[:3]
    assert {k: getattr(reply, k) for k in expected} == expected


def test_the_deprecated_names_keep_their_old_meaning() -> None:
    granted = AcquireReply.decode((1, 77, 5, 9_000, -1), *SHARED)
    parked = AcquireReply.decode((2, 78, 3, 9_000, 1_500), *SHARED)
    full = AcquireReply.decode((0, 2_500, 100, 0, -1), *SHARED)
    late = AcquireReply.decode((7, 0, 1_800, 0, 600), *SHARED)
    assert (granted.token, parked.token, full.token) == (77, 78, 2_500)
    assert (full.max_queued, late.max_queued) == (100, 1_800)
    assert (parked.estimate_ms, late.estimate_ms) == (1_500, 600)
