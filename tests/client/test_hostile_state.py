"""Bad input: fuzzed configuration and gate names, and hostile state planted in Redis.

Contracts checked here:

* the config decoder raises only :class:`ConfigError` (one line, no traceback) whatever the text
  or structure;
* a gate name is either accepted -- and then forms keys with exactly one ``{...}`` hash tag -- or
  refused with :class:`ConfigError`;
* keys of the wrong type or garbled values in Redis give the client a prompt error or the
  documented fallback (never a hung caller), and the coordinator keeps running, names the bad key
  in its log and recovers by itself once the key is deleted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import redis.asyncio as aredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from fleetgate.client import Fleet
from fleetgate.coordinator.config import Config
from fleetgate.coordinator.daemon import Coordinator
from fleetgate.errors import ConfigError
from fleetgate.keys import MAX_GATE_NAME_BYTES, GateKeys, validate_gate_name
from fleetgate.safety import find_bad_keys
from fleetgate.tools.redisproc import RedisProcess
from fleetgate.tools.sim import serve_in_thread

from .._stub import StubValues, metrics_stub

pytestmark = pytest.mark.usefixtures("no_gc_during_test")


# ------------------------------------------------------------------------ config decoder fuzz

_KEYS = [
    "redis", "url", "prefix", "coordinator", "poll_interval", "poll_jitter", "leader_ttl",
    "metrics_listen", "target_ttl_polls", "scrape_timeout", "max_body_bytes", "adaptive",
    "gates", "name", "floor", "ceiling", "max_queued", "lease_ms", "waiter_ms", "base_url",
    "metrics_url", "model_name", "server",
]  # fmt: skip
_SCALARS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.text(max_size=30),
    st.sampled_from(
        [
            "redis://127.0.0.1:6379/0",
            "rediss://u:p@h:1/0?ssl_ca_certs=/x",
            "redis://h:notaport/0",
            "http://m/v1",
            "http://u:pw@m/metrics",
            "ftp://m/metrics",
            "127.0.0.1:0",
            "[::1]:99999",
            "vllm",
            "a{b}",
            "",
        ]
    ),
)
_KEY = st.one_of(st.sampled_from(_KEYS), st.text(max_size=8))
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(_KEY, inner, max_size=5)),
    max_leaves=20,
)


def _toml_value(value: Any) -> str:
    """A TOML rendering of ``value`` (possibly invalid TOML: the decoder must cope)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value).replace("inf", "inf").replace("nan", "nan")
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return "{" + ", ".join(f'"{k}" = {_toml_value(v)}' for k, v in value.items()) + "}"


@st.composite
def toml_ish(draw: st.DrawFn) -> str:
    """Section headers, key = value lines and raw junk, in any order."""
    lines = []
    for _ in range(draw(st.integers(0, 12))):
        kind = draw(st.integers(0, 4))
        if kind == 0:
            lines.append(f"[{draw(st.sampled_from(['redis', 'coordinator', 'x']))}]")
        elif kind == 1:
            lines.append("[[gates]]")
        elif kind == 2:
            lines.append(f"{draw(st.sampled_from(_KEYS))} = {_toml_value(draw(_VALUES))}")
        elif kind == 3:
            lines.append(draw(st.text(max_size=40)))
        else:
            lines.append(f'"{draw(st.text(max_size=6))}" = {_toml_value(draw(_SCALARS))}')
    return "\n".join(lines)


def _only_config_errors(call: Callable[[], object]) -> None:
    try:
        call()
    except ConfigError as exc:
        text = str(exc)
        assert text and text.isprintable(), text
        assert "Traceback" not in text


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(toml_ish())
def test_config_text_fuzz_only_config_errors(text: str) -> None:
    _only_config_errors(lambda: Config.from_toml_text(text, env={}))
    _only_config_errors(
        lambda: Config.from_toml_text(text.encode("utf-8", "surrogatepass"), env={})
    )


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(_KEY, _VALUES, max_size=4))
def test_config_structure_fuzz_only_config_errors(raw: dict[str, Any]) -> None:
    _only_config_errors(lambda: Config.from_mapping(raw, env={}))


@settings(max_examples=200, deadline=None)
@given(
    st.fixed_dictionaries(
        {"name": st.text(max_size=12), "floor": _SCALARS},
        optional={k: _VALUES for k in ("ceiling", "max_queued", "metrics_url", "server")},
    ),
    st.dictionaries(
        st.sampled_from(
            ["FLEETGATE_REDIS_URL", "FLEETGATE_POLL_INTERVAL", "FLEETGATE_ADAPTIVE",
             "KG_ADAPTIVE_CONCURRENCY", "MODEL_MAX_CONCURRENCY", "FLEETGATE_METRICS_LISTEN"]
        ),
        st.text(max_size=12),
        max_size=3,
    ),
)  # fmt: skip
def test_gate_tables_and_env_fuzz_only_config_errors(
    gate: dict[str, Any], env: dict[str, str]
) -> None:
    _only_config_errors(lambda: Config.from_mapping({"gates": [gate]}, env=env))


# ------------------------------------------------------------------------------ gate names

_ANY_TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=80)


def _check_name(name: str) -> None:
    try:
        accepted = validate_gate_name(name)
    except ConfigError:
        return
    assert accepted == name
    key = GateKeys.of("fg", name).holders
    assert key.count("{") == 1 and key.count("}") == 1, key
    assert key == f"fg:{{{name}}}:holders"
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


# --------------------------------------------------------------- wrong types planted in Redis


@pytest.fixture
async def r(own_redis: RedisProcess) -> AsyncIterator[aredis.Redis]:
    client = aredis.Redis.from_url(own_redis.url, decode_responses=True)
    yield client
    await client.aclose()


async def _acquire_outcome(fleet: Fleet, gate: str) -> str:
    """What one acquire does within 3 s: 'granted', or the exception's class and message."""
    start = time.monotonic()
    try:
        async with asyncio.timeout(3):
            async with fleet.gate(gate, floor=2).permit(deadline=2.0):
                pass
        outcome = "granted"
    except TimeoutError as exc:
        outcome = f"HUNG {exc!r}"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    assert time.monotonic() - start < 2.5, f"caller held for {time.monotonic() - start:.1f}s"
    return outcome


Plant = Callable[[aredis.Redis, GateKeys], Awaitable[object]]
PLANTS: dict[str, tuple[str, Plant]] = {
    "holders-as-string": ("holders", lambda r, k: r.set(k.holders, "x")),
    "waiters-as-hash": ("waiters", lambda r, k: r.hset(k.waiters, "a", "1")),
    "cfg-as-list": ("cfg", lambda r, k: r.rpush(k.cfg, "floor", "4")),
    "seq-as-set": ("seq", lambda r, k: r.sadd(k.seq, "1")),
    "target-as-string": ("target", lambda r, k: r.set(k.target, "9")),
}


@pytest.mark.parametrize("plant", sorted(PLANTS))
async def test_wrong_type_gives_the_caller_a_prompt_error(
    own_redis: RedisProcess, r: aredis.Redis, plant: str, caplog: pytest.LogCaptureFixture
) -> None:
    attr, do = PLANTS[plant]
    keys = GateKeys.of("fg", "g")
    await do(r, keys)
    async with Fleet(own_redis.url, registry=CollectorRegistry(), heartbeat_interval=0.2) as fleet:
        outcome = await _acquire_outcome(fleet, "g")
        # A FleetgateError that names the gate and the key (it was redis-py's ResponseError,
        # verbatim, naming neither); find_bad_keys (the coordinator's log, `fleetgate check`)
        # names it too.
        assert outcome.startswith("GateStateError: gate 'g'"), outcome
        assert getattr(keys, attr) in outcome and "WRONGTYPE" in outcome, outcome
        findings = await find_bad_keys(r, "fg", ["g"])
        assert [f.code for f in findings] == ["wrong_type"]
        assert getattr(keys, attr) in findings[0].message and "DEL" in findings[0].message
        # Deleting the key heals the gate at once.
        await r.delete(getattr(keys, attr))
        assert await _acquire_outcome(fleet, "g") == "granted"


async def test_broken_registry_does_not_stop_lease_renewal(
    own_redis: RedisProcess, r: aredis.Redis
) -> None:
    await r.set("fg:gates", "x")
    async with Fleet(own_redis.url, registry=CollectorRegistry(), heartbeat_interval=0.1) as fleet:
        gate = fleet.gate("g", floor=1, lease_ms=500, waiter_ms=500)
        lease = await gate.acquire()
        await asyncio.sleep(1.5)  # three lease lifetimes
        held = await r.zscore(GateKeys.of("fg", "g").holders, lease.id)
        renewed = held is not None and held > time.time() * 1000
        await lease.release()
    assert renewed or lease.is_lost, "the lease lapsed silently: the cap no longer counts it"


async def test_garbled_cfg_falls_back_to_safe_values(
    own_redis: RedisProcess, r: aredis.Redis
) -> None:
    """Non-numbers in cfg: the documented fallback (the caller's defaults, then safe values)."""
    keys = GateKeys.of("fg", "g")
    await r.hset(keys.cfg, mapping={"floor": "abc", "ceiling": "", "max_queued": "nan"})
    async with Fleet(own_redis.url, registry=CollectorRegistry()) as fleet:
        assert await _acquire_outcome(fleet, "g") == "granted"
        snap = await fleet.gate("g").snapshot()
        assert (snap.floor, snap.max_queued) == (2, 1000) and snap.ceiling >= 2
    findings = await find_bad_keys(r, "fg", ["g"])
    assert sorted(f.message.split()[2].split("=")[0] for f in findings) == [
        "ceiling",
        "floor",
        "max_queued",
    ]


async def _grants_within(fleet: Fleet, gate: str, n: int) -> int:
    """How many of ``n`` concurrent permits of a floor-2 gate are granted within 0.5 s."""
    g = fleet.gate(gate, floor=2, ceiling=2)
    leases = []
    for _ in range(n):
        try:
            leases.append(await g.acquire(deadline=0.3))
        except Exception:
            break
    for lease in leases:
        await lease.release()
    return len(leases)


@pytest.mark.parametrize("value", ["inf", "1e400", "-inf", "nan"])
async def test_non_finite_cfg_falls_back(
    own_redis: RedisProcess, r: aredis.Redis, value: str
) -> None:
    """lib.lua's num() ignores NaN and infinities (Lua's tonumber accepts 'inf' and '1e400'):
    the cap holds and leases still expire."""
    keys = GateKeys.of("fg", "g")
    await r.hset(keys.cfg, mapping={"floor": value, "lease_ms": value})
    async with Fleet(own_redis.url, registry=CollectorRegistry()) as fleet:
        granted = await _grants_within(fleet, "g", 4)
        lease = await fleet.gate("g").acquire(deadline=1)
        expiry = await r.zscore(keys.holders, lease.id)
        await lease.release()
    assert granted <= 2, f"floor={value} in cfg lifted the cap: {granted} of 4 granted"
    assert expiry is not None and expiry < time.time() * 1000 + 3_600_000, "a lease forever"


async def test_absurd_finite_cfg_falls_back(own_redis: RedisProcess, r: aredis.Redis) -> None:
    keys = GateKeys.of("fg", "g")
    await r.hset(keys.cfg, mapping={"floor": "1e18", "lease_ms": "1e18"})
    async with Fleet(own_redis.url, registry=CollectorRegistry()) as fleet:
        granted = await _grants_within(fleet, "g", 4)
        lease = await fleet.gate("g").acquire(deadline=1)
        expiry = await r.zscore(keys.holders, lease.id)
        await lease.release()
    assert granted <= 2 and expiry is not None and expiry < time.time() * 1000 + 86_400_000


async def test_nan_target_falls_back_to_the_floor(own_redis: RedisProcess, r: aredis.Redis) -> None:
    keys = GateKeys.of("fg", "g")
    await r.hset(keys.target, mapping={"value": "nan", "epoch": "1", "expires_at": "1e15"})
    async with Fleet(own_redis.url, registry=CollectorRegistry()) as fleet:
        assert await _acquire_outcome(fleet, "g") == "granted"


async def test_garbled_cfg_is_reported_and_never_hangs(
    own_redis: RedisProcess, r: aredis.Redis
) -> None:
    """Callers are answered at once, and ``find_bad_keys`` (coordinator log, ``fleetgate
    check``) names the field."""
    keys = GateKeys.of("fg", "g")
    await r.hset(keys.cfg, mapping={"floor": "1e400"})
    async with Fleet(own_redis.url, registry=CollectorRegistry()) as fleet:
        outcome = await _acquire_outcome(fleet, "g")
    assert outcome == "granted" or outcome.startswith("GateStateError"), outcome
    [finding] = await find_bad_keys(r, "fg", ["g"])
    assert "floor='1e400' is not finite" in finding.message


# ------------------------------------------------------------- the coordinator keeps running

POLL = 0.2


def _config(url: str) -> Config:
    return Config.from_toml_text(
        f"""
[redis]
url = "{url}"
[coordinator]
poll_interval = {POLL}
poll_jitter = 0.0
leader_ttl = 1.0
metrics_listen = "127.0.0.1:0"
scrape_timeout = 0.1
[[gates]]
name = "good"
floor = 3
[[gates]]
name = "bad"
floor = 5
""",
        env={},
    )


@asynccontextmanager
async def _running(url: str) -> AsyncIterator[Coordinator]:
    coord = Coordinator(_config(url), registry=CollectorRegistry(), reap_interval=0.1)
    stop = asyncio.Event()
    task = asyncio.create_task(coord.run(stop))
    try:
        yield coord
        assert not task.done(), "the coordinator stopped by itself"
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def _until(check: Callable[[], Awaitable[object]], timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def _planted_then_healed(
    url: str, r: aredis.Redis, caplog: pytest.LogCaptureFixture, bad_keys: list[str]
) -> None:
    """Run a coordinator against the planted keys: it keeps running, logs each bad key without
    flooding the log, and heals every gate once the keys are deleted."""
    caplog.set_level(logging.INFO, logger="fleetgate")
    async with _running(url):
        await asyncio.sleep(1.0)  # several polls, sweeps and campaigns against the bad keys
        errors = [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
        assert errors, "the bad keys went unnoticed"
        # Throttled: one line per distinct error, not one per poll (5/s) or sweep (10/s).
        assert len(errors) <= 12, [rec.getMessage()[:120] for rec in errors]
        for key in bad_keys:
            assert key in caplog.text, f"{key} not named in the log"
        await r.delete(*bad_keys)
        await _until(lambda: r.exists("fg:leader"), 5, "a leader")
        for name, floor in (("bad", "5"), ("good", "3")):
            cfg = GateKeys.of("fg", name).cfg
            await _until(lambda c=cfg, f=floor: _eq(r.hget(c, "floor"), f), 5, f"{name} published")
            await _until(lambda n=name: r.sismember("fg:gates", n), 5, f"{name} registered")


async def test_coordinator_survives_bad_fleet_keys(
    own_redis: RedisProcess, r: aredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    await r.hset("fg:epoch", "x", "1")  # INCR fails: no term can be confirmed
    await r.set("fg:gates", "x")  # SADD/SMEMBERS fail: registry and reaper
    await _planted_then_healed(own_redis.url, r, caplog, ["fg:epoch", "fg:gates"])


async def test_one_broken_gate_does_not_stop_the_others(
    own_redis: RedisProcess, r: aredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    bad, good = GateKeys.of("fg", "bad"), GateKeys.of("fg", "good")
    await r.set(bad.holders, "x")  # in-flight count and every script of the gate fail
    await r.rpush(bad.util, "x")  # the warm-failover state cannot be read nor written
    await r.rpush(bad.cfg, "x")  # the gate's configuration cannot be published

    async def good_published() -> bool:
        return await r.hget(good.cfg, "floor") == "3" and await r.exists(good.util) == 1

    async with _running(own_redis.url):
        await _until(good_published, 5, "the good gate published despite the bad one")
    await _planted_then_healed(own_redis.url, r, caplog, [bad.holders, bad.util, bad.cfg])


async def _eq(value: Awaitable[object], expected: object) -> bool:
    return await value == expected


async def test_coordinator_leader_key_of_wrong_type_stands_by_then_leads(
    own_redis: RedisProcess, r: aredis.Redis
) -> None:
    await r.hset("fg:leader", "x", "1")
    async with _running(own_redis.url) as coord:
        await asyncio.sleep(0.8)
        assert not _leads(coord)  # nobody can win while the key is there
        await r.delete("fg:leader")
        await _until(lambda: _true(_leads(coord)), 5, "leadership")


async def _true(value: bool) -> bool:
    return value


def _leads(coord: Coordinator) -> bool:
    return coord._election is not None and coord.election.is_leader


async def test_corrupt_target_epoch_does_not_make_the_leader_flap(
    own_redis: RedisProcess, r: aredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """A stored target epoch above every epoch ever issued (planted, or fg:epoch reset) must
    not depose every leader forever: the leader keeps leading and names the gate."""
    caplog.set_level(logging.INFO, logger="fleetgate")
    bad = GateKeys.of("fg", "llm")
    await r.hset(bad.target, mapping={"value": "7", "epoch": "999999", "expires_at": "0"})
    with serve_in_thread(metrics_stub(StubValues(running=1))) as served:
        cfg = Config.from_toml_text(
            f"""
[redis]
url = "{own_redis.url}"
[coordinator]
poll_interval = {POLL}
poll_jitter = 0.0
leader_ttl = 1.0
metrics_listen = "127.0.0.1:0"
scrape_timeout = 0.1
[[gates]]
name = "llm"
floor = 2
metrics_url = "{served.url}/metrics"
""",
            env={},
        )
        coord = Coordinator(cfg, registry=CollectorRegistry())
        stop = asyncio.Event()
        task = asyncio.create_task(coord.run(stop))
        try:
            await _until(lambda: _true(_leads(coord)), 5, "leadership")
            term = coord.election.term
            await asyncio.sleep(8 * POLL)  # several refused publishes
            assert coord.election.is_leader, "stepped down because of a corrupt stored epoch"
            assert coord.election.term is not None and term is not None
            assert coord.election.term.epoch == term.epoch
            assert "stepping down" not in caplog.text
            assert "target refused although no epoch above" in caplog.text
            # Once the corrupt target is deleted, the leader publishes again.
            await r.delete(bad.target)
            await _until(lambda: r.hexists(bad.target, "value"), 5, "a published target")
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)
