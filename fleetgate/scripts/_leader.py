"""The coordinator's leadership-lease scripts: plain EVALSHA scripts on the fleet keys."""

from __future__ import annotations

from typing import Any

from ._library import script_source


class LeaderScripts:
    """The coordinator's leadership-lease scripts (on the fleet keys, not a gate's)."""

    def __init__(self, client: Any) -> None:
        self._renew = client.register_script(script_source("leader_renew"))
        self._release = client.register_script(script_source("leader_release"))

    async def renew(self, leader_key: str, owner: str, ttl_ms: int) -> bool:
        """Extend the lease to ``ttl_ms`` if ``owner`` holds it; False if it does not."""
        return bool(await self._renew(keys=[leader_key], args=[owner, ttl_ms]))

    async def release(self, leader_key: str, owner: str) -> None:
        """Delete the lease if ``owner`` holds it."""
        await self._release(keys=[leader_key], args=[owner])
