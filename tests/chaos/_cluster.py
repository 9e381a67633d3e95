"""A real Redis Cluster with replicas for the chaos tests (failover, slot migration): nodes are
private ``redis-server`` processes on free loopback ports, driven with ``redis-cli``."""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

import redis

from fleetgate.tools.redisproc import INSTALL_HINT, RedisProcess, RedisServerMissing

from ._harness import poll


class ReplicatedCluster:
    """A real Redis Cluster: ``masters`` masters with one replica each (``redis-cli --cluster
    create --cluster-replicas 1``), a short node timeout so a killed master fails over in about
    two seconds. Nodes are private ``redis-server`` processes on free loopback ports."""

    def __init__(self, masters: int = 3, node_timeout_ms: int = 1000) -> None:
        if not RedisProcess.available() or shutil.which("redis-cli") is None:
            raise RedisServerMissing(INSTALL_HINT)
        self.cli = shutil.which("redis-cli") or "redis-cli"
        self.nodes = [
            RedisProcess(
                extra_args=[
                    "--cluster-enabled", "yes",
                    "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", str(node_timeout_ms),
                    "--cluster-port", "{cluster_port}",
                    # A replica must not refuse to fail over because its link to a killed
                    # master was briefly stale.
                    "--cluster-replica-validity-factor", "0",
                    # A replica syncs at once (the default waits 5 s for more replicas).
                    "--repl-diskless-sync-delay", "0",
                ]
            )
            for _ in range(masters * 2)
        ]  # fmt: skip

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.nodes[0].port}/0?cluster=1"

    def start(self, timeout: float = 30.0) -> ReplicatedCluster:
        try:
            for node in self.nodes:
                node.start()
            addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
            subprocess.run(
                [self.cli, "--cluster", "create", *addrs, "--cluster-replicas", "1",
                 "--cluster-yes"],
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=timeout,
            )  # fmt: skip
            self.wait_ok(timeout)
            poll(lambda: len(self.replicas()) == len(self.nodes) // 2, timeout, 0.1, "replicas")
        except BaseException:
            self.close()
            raise
        return self

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, decode_responses=True, socket_timeout=2)

    def live(self) -> list[RedisProcess]:
        return [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]

    def wait_ok(self, timeout: float = 30.0) -> None:
        def ok() -> bool:
            for node in self.live():
                c = self.client(node.port)
                try:
                    if c.cluster("info").get("cluster_state") != "ok":
                        return False
                finally:
                    c.close()
            return True

        poll(ok, timeout, 0.05, "cluster_state:ok on every live node")

    def _nodes(self) -> list[dict[str, Any]]:
        """CLUSTER NODES as seen by a live node: id, port, flags, master id, slots."""
        for node in self.live():
            c = self.client(node.port)
            try:
                raw = c.execute_command("CLUSTER", "NODES")
            except redis.RedisError:
                continue
            finally:
                c.close()
            text = raw if isinstance(raw, str) else raw.decode()
            rows = []
            for line in text.strip().splitlines():
                parts = line.split()
                rows.append(
                    {
                        "id": parts[0],
                        "port": int(parts[1].split("@")[0].rsplit(":", 1)[1]),
                        "flags": parts[2].split(","),
                        "master": parts[3],
                        "slots": parts[8:],
                    }
                )
            return rows
        raise RuntimeError("no live cluster node answers CLUSTER NODES")

    def replicas(self) -> list[dict[str, Any]]:
        return [n for n in self._nodes() if "slave" in n["flags"] and "fail" not in n["flags"]]

    def owner_of(self, slot: int) -> dict[str, Any]:
        """The master serving ``slot``, from CLUSTER NODES (LookupError while none does)."""
        for n in self._nodes():
            if "master" not in n["flags"] or "fail" in n["flags"]:
                continue
            for rng in n["slots"]:
                if rng.startswith("["):
                    continue  # a migrating/importing marker
                lo, _, hi = rng.partition("-")
                if int(lo) <= slot <= int(hi or lo):
                    return n
        raise LookupError(f"no master owns slot {slot}")

    def owner_id(self, slot: int) -> str | None:
        """The id of the master serving ``slot``, or None while none does (mid-failover)."""
        try:
            return str(self.owner_of(slot)["id"])
        except (LookupError, RuntimeError):
            return None

    def replica_of(self, master_id: str) -> dict[str, Any]:
        for n in self.replicas():
            if n["master"] == master_id:
                return n
        raise LookupError(f"no replica of {master_id}")

    def process(self, port: int) -> RedisProcess:
        return next(n for n in self.nodes if n.port == port)

    def wait_synced(self, master_port: int, replica_port: int, timeout: float = 30.0) -> float:
        """Wait until the replica has everything the master had written when this was called
        (its link up, its offset at the master's). Until its first full sync a replica holds
        nothing, and a master killed then fails over to an empty node: a wipe, not a failover."""
        m, r = self.client(master_port), self.client(replica_port)
        try:
            target = int(m.info("replication")["master_repl_offset"])

            def synced() -> bool:
                info = r.info("replication")
                return (
                    info.get("master_link_status") == "up"
                    and int(info.get("slave_repl_offset", -1)) >= target
                )

            return poll(synced, timeout, 0.01, f"replica :{replica_port} in sync")
        finally:
            m.close()
            r.close()

    def masters(self) -> list[dict[str, Any]]:
        return [n for n in self._nodes() if "master" in n["flags"] and "fail" not in n["flags"]]

    def close(self) -> None:
        for node in self.nodes:
            node.close()

    def __enter__(self) -> ReplicatedCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
