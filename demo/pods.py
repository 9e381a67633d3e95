"""The demo's callers: the worker pods (:mod:`fleetgate.tools.load`), the search pod
(:mod:`fleetgate.demo.interactive`) and the gateway (``fleetgate proxy``) with a shell client
through it; started once the gates are served, and what they have recorded so far."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from fleetgate.demo.children import STARTUP_TIMEOUT, Children, wait_for
from fleetgate.demo.plan import BLOCK_SIZE, GATES, INGEST_LOOPS, SEARCH_RATE, Setup
from fleetgate.demo.report import worker_totals
from fleetgate.demo.search_contract import SPEC_ENV as INTERACTIVE_ENV
from fleetgate.demo.search_contract import InteractiveSpec
from fleetgate.tools.load import SPEC_ENV, GateLoad, LoadSpec

__all__ = [
    "read_gateway_totals",
    "read_worker_totals",
    "start_gateway",
    "start_search_pod",
    "start_workers",
]


def read_worker_totals(paths: list[Path]) -> dict[str, Any]:
    """Sum whatever the workers have written so far."""
    stats = []
    for p in paths:
        try:
            stats.append(msgspec.json.decode(p.read_bytes()))
        except (OSError, msgspec.DecodeError):
            continue
    return worker_totals(stats)


def start_workers(
    children: Children, setup: Setup, out: Path, workers: int, say: Callable[[str], None]
) -> None:
    """Start ``workers`` load generators (:mod:`fleetgate.tools.load`), each putting every
    gate's load on its simulator, and wait until their stats files show the load runs."""
    (out / "workers").mkdir(exist_ok=True)
    loads = [
        GateLoad(
            name=g.name,
            kind=g.kind,
            url=setup.urls[g.name],
            model=g.model,
            floor=g.floor,
            users=g.users,
            calls=g.calls,
            fan=g.fan,
            stream=g.kind == "chat",  # the LLM's callers read streamed replies
            prompt_tokens=g.prompt_tokens,
            max_tokens=g.max_tokens,
            # a token budget's callers charge each call and report what its usage says
            token_block=BLOCK_SIZE if g.token_limit is not None else 0,
        )
        for g in GATES
    ]
    for w in range(1, workers + 1):
        stats = out / "workers" / f"worker-{w}.json"
        stats.unlink(missing_ok=True)
        spec = LoadSpec(
            redis_url=setup.redis_url,
            prefix=setup.prefix,
            gates=loads,
            pod_id=f"worker-{w}",
            stats_path=str(stats),
            parent_pid=os.getpid(),
        )
        # The spec (with the Redis URL) goes by environment: ps shows only the label.
        argv = [sys.executable, "-m", "fleetgate.tools.load", "--spec-from-env", f"worker-{w}"]
        env = {SPEC_ENV: msgspec.json.encode(spec).decode()}
        children.spawn(f"worker-{w}", "worker", argv, env)
        setup.stats_paths.append(stats)

    def workers_alive() -> None:
        for w in range(1, workers + 1):
            children.check_alive(f"worker-{w}")

    # A worker writes its stats file once its users run: the load starts now.
    wait_for("workers", lambda: all(p.exists() for p in setup.stats_paths), workers_alive, 60.0)
    demand = ", ".join(f"{g.name} {workers * g.users * g.fan}" for g in GATES)
    say(f"  {workers} workers, concurrent demand: {demand}")


# A shell client: curl in a loop, one status code per line (no Python, no fleetgate library).
_CURL_LOOP = (
    'while :; do curl -s -o /dev/null -w "%{http_code}\\n" --max-time 30 '
    '-H "Content-Type: application/json" -H "X-Fleetgate-Deadline-Ms: 20000" '
    '--data-binary "$BODY" "$URL/v1/ranking" >> "$OUT"; sleep 0.2; done'
)


def start_gateway(children: Children, setup: Setup, out: Path, say: Callable[[str], None]) -> None:
    """Start ``fleetgate proxy`` in front of the reranker, on the workers' rerank gate, and a
    non-Python caller through it (curl in a shell loop); skipped when curl is missing."""
    curl = shutil.which("curl")
    if curl is None:
        say("  gateway      skipped: curl is not installed")
        return
    gate = next(g for g in GATES if g.kind == "rerank")
    argv = [sys.executable, "-m", "fleetgate.cli", "proxy", "--upstream", setup.urls[gate.name]]
    argv += ["--gate", gate.name, "--prefix", setup.prefix, "--listen", "127.0.0.1:0"]
    # the Redis URL reaches it as FLEETGATE_REDIS_URL (children.env): never on a command line
    children.spawn("proxy-1", "coordinator", argv)
    log = children.log_dir / "proxy-1.log"
    found: list[str] = []

    def listening() -> bool:
        text = log.read_text(errors="replace") if log.exists() else ""
        found[:] = [ln.rsplit("listening on ", 1)[1].strip() for ln in text.splitlines()
                    if "listening on " in ln][:1]  # fmt: skip
        return bool(found)

    wait_for("proxy-1", listening, lambda: children.check_alive("proxy-1"), STARTUP_TIMEOUT)
    record = out / "workers" / "curl.txt"
    record.unlink(missing_ok=True)
    passages = [{"text": f"passage {i} of the shell client"} for i in range(8)]
    body = {"model": gate.model, "query": {"text": "gateway"}, "passages": passages}
    env = {"BODY": msgspec.json.encode(body).decode(), "URL": found[0], "OUT": str(record)}
    children.spawn("curl-1", "worker", ["/bin/sh", "-c", _CURL_LOOP], env)
    setup.gateway_path = record
    say(f"  proxy-1      {found[0]} -> {setup.urls[gate.name]} (gate {gate.name})")
    say("  curl-1       a shell loop of curl calls through proxy-1, beside the Python workers")


def read_gateway_totals(path: Path | None) -> dict[str, Any]:
    """The shell client's record: requests and HTTP status codes."""
    if path is None or not path.exists():
        return {}
    codes: dict[str, int] = {}
    for line in path.read_text(errors="replace").split():
        codes[line] = codes.get(line, 0) + 1
    return {"requests": sum(codes.values()), "ok": codes.get("200", 0), "codes": codes}


def start_search_pod(
    children: Children, setup: Setup, out: Path, duration: float, say: Callable[[str], None]
) -> None:
    """Start the search pod (:mod:`fleetgate.demo.interactive`) on the rerank gate: interactive
    calls at priority 10 beside a batch backlog growing to ``INGEST_LOOPS`` loops by two thirds
    of the run; wait until its stats file shows it runs."""
    gate = next(g for g in GATES if g.kind == "rerank")
    stats = out / "workers" / "search.json"
    stats.unlink(missing_ok=True)
    spec = InteractiveSpec(
        redis_url=setup.redis_url,
        prefix=setup.prefix,
        gate=gate.name,
        url=setup.urls[gate.name],
        model=gate.model,
        rate=SEARCH_RATE,
        ramp=INGEST_LOOPS / max(1.0, duration * 2 / 3),
        max_loops=INGEST_LOOPS,
        stats_path=str(stats),
        parent_pid=os.getpid(),
    )
    argv = [sys.executable, "-m", "fleetgate.demo.interactive", "--spec-from-env", "search-1"]
    env = {INTERACTIVE_ENV: msgspec.json.encode(spec).decode()}
    children.spawn("search-1", "worker", argv, env)
    setup.interactive_path = stats
    wait_for("search pod", stats.exists, lambda: children.check_alive("search-1"), 60.0)
    say(
        f"  search-1     {SEARCH_RATE:g} interactive calls/s at priority 10 on {gate.name}, "
        f"beside a batch backlog growing to {INGEST_LOOPS} loops (priority 0)"
    )
