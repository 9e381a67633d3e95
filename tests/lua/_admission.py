"""Shared by the admission tests: units held as the scripts count them, a sampler of them,
settings published as the coordinator does, and the check that nothing of a lane is left."""

from __future__ import annotations

import multiprocessing as mp
import re
import threading
import time

import redis
import redis.asyncio as aredis

from fleetgate.keys import GateKeys
from fleetgate.scripts import GateScripts

ctx = mp.get_context("spawn")


def banded(lease_id: str, priority: int) -> str:
    """``lease_id`` ('<pod>:<n>[w<W>][t<T>]') with the band tag a call of ``priority`` carries
    (fleetgate.admission.weighted_id): 'b<100 - priority>' after '<pod>:<n>', none for 0."""
    if priority == 0:
        return lease_id
    return re.sub(r"(:[0-9]+)((?:w[0-9]+)?(?:t[0-9]+)?)\Z", rf"\1b{100 - priority:03d}\2", lease_id)


def units(r: redis.Redis, keys: GateKeys) -> int:
    """Units held as the scripts count them, read atomically."""
    pipe = r.pipeline(transaction=True)
    pipe.zcard(keys.holders)
    pipe.hget(keys.adm, "extra")
    n, extra = pipe.execute()
    return int(n) + int(extra or 0)


class Sampler:
    """Reads the units held every ~2 ms in a thread; ``peak`` is the highest seen."""

    def __init__(self, url: str, keys: GateKeys) -> None:
        self.r = redis.Redis.from_url(url, decode_responses=True)
        self.keys = keys
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, units(self.r, self.keys))
            self.samples += 1
            time.sleep(0.002)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.r.close()


async def publish_cfg(url: str, keys: GateKeys, cfg: dict[str, object]) -> None:
    """Write gate settings as the coordinator does (publish.lua), leaving the target alone."""
    async with aredis.Redis.from_url(url) as client:
        assert await GateScripts(client).publish(keys, 1, 60_000, None, cfg, {})


def assert_no_trace(r: redis.Redis, keys: GateKeys) -> None:
    """Nothing of a lane, band or tenant is left once nobody holds or waits, but the bands'
    drain history (``dr:<R>``, lib_drain.lua: what the next arrival's estimate needs)."""
    assert units(r, keys) == 0
    for key in (keys.lanes, keys.waiters, keys.fair, keys.big):
        assert r.zcard(key) == 0, (key, r.zrange(key, 0, 10))
    adm = {k: v for k, v in r.hgetall(keys.adm).items() if not str(k).startswith(("dr:", "b'dr:"))}
    assert adm == {}, adm
