"""The AIMD controller: one pure step per poll, state and signals in, new target and reason out.

No I/O and no clock reads: the caller passes ``now`` and whatever it observed, so the rule is
tested (and traced in ``docs/aimd.md``) without a server. The values the rule works on
(:class:`ControllerParams`, :class:`ControllerState`, :class:`Observation`, :class:`Decision`)
are defined in :mod:`.controller_types` and exported here too. The state is a msgspec struct the
leader stores in Redis after every step, so a standby that takes over continues where the old
leader stopped (warm failover). ``now`` must therefore come from a clock every leader shares --
Redis server time (``TIME``) or wall time, never ``time.monotonic()``.

The rule, per poll (constants in :class:`ControllerParams`; ``docs/aimd.md`` explains each).
``C`` is the capacity estimate: the level remembered where saturation was last seen (scaled by
the KV-cache estimate ``running / kv_cache_usage`` when both are known), else the KV-cache
estimate alone, else unknown; never above the request capacity the server states
(``max_requests``: llama.cpp's slots, NIM's ``num_request_max``, TensorRT-LLM's
``max_num_active_requests``), which alone stands in when nothing else is known.

1. adaptation off (or no metrics source)  -> ``static``: target = floor, never published.
2. saturated (capacity-waiting > 0, or preemptions since the last poll) -> ``decrease`` toward
   the level the engine sustains for us, ``min(running, in_flight - capacity_waiting)``,
   cutting by at most half; without a usable estimate to ``0.8*T``. At most once per drain
   period, else ``hold_cooldown``. Ends slow start; the new target is remembered as ``C``. A
   cut inside the drain period is allowed when the engine runs fewer than the target while
   queueing (its capacity is lower); a queue no larger than the fleet's excess over the target
   is that excess draining and never ends the period by time alone. A server that does not
   count undispatched requests (llama.cpp) queues what the fleet holds beyond what runs and
   waits, once every slot is busy.
   A **foreign** saturation -- the fleet holds nothing, less than ``fleet_share`` (1/2) of what
   the server runs, or less than the queue (it cannot relieve it) -- cuts to ``0.8*T`` once per
   saturated stretch and changes nothing learned (``C``, the KV estimate at saturation, slow
   start): load the fleet did not cause and cannot relieve says nothing of what the engine
   sustains for it.
3. signals unknown / scrape failed        -> ``hold_unknown`` (not re-published, so the published
   lease decays); after ``unknown_reset_polls`` such polls -> ``reset`` to floor and slow start
   (``C`` is kept, so the next ramp stops at it), the floor published once (the last target
   may outlive those polls: its lifetime includes a leader takeover).
4. near-full -- the server runs >= 0.8*T *and* the fleet holds >= 0.8*T (either alone when the
   other is unknown) -- and not saturated:
   * ``C`` known and above T -> ``min(2T, C)`` (``slow_start`` while doubling, ``increase`` when
     the estimate stops it): multiplicative far below ``C``, straight to it near it;
   * ``C`` known and T at or above it -> ``hold_capacity``; without a KV estimate, a ``probe``
     above it after ``probe_polls`` clean polls (+5 %, doubling per probe the engine used
     without queueing, up to +25 %), so a capacity grown without a KV signal is found -- never
     at or above a stated capacity, which also caps the probe;
   * ``C`` unknown -> ``slow_start`` (x2) before the first saturation, ``increase`` (+25 %) for a
     state stored by an older version; the first increase after a decrease needs
     ``recovery_polls`` near-full polls (``hold_hysteresis``).
5. otherwise                              -> ``hold_idle``.

The target is always clamped to [floor, ceiling]; when the bounds alone move or stop it, the
reason is ``clamp``.
"""

from __future__ import annotations

import math

import msgspec

from .control import Reason
from .controller_types import ControllerParams, ControllerState, Decision, Observation

__all__ = [
    "ControllerParams",
    "ControllerState",
    "Decision",
    "Observation",
    "Reason",
    "dump_state",
    "load_state",
    "restart_from_floor",
    "step",
    "unknown_poll",
]

_EPS = 1e-9  # so a product such as 0.29 * 100 = 28.999999999999996 does not floor one too low


def _clamp(value: int, params: ControllerParams) -> int:
    return max(params.floor, min(params.ceiling, value))


def _foreign(obs: Observation, p: ControllerParams) -> bool:
    """The queue is not the fleet's doing, or not the fleet's to relieve: it holds nothing, less
    than ``fleet_share`` of what the server runs, or less than the queue itself (dropping every
    permit it holds would leave the server queueing). False when the fleet's in-flight is
    unknown (the fleet's own rule applies)."""
    held = obs.in_flight
    if held is None or not math.isfinite(held):
        return False
    if held <= 0:
        return True
    queue = obs.waiting_capacity
    if queue is not None and math.isfinite(queue) and held < queue:
        return True
    running = obs.running
    return running is not None and math.isfinite(running) and held < p.fleet_share * running


def _may_decrease(
    state: ControllerState, obs: Observation, p: ControllerParams, now: float, foreign: bool
) -> bool:
    """One decrease per drain period: the period ends when the cut has taken effect. A foreign
    saturation cuts once per saturated stretch: cutting again would relieve nothing we hold."""
    if state.last_decrease is None:
        return True
    elapsed = now - state.last_decrease
    if elapsed < 0:  # the shared clock stepped back: do not let it block a needed cut
        return True
    if elapsed < p.min_decrease_polls * p.poll_interval:
        return False
    if foreign:
        return state.drained
    if obs.running is not None and obs.running < state.target:
        # Queueing while running fewer than the cut allows: the engine's capacity is below the
        # cut (it was still draining when the cut was measured). A measurement, not a second
        # punishment of the same excess.
        return True
    settled = obs.in_flight is not None and obs.in_flight <= state.target
    if state.drained or settled:
        return True
    # The engine runs the target and queues no more than the fleet holds above it: that is the
    # excess of before the cut, whose leases end only as their calls do (never revoked), so
    # however long it takes it is no sign the cut was too small; cutting again would only
    # learn a capacity below what the engine sustains.
    excess = None if obs.in_flight is None else obs.in_flight - state.target
    queue = obs.waiting_capacity
    if excess is not None and queue is not None and math.isfinite(excess) and queue <= excess:
        return False
    return elapsed >= p.drain_polls * p.poll_interval


def _sustainable(obs: Observation) -> float | None:
    """How many of our requests the saturated engine serves: the level a decrease aims for.

    Running counts every client of the engine; ``in_flight - capacity_waiting`` is our part of
    it when other traffic shares the engine (ours in flight = ours running + ours waiting). The
    smaller one wins. None when neither is known.
    """
    estimates: list[float] = []
    if obs.running is not None and math.isfinite(obs.running) and obs.running > 0:
        estimates.append(obs.running)
    if (
        obs.in_flight is not None
        and obs.waiting_capacity is not None
        and math.isfinite(obs.in_flight - obs.waiting_capacity)
    ):
        estimates.append(obs.in_flight - obs.waiting_capacity)
    return min(estimates) if estimates else None


def _kv_estimate(obs: Observation, p: ControllerParams) -> float | None:
    """How many requests like the running ones fit in the engine's KV cache: running / usage.

    None unless both are known and usage is at least ``kv_min`` (a few blocks of a large cache
    say little). Usage 1 gives ``running`` itself: full, no room beyond what runs.
    """
    kv, running = obs.kv_cache_usage, obs.running
    if kv is None or running is None or not (math.isfinite(kv) and math.isfinite(running)):
        return None
    if kv < p.kv_min or running < 1:
        return None
    estimate = running / min(kv, 1.0)
    return estimate if math.isfinite(estimate) else None  # an absurd gauge is no estimate


def _published(obs: Observation) -> float | None:
    """The request capacity the server states (at least 1), else None."""
    stated = obs.max_requests
    if stated is None or not math.isfinite(stated) or stated < 1:
        return None
    return stated


def _capacity(
    state: ControllerState, kv_estimate: float | None, published: float | None = None
) -> float | None:
    """The capacity estimate ``C``: the remembered saturation level, scaled by how the KV-cache
    estimate moved since (replicas added or removed), else the KV-cache estimate alone; never
    above the request capacity the server states, which alone stands in when nothing else is
    known."""
    if state.capacity is None:
        learned = kv_estimate
    elif kv_estimate is not None and state.kv_capacity:
        learned = state.capacity * kv_estimate / state.kv_capacity
    else:
        learned = state.capacity
    if published is None:
        return learned
    return published if learned is None else min(learned, published)


def _with_hidden_queue(
    obs: Observation, state: ControllerState, p: ControllerParams
) -> Observation:
    """A server that does not count requests not yet dispatched (llama.cpp answers ``/metrics``
    ahead of its queued tasks): when every slot is busy -- ``running`` at the stated slots, else
    at the capacity estimate -- what the fleet holds beyond what runs and waits is queued there.
    With a slot free the excess is a permit between two requests (a round trip), not a queue;
    with no capacity known (a cold start) nothing is inferred."""
    held, running = obs.in_flight, obs.running
    if not obs.hidden_queue or held is None or running is None:
        return obs
    waiting = obs.waiting_capacity or 0.0
    extra = held - running - waiting
    if not (math.isfinite(extra) and extra >= 1):
        return obs
    level = _published(obs) or _capacity(state, _kv_estimate(obs, p))
    if level is None or running < math.floor(level + _EPS):
        return obs
    return msgspec.structs.replace(obs, waiting_capacity=waiting + extra)


def _is_saturated(obs: Observation, p: ControllerParams) -> bool | None:
    """Capacity-waiting above the threshold, or preemptions since the last poll (the engine
    admitted more than it holds, whatever waits at the scrape's instant). None when the queue
    is unknown and nothing was preempted."""
    if obs.preempted is not None and math.isfinite(obs.preempted) and obs.preempted > 0:
        return True
    if obs.waiting_capacity is None:
        return None
    return obs.waiting_capacity > p.saturation_threshold


def _near_full(obs: Observation, target: int, p: ControllerParams) -> bool:
    """The server runs near the target and the fleet holds near it (each when known).

    The server's running count guards against a client-side bottleneck (the fleet holds its
    permits but the requests do not reach the engine: more permits would not be used); the
    fleet's in-flight count guards against an engine kept busy by other traffic.
    """
    level = p.near_full * target
    known = [v for v in (obs.running, obs.in_flight) if v is not None]
    return bool(known) and all(v >= level for v in known)


def step(
    state: ControllerState, obs: Observation | None, params: ControllerParams, now: float
) -> Decision:
    """Advance one gate's controller by one poll. Pure: same inputs, same decision.

    The branches of the rule (module docstring) in order: saturation cuts, an unknown view
    holds (then resets), a view that is not near full holds, near full grows.
    """
    p = params
    if not p.adaptive:
        return Decision(ControllerState.initial(p), p.floor, Reason.STATIC, publish=False)

    target = _clamp(state.target, p)
    clamped = target != state.target
    state = msgspec.structs.replace(state, target=target)
    sat: bool | None = None
    if obs is not None:
        obs = _with_hidden_queue(obs, state, p)
        sat = _is_saturated(obs, p)

    if obs is not None and sat:
        # Saturation acts even on a partial (not ok) view: it is proven, and a cut is safe.
        return _saturated(state, obs, p, now, clamped)
    if obs is None or not obs.ok or sat is None:
        return _unknown(state, p, sat)
    state = msgspec.structs.replace(state, drained=True, unknown_streak=0)
    if not _near_full(obs, target, p):
        new = msgspec.structs.replace(state, near_full_streak=0, probes=0)
        return _out(new, Reason.HOLD_IDLE, True, sat, clamped)
    return _grow(state, obs, p, bool(sat), clamped)


def _saturated(
    state: ControllerState, obs: Observation, p: ControllerParams, now: float, clamped: bool
) -> Decision:
    """The server queues: cut toward what it sustains (once per drain period), and remember
    where it saturated -- unless the queue is foreign (:func:`_foreign`): then the target is cut
    (the fallback 0.8, once per saturated stretch) and nothing is learned."""
    target = state.target
    foreign = _foreign(obs, p)
    if not _may_decrease(state, obs, p, now, foreign):
        new = msgspec.structs.replace(state, near_full_streak=0, unknown_streak=0, probes=0)
        return _out(new, Reason.HOLD_COOLDOWN, obs.ok, True, clamped)
    estimate = None if foreign else _sustainable(obs)  # the queue says nothing of our share
    if estimate is None or estimate >= target:
        cut = math.floor(target * p.decrease + _EPS)
    else:
        cut = max(math.floor(target * p.deepest_cut + _EPS), math.floor(estimate + _EPS))
    new_target = _clamp(min(cut, target - 1), p)
    memory: dict[str, object] = {"near_full_streak": 0, "unknown_streak": 0, "probes": 0}
    if not foreign:
        # Remember where the engine saturated: the level chosen now, and the KV-cache estimate
        # beside it, so a later KV reading says how far the capacity has moved since.
        memory |= {
            "capacity": float(new_target),
            "kv_capacity": _kv_estimate(obs, p),
            "slow_start": False,
        }
    if new_target >= target:  # already at the floor
        new = msgspec.structs.replace(state, **memory)
        return Decision(new, target, Reason.CLAMP, publish=True, saturated=True)
    new = msgspec.structs.replace(
        state,
        target=new_target,
        last_decrease=now,
        drained=False,
        # the hysteresis is for our own excess still in flight; a foreign cut left none
        recovering=state.recovering if foreign else True,
        **memory,
    )
    return Decision(new, new_target, Reason.DECREASE, publish=True, saturated=True)


def restart_from_floor(state: ControllerState, p: ControllerParams) -> ControllerState:
    """The state to continue from once the last published target has run out (the fleet is at
    the floor): the floor, with the capacity memory kept, so the next ramp stops at it instead
    of jumping back to a stale level or overshooting."""
    return ControllerState(target=p.floor, capacity=state.capacity, kv_capacity=state.kv_capacity)


def unknown_poll(state: ControllerState, p: ControllerParams) -> Decision:
    """A poll with no usable view of the server (see :func:`step`): held, unpublished; the
    floor after ``unknown_reset_polls`` of them. For a caller that could not run :func:`step`."""
    return _unknown(msgspec.structs.replace(state, target=_clamp(state.target, p)), p, None)


def _unknown(state: ControllerState, p: ControllerParams, sat: bool | None) -> Decision:
    """No usable view of the server: hold (not re-published, so the lease decays); after
    ``unknown_reset_polls`` such polls restart from the floor."""
    streak = state.unknown_streak + 1
    if streak >= p.unknown_reset_polls:
        # The last published target may still be live (it outlives a leader takeover:
        # CoordinatorSettings.target_ttl): the reset publishes the floor once, so a leader that
        # is blind to a server brings its fleet to the floor after these polls, not a takeover
        # later. (A target at the floor already, or never published, needs no write.)
        new = msgspec.structs.replace(restart_from_floor(state, p), unknown_streak=streak)
        first = streak == p.unknown_reset_polls
        reason = Reason.RESET if first else Reason.HOLD_UNKNOWN
        publish = first and state.target > p.floor
        return Decision(new, p.floor, reason, publish=publish, saturated=sat)
    new = msgspec.structs.replace(state, near_full_streak=0, unknown_streak=streak, probes=0)
    return Decision(new, state.target, Reason.HOLD_UNKNOWN, publish=False, saturated=sat)


def _grow(
    state: ControllerState, obs: Observation, p: ControllerParams, sat: bool, clamped: bool
) -> Decision:
    """Near full and not queueing: ramp toward the remembered capacity, probe above it (only
    without a KV estimate), or grow as classic AIMD before any capacity is known."""
    target = state.target
    streak = state.near_full_streak + 1
    kv_estimate = _kv_estimate(obs, p)
    published = _published(obs)
    capacity = _capacity(state, kv_estimate, published)
    probes = 0
    if capacity is not None and math.floor(capacity + _EPS) > target:
        # Below the estimate: double while far below it, then straight to it.
        grown = min(math.floor(target * p.slow_start_factor + _EPS), math.floor(capacity + _EPS))
        reason = Reason.SLOW_START if grown < capacity else Reason.INCREASE
    elif capacity is not None:
        # A KV estimate follows the capacity by itself (it is measured whatever the load), so
        # with one there is nothing to probe for, nor above what the server states it admits;
        # otherwise wait probe_polls clean polls.
        stated = published is not None and target >= math.floor(published + _EPS)
        if kv_estimate is not None or stated or (state.probes == 0 and streak < p.probe_polls):
            new = msgspec.structs.replace(state, near_full_streak=streak, probes=0)
            return _out(new, Reason.HOLD_CAPACITY, True, sat, clamped)
        if state.probes > 0 and obs.running is not None and obs.running <= capacity:
            # The last probe's permits did not reach the engine: no proof of room yet.
            new = msgspec.structs.replace(state, near_full_streak=streak)
            return _out(new, Reason.HOLD_CAPACITY, True, sat, clamped)
        # No signal of the capacity: probe above the estimate, a little at first, faster while
        # the probes stay clean (the engine runs more than C: it has grown); the first
        # saturation ends it.
        fraction = min(p.increase, p.probe * 2**state.probes)
        grown = target + max(1, math.floor(target * fraction + _EPS))
        if published is not None:
            grown = min(grown, math.floor(published + _EPS))
        reason = Reason.PROBE
        probes = state.probes + 1
    else:
        if state.recovering and streak < p.recovery_polls:
            new = msgspec.structs.replace(state, near_full_streak=streak)
            return _out(new, Reason.HOLD_HYSTERESIS, True, sat, clamped)
        if state.slow_start:
            grown = max(target + 1, math.floor(target * p.slow_start_factor + _EPS))
            reason = Reason.SLOW_START
        else:
            grown = target + max(1, math.floor(target * p.increase + _EPS))
            reason = Reason.INCREASE
    new_target = _clamp(grown, p)
    if new_target == target:  # already at the ceiling
        reason = Reason.CLAMP
        probes = 0
    new = msgspec.structs.replace(
        state, target=new_target, recovering=False, near_full_streak=streak, probes=probes
    )
    return Decision(new, new_target, reason, publish=True, saturated=sat)


def _out(
    state: ControllerState, reason: Reason, publish: bool, sat: bool | None, clamped: bool
) -> Decision:
    """A hold: the reason becomes ``clamp`` when only the bounds moved the target."""
    return Decision(state, state.target, Reason.CLAMP if clamped else reason, publish, sat)


_STATE_DECODER = msgspec.json.Decoder(ControllerState)


def dump_state(state: ControllerState) -> bytes:
    """Serialise ``state`` (JSON) for the leader to store in Redis."""
    return msgspec.json.encode(state)


def load_state(
    data: bytes | str | None, params: ControllerParams, *, lapsed: bool = False
) -> ControllerState:
    """The stored state, clamped to ``params``; a fresh state if absent or unreadable.

    A corrupt or foreign value must not stop the new leader, and a cold start is always safe.
    ``lapsed``: the gate's last published target has run out (every coordinator was down for
    longer than its TTL): the fleet is at the floor, so the state restarts there
    (:func:`restart_from_floor`) instead of handing a backlog the old target in one poll.
    """
    if not data:
        return ControllerState.initial(params)
    try:
        state = _STATE_DECODER.decode(data)
    except msgspec.DecodeError:
        return ControllerState.initial(params)
    if lapsed:
        return restart_from_floor(state, params)
    return msgspec.structs.replace(state, target=_clamp(state.target, params))
