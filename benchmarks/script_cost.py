"""script_cost: server time of each gate script vs queue length, 10 -> 100,000 parked waiters.

One gate per queue length n (10 ... 100,000) is filled directly with the acquire script
(pipelined, ids of 10 fake pods, waiter and lease TTLs of an hour so nothing expires; one
permanent holder and limit 1, so every acquire parks). Then rounds visit every gate in turn, each
visit two pipelines of 50 pairs that leave n unchanged:

* ``acquire (park) + cancel``: a fresh id parks at the tail and leaves the queue again;
* ``release + hand-off + acquire (park)``: the holder releases, the script hands the slot to the
  head waiter (the lane from `fair`, its head from `lanes`, ZREM x2, ZADD, RPUSH + PEXPIRE of its
  pod's wake list), and a fresh id parks at the tail.

The scripts run as the client runs them: functions of the gate library (FUNCTION LOAD once, an
FCALL per call; ``fleetgate.scripts.gate_library``). Each pipeline is framed by INFO
commandstats, so the ``fcall`` usec delta is the server time of exactly those scripts (their
internal commands included), free of client and network noise, and the other commands'
``calls`` deltas are the Redis commands those scripts ran (:func:`commands_run`, printed and
stored per script call); every size runs the same batch shape, so CPU caches and frequency are
alike. Figures are medians
over the pipelines (robust to the server being preempted by other processes). Growth factor =
µs at the largest n / µs at n=10 (target <= 1.5, i.e. O(log n)). At the largest n the heartbeat
is timed too, carrying k of one pod's waiters (its cost is O(k log n)), and every round times
``inspect`` with n=0 per size, the read `fleetgate status` makes per gate (counts only, nothing
listed: its growth must stay O(log n) as well).
Server-side only: the parser/event-loop flavor does not change these figures.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

import numpy as np
import redis

from fleetgate.admission import class_member
from fleetgate.keys import GateKeys
from fleetgate.scripts import lib_source
from fleetgate.settings import GateSettings

from ._common import (
    Headline,
    Options,
    figure,
    log,
    save,
    table,
)
from ._server import (
    configure_gate,
    library_functions,
    private_redis,
)

NAME = "script_cost"
GATE = "bench-script-cost"
PODS = 10
HOUR_MS = 3_600_000
# acquire's default settings (the gate is configured already: they are never read)
_SETTINGS = GateSettings(
    floor=1, ceiling=1, max_queued=10**7, lease_ms=HOUR_MS, waiter_ms=HOUR_MS
).argv()
GROWTH_TARGET = 1.5
KINDS = ("acquire (park) + cancel", "release + hand-off + acquire (park)")
CHUNK = 50  # pairs per pipeline
STATUS = "inspect n=0 (status)"
PARK, CANCEL, RELEASE = "acquire (park)", "cancel", "release + hand-off"
# What the scripts' own commands are counted without (INFO commandstats deltas): the calls that
# run them and the INFO that frames them.
NOT_RUN_BY_SCRIPTS = frozenset({"cmdstat_fcall", "cmdstat_evalsha", "cmdstat_eval", "cmdstat_info"})


def commands_run(before: dict[str, Any], after: dict[str, Any]) -> int:
    """The Redis commands run between two INFO commandstats replies, less the script calls
    themselves (FCALL, EVALSHA, EVAL) and the INFO: what the scripts called inside."""
    return sum(
        int(v["calls"]) - int(before.get(k, {"calls": 0})["calls"])
        for k, v in after.items()
        if k not in NOT_RUN_BY_SCRIPTS
    )


class Bench:
    """One gate of a given queue length: its keys, the FIFO order of the ids we parked."""

    def __init__(self, r: redis.Redis, scripts: dict[str, Any], keys: GateKeys) -> None:
        self.r, self.s, self.gate = r, scripts, keys
        self.keys = keys.script_keys()
        self.queue: deque[str] = deque()
        #: parked id -> its waiter member (what cancel and the heartbeat name it by)
        self.members: dict[str, str] = {}
        self.holder = "holder:0"
        self.seq = 0
        #: label -> Redis commands per call (or per pair), one figure per timed pipeline
        self.commands: dict[str, list[float]] = {}
        assert self.s["acquire"](keys=self.keys, args=self.acq_args(self.holder))[5] == 1

    @staticmethod
    def acq_args(wid: str) -> list[Any]:
        # the default settings, no fence, no release, no report, one request of the default class
        return [*_SETTINGS, 0, 0, 0, wid, HOUR_MS, ""]

    def note_parked(self, ids: list[str], replies: list[Any]) -> None:
        for wid, reply in zip(ids, replies, strict=True):
            self.members[wid] = class_member("", int(reply[6]), wid)

    def new_id(self) -> str:
        self.seq += 1
        return f"fake{self.seq % PODS}:{self.seq}"

    def timed(
        self, calls: Iterable[tuple[str, list[Any]]], label: str | None = None, per: int = 1
    ) -> tuple[float, int]:
        """Run script calls in one pipeline framed by INFO; (fcall usec, calls) in between."""
        usec, n, _ = self.timed_replies(calls, label, per)
        return usec, n

    def timed_replies(
        self, calls: Iterable[tuple[str, list[Any]]], label: str | None = None, per: int = 1
    ) -> tuple[float, int, list[Any]]:
        """:meth:`timed`, and the calls' replies. With a ``label``, the Redis commands the
        scripts ran per ``per`` calls (:func:`commands_run`) are noted in :attr:`commands`."""
        with self.r.pipeline(transaction=False) as p:
            p.info("commandstats")
            n = 0
            for name, args in calls:
                self.s[name](keys=self.keys, args=args, client=p)
                n += 1
            p.info("commandstats")
            out = p.execute()
        a, b = out[0]["cmdstat_fcall"], out[-1]["cmdstat_fcall"]
        assert b["calls"] - a["calls"] == n, "a script call failed"
        if label is not None:
            self.commands.setdefault(label, []).append(commands_run(out[0], out[-1]) * per / n)
        return float(b["usec"] - a["usec"]), n, out[1:-1]

    def fill(self, n: int) -> None:
        while len(self.queue) < n:
            ids = [self.new_id() for _ in range(min(2000, n - len(self.queue)))]
            _, _, replies = self.timed_replies(("acquire", self.acq_args(i)) for i in ids)
            self.note_parked(ids, replies)
            self.queue.extend(ids)

    def park_cancel(self, m: int) -> float:
        """µs per pair: a fresh id parks at the tail and leaves again (length unchanged). The
        cancels name the waiter members the parks' replies gave: two pipelines."""
        ids = [self.new_id() for _ in range(m)]
        usec, n, replies = self.timed_replies((("acquire", self.acq_args(w)) for w in ids), PARK)
        self.note_parked(ids, replies)
        usec2, n2 = self.timed((("cancel", [w, self.members.pop(w)]) for w in ids), CANCEL)
        return 2 * (usec + usec2) / (n + n2)

    def release_handoff(self, m: int) -> float:
        """µs per pair: the holder releases (the head is granted), a fresh id parks at the tail."""
        calls: list[tuple[str, list[Any]]] = []
        ids = []
        for _ in range(m):
            wid = self.new_id()
            ids.append(wid)
            calls += [("release", [0, self.holder]), ("acquire", self.acq_args(wid))]
            self.holder = self.queue.popleft()
            self.members.pop(self.holder, None)
            self.queue.append(wid)
        usec, n, replies = self.timed_replies(calls, KINDS[1], per=2)
        self.note_parked(ids, replies[1::2])
        return 2 * usec / n

    def heartbeat(self, k: int, reps: int) -> float:
        """µs per heartbeat of pod fake0 carrying k of its parked waiters."""
        mine = [w for w in self.queue if w.startswith("fake0:")][:k]
        assert len(mine) == k, "queue too short for this heartbeat"
        args: list[Any] = ["fake0", 60_000, 0, len(mine)]
        for w in mine:
            args += [self.members[w], HOUR_MS]
        usec, n = self.timed((("heartbeat", args) for _ in range(reps)), f"heartbeat, {k} waiters")
        return usec / n

    def inspect(self, m: int) -> float:
        """µs per ``inspect`` with n=0 (what `fleetgate status` runs per gate)."""
        usec, n = self.timed((("inspect", [0]) for _ in range(m)), STATUS)
        return usec / n

    def sanity(self) -> None:
        assert self.r.zcard(self.gate.waiters) == len(self.queue)
        assert self.r.zrange(self.gate.holders, 0, -1) == [self.holder]


def prelude_us(r: redis.Redis, calls: int, pipelines: int = 5) -> dict[str, float]:
    """Server µs per EVALSHA call of an empty script and of the library (``lib_source()``, the
    ``lib_*.lua`` parts; labelled ``lib.lua``) + an empty script: their difference is what
    every call paid to re-run the library's top level when the gate
    scripts were sent by EVALSHA, and what the gate library (FCALL) no longer pays."""
    lib = lib_source()
    out: dict[str, float] = {}
    for name, source in (("empty", "return 1"), ("lib.lua", f"{lib}\nreturn 1")):
        sha = r.script_load(source)
        per: list[float] = []
        for _ in range(pipelines):
            with r.pipeline(transaction=False) as p:
                p.info("commandstats")
                for _ in range(calls):
                    p.evalsha(sha, 1, "fg:{bench-prelude}")
                p.info("commandstats")
                got = p.execute()
            none = {"usec": 0, "calls": 0}
            a, b = got[0].get("cmdstat_evalsha", none), got[-1]["cmdstat_evalsha"]
            per.append((b["usec"] - a["usec"]) / (b["calls"] - a["calls"]))
        out[name] = float(np.median(per))
    return out


def commands_per_call(b: Bench) -> dict[str, float]:
    """The Redis commands the scripts of ``b``'s timed pipelines ran, median per call (per pair
    for the release pair), by label; and ``release + hand-off``: that pair less a park."""
    out = {label: float(np.median(v)) for label, v in b.commands.items()}
    if KINDS[1] in out and PARK in out:
        out[RELEASE] = out[KINDS[1]] - out[PARK]
    return out


def _measure(url: str, opts: Options) -> dict[str, Any]:
    sizes = (10, 100, 1_000, 10_000, 100_000)
    rounds = opts.pick(100, 20)
    r = redis.Redis.from_url(url, decode_responses=True)
    scripts = library_functions(r, ("acquire", "release", "cancel", "heartbeat", "inspect"))
    benches: dict[int, Bench] = {}
    for n in sizes:
        keys = configure_gate(
            url,
            f"{GATE}-{n}",
            floor=1,
            ceiling=1,
            max_queued=10**7,
            lease_ms=HOUR_MS,
            waiter_ms=HOUR_MS,
        )
        benches[n] = Bench(r, scripts, keys)
        benches[n].fill(n)
    log(f"{NAME}: filled gates of {', '.join(f'{n:,}' for n in sizes)} waiters")
    # Rounds visit every size in turn, so noise from other processes hits all sizes alike.
    per: dict[int, dict[str, list[float]]] = {n: {k: [] for k in KINDS} for n in sizes}
    status: dict[int, list[float]] = {n: [] for n in sizes}
    for i in range(rounds):
        for n, b in benches.items():
            per[n][KINDS[0]].append(b.park_cancel(CHUNK))
            per[n][KINDS[1]].append(b.release_handoff(CHUNK))
            status[n].append(b.inspect(CHUNK))
        if (i + 1) % max(1, rounds // 4) == 0:
            log(f"{NAME}: round {i + 1}/{rounds}")
    rows: list[dict[str, Any]] = []
    for n, b in benches.items():
        b.sanity()
        rows.append(
            {
                "queue": n,
                "encoding": r.object("encoding", b.gate.lanes),
                **{k: float(np.median(v)) for k, v in per[n].items()},
                STATUS: float(np.median(status[n])),
                "mean": {k: float(np.mean(v)) for k, v in per[n].items()},
                "p90_over_pipelines": {k: float(np.percentile(v, 90)) for k, v in per[n].items()},
                "commands_per_call": commands_per_call(b),
            }
        )
    reps = opts.pick(200, 40)
    hb = {k: benches[sizes[-1]].heartbeat(k, reps) for k in (0, 10, 100, 250, 1000)}
    hb_commands = {
        k: v for k, v in commands_per_call(benches[sizes[-1]]).items() if k.startswith("heartbeat")
    }
    prelude = prelude_us(r, opts.pick(2000, 500))
    r.close()
    return {
        "evalsha_prelude_us": prelude,
        "sizes": rows,
        "heartbeat_us_by_waiters": hb,
        "heartbeat_commands_by_waiters": hb_commands,
        "heartbeat_queue": sizes[-1],
        "pairs_per_pipeline": CHUNK,
        "pipelines_per_size": rounds,
    }


def _commands_table(res: dict[str, Any]) -> str:
    """Redis commands per script call (the scripts' own, the FCALL not counted), at the
    smallest and the largest queue, and the heartbeat's at the largest."""
    first, last = res["sizes"][0], res["sizes"][-1]
    labels = (PARK, CANCEL, KINDS[1], RELEASE, STATUS)
    rows: list[tuple[Any, ...]] = [
        (k, first["commands_per_call"][k], last["commands_per_call"][k]) for k in labels
    ]
    rows += [(k, "-", v) for k, v in res["heartbeat_commands_by_waiters"].items()]
    head = ("Redis commands per script call", f"n={first['queue']:,}", f"n={last['queue']:,}")
    return table(head, rows)


def run(opts: Options) -> list[Headline]:
    with private_redis() as rp:
        res = _measure(rp.url, opts)
        rows = res["sizes"]
        first, last = rows[0], rows[-1]
        growth = {k: last[k] / first[k] for k in KINDS}
        res["growth"] = growth
        res["status_growth"] = status_growth = last[STATUS] / first[STATUS]
        text = table(
            ("queue", "encoding", *(f"{k} µs" for k in (*KINDS, STATUS))),
            [(r["queue"], r["encoding"], *(r[k] for k in (*KINDS, STATUS))) for r in rows],
        )
        text += "\n" + table(
            ("", *KINDS), [(f"growth {first['queue']}->{last['queue']}", *growth.values())]
        )
        text += f"\n{STATUS}: growth {first['queue']}->{last['queue']} {status_growth:.2f}x"

        hb = res["heartbeat_us_by_waiters"]
        text += "\n" + table(
            (f"heartbeat at n={res['heartbeat_queue']}: waiters carried", "µs", "µs / waiter"),
            [(k, v, v / k if k else "-") for k, v in hb.items()],
        )
        text += "\n" + _commands_table(res)
        pre = res["evalsha_prelude_us"]
        text += (
            f"\nlib.lua's top level per EVALSHA call (no longer paid by FCALL): "
            f"{pre['lib.lua'] - pre['empty']:.1f} µs (empty script {pre['empty']:.1f} µs)"
        )
        fig, ax = figure(2)
        xs = [r["queue"] for r in rows]
        for k, style in zip(KINDS, ("o-", "s-"), strict=True):
            ax[0][0].plot(xs, [r[k] for r in rows], style, label=k)
        ax[0][0].plot(xs, [2 * r[STATUS] for r in rows], "^-", label=f"2 x {STATUS}")
        ax[0][0].set_xscale("log")
        ax[0][0].set_ylim(bottom=0)
        ax[0][0].set_xlabel("parked waiters (queue length)")
        ax[0][0].set_ylabel("server µs per pair of script calls")
        ax[0][0].legend()
        ax[0][1].plot(list(hb), list(hb.values()), "o-")
        ax[0][1].set_xlabel(f"waiters carried by one heartbeat (queue {res['heartbeat_queue']:,})")
        ax[0][1].set_ylabel("server µs per heartbeat")
        fig.suptitle("gate script cost (INFO commandstats, fcall usec/call)")
        save(NAME, opts, rp.url, res, text, fig)
    worst = max(growth.values())
    return [
        Headline(
            NAME,
            f"growth {first['queue']}->{last['queue']:,} waiters, worst script",
            f"{worst:.2f}x",
            f"<= {GROWTH_TARGET}x",
            worst <= GROWTH_TARGET,
        ),
        Headline(NAME, "heartbeat carrying 1000 waiters", f"{hb[1000]:.0f} µs", "-", None),
        Headline(
            NAME,
            f"status read (inspect n=0) growth {first['queue']}->{last['queue']:,} waiters",
            f"{status_growth:.2f}x",
            f"<= {GROWTH_TARGET}x",
            status_growth <= GROWTH_TARGET,
        ),
    ]


if __name__ == "__main__":
    import sys

    from ._common import main

    sys.exit(main(only=[NAME]))
