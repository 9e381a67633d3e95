"""Every query of deploy/grafana/fleetgate.json and every alert of deploy/prometheus/alerts.yml,
asked of a real Prometheus that scrapes a real running fleet, returns series; the rules load
and evaluate without error.

The fleet: a private redis-server (the suite's), two coordinators (``fleetgate coordinator``,
one leads), three vLLM simulators, four workers (``fleetgate worker``) and Debian's
``prometheus`` binary on loopback (1 s scrapes and rule evaluations, alerts.yml loaded). What
"returns series" means for an alert, which matches only when something is wrong, is the rule of
``_promql.py``; for it the fleet runs one of each failure the alerts watch, next to healthy
gates: a gate whose server does not answer (scrape errors), a full wait list (overloaded), short
deadlines, a worker frozen past its leases' TTL while another takes their slots (lease lost),
and a worker whose own Redis is stopped (fallback). Skips where ``prometheus`` is absent.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from fleetgate.tools.redisproc import RedisProcess, free_port
from fleetgate.tools.sim import serve_in_thread, vllm

from ..conftest import RedisUnderTest
from ._procs import process, query, tail, wait_for
from ._promql import (
    ALERTS,
    alert_rules,
    dashboard_queries,
    metric_names,
    variable_metrics,
    without_threshold,
)

PROMETHEUS = shutil.which("prometheus")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(150),
    pytest.mark.skipif(
        PROMETHEUS is None,
        reason="the prometheus binary is not installed (Debian: apt-get install prometheus)",
    ),
]

EMBED, SLOW, LOST, BLIND, FALLBACK = "embed", "slow", "lost", "blind", "fb"


def coordinator_toml(rut: RedisUnderTest, fast_url: str) -> str:
    dead = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens: every scrape fails
    return f"""
[redis]
url = "{rut.url}"
prefix = "{rut.prefix}"
[coordinator]
poll_interval = 0.5
leader_ttl = 2.0
scrape_timeout = 0.4
[[gates]]
name = "{EMBED}"
base_url = "{fast_url}/v1"
model_name = "e2e-model"
floor = 2
ceiling = 16
[[gates]]
name = "{SLOW}"
signal = "fixed"
floor = 1
max_queued = 2
[[gates]]
name = "{LOST}"
signal = "fixed"
floor = 2
lease_ms = 1000
[[gates]]
name = "{BLIND}"
base_url = "{dead}"
floor = 2
"""


def prometheus_yml(coordinators: list[int], workers: list[int]) -> str:
    def targets(ports: list[int]) -> str:
        return ", ".join(f'"127.0.0.1:{p}"' for p in ports)

    return f"""
global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
rule_files: ["{ALERTS}"]
scrape_configs:
  - job_name: fleetgate-coordinator
    static_configs: [{{targets: [{targets(coordinators)}]}}]
  - job_name: fleetgate-worker
    static_configs: [{{targets: [{targets(workers)}]}}]
"""


def worker_argv(redis_url: str, prefix: str, port: int, *args: str) -> list[str]:
    return [
        sys.executable, "-m", "fleetgate.tools.load", "--redis", redis_url, "--prefix", prefix,
        *args, "--metrics-listen", f"127.0.0.1:{port}", "--duration", "120", "--log-interval", "60",
    ]  # fmt: skip


def pause(proc: Any, seconds: float) -> None:
    """SIGSTOP ``proc`` for ``seconds``, then SIGCONT: a pod frozen past its leases' TTL (a GC
    pause, a throttled or suspended VM); its heartbeat then finds them expired (LeaseLost)."""
    proc.send_signal(signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        proc.send_signal(signal.SIGCONT)


def empty_answers(api: httpx.Client) -> list[str]:
    """What returns no series yet, by the rule of ``_promql.py``."""
    exprs = {f"dashboard {where}": expr for where, expr in dashboard_queries()}
    for rule in alert_rules():
        for i, part in enumerate(without_threshold(str(rule["expr"]))):
            exprs[f"alert {rule['alert']} part {i}"] = part
    names = set().union(variable_metrics(), *(metric_names(e) for e in exprs.values()))
    exprs.update({f"metric {n}": f'count by (__name__) ({{__name__="{n}"}})' for n in names})
    return [f"{where}: {expr}" for where, expr in sorted(exprs.items()) if not query(api, expr)]


def rule_health(api: httpx.Client) -> dict[str, tuple[str, str, str]]:
    groups = api.get("/api/v1/rules").json()["data"]["groups"]
    return {
        r["name"]: (r["health"], r.get("lastError", ""), r.get("lastEvaluation", ""))
        for g in groups
        for r in g["rules"]
    }


def test_every_dashboard_and_alert_expression_returns_series(
    rut: RedisUnderTest, tmp_path: Path
) -> None:
    assert PROMETHEUS is not None
    fast = vllm.VllmSimConfig(capacity=8, service_ms=20, model="e2e-model")
    slow = vllm.VllmSimConfig(capacity=4, service_ms=300, model="e2e-model")
    long = vllm.VllmSimConfig(capacity=16, service_ms=4000, model="e2e-model")  # outlasts a pause
    coord_ports, worker_ports, prom_port = (
        [free_port(), free_port()],
        [free_port() for _ in "abcd"],
        free_port(),
    )
    logs: dict[str, Path] = {}

    def log(name: str) -> Path:
        logs[name] = tmp_path / f"{name}.log"
        return logs[name]

    def tails() -> str:
        return "\n".join(f"--- {n}:\n{tail(p)}" for n, p in logs.items())

    with contextlib.ExitStack() as stack:
        fast_sim = stack.enter_context(serve_in_thread(vllm.build_app(fast)))
        slow_sim = stack.enter_context(serve_in_thread(vllm.build_app(slow)))
        long_sim = stack.enter_context(serve_in_thread(vllm.build_app(long)))
        own_redis = stack.enter_context(RedisProcess())  # the fallback worker's, stopped below
        config = tmp_path / "coordinator.toml"
        config.write_text(coordinator_toml(rut, fast_sim.url))
        procs = {}
        for i, port in enumerate(coord_ports):
            env = {**os.environ, "FLEETGATE_METRICS_LISTEN": f"127.0.0.1:{port}"}
            argv = [sys.executable, "-m", "fleetgate.cli", "coordinator", "--config", str(config)]
            procs[f"coordinator-{i}"] = stack.enter_context(
                process([*argv, "--id", f"c{i}"], log(f"coordinator-{i}"), env)
            )
        workers = {
            "worker-embed": worker_argv(
                rut.url, rut.prefix, worker_ports[0],
                "--gate", EMBED, "--target-url", fast_sim.url,
                "--gate", LOST, "--target-url", long_sim.url,  # frozen below
                "--rate", "40", "--concurrency", "4",
            ),
            "worker-slow": worker_argv(
                rut.url, rut.prefix, worker_ports[1],
                "--gate", SLOW, "--target-url", slow_sim.url,
                "--rate", "15", "--concurrency", "6", "--deadline", "0.5",
            ),
            "worker-rival": worker_argv(  # takes the slots of the frozen worker's leases
                rut.url, rut.prefix, worker_ports[3],
                "--gate", LOST, "--target-url", long_sim.url, "--rate", "10", "--concurrency", "4",
            ),
            "worker-fallback": worker_argv(
                own_redis.url, "fb", worker_ports[2], "--gate", FALLBACK,
                "--target-url", slow_sim.url, "--rate", "5", "--concurrency", "2",
            ),
        }  # fmt: skip
        for name, argv in workers.items():
            procs[name] = stack.enter_context(process(argv, log(name)))
        prom_config = tmp_path / "prometheus.yml"
        prom_config.write_text(prometheus_yml(coord_ports, worker_ports))
        procs["prometheus"] = stack.enter_context(
            process(
                [
                    PROMETHEUS, f"--config.file={prom_config}",
                    f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn",
                ],
                log("prometheus"),
            )
        )  # fmt: skip
        api = stack.enter_context(
            httpx.Client(base_url=f"http://127.0.0.1:{prom_port}", timeout=5.0)
        )

        def alive() -> None:
            for name, proc in procs.items():
                assert proc.poll() is None, f"{name} exited:\n{tails()}"

        def ready() -> bool:
            alive()
            with contextlib.suppress(httpx.TransportError):
                return api.get("/-/ready").status_code == 200
            return False

        wait_for(ready, 20, "prometheus /-/ready")
        # the fallback worker has reached its Redis and counted a grant: now take Redis away
        wait_for(
            lambda: (
                alive() is None
                and bool(query(api, f'fleetgate_client_granted_total{{gate="{FALLBACK}"}}'))
            ),
            30,
            "the fallback worker's first grants in Prometheus",
        )
        own_redis.stop()

        missing: list[str] = []
        paused = [0.0]

        def answered() -> bool:
            alive()
            missing[:] = empty_answers(api)
            lost = any("fleetgate_client_lease_lost_total" in m for m in missing)
            if lost and time.monotonic() - paused[0] > 8:  # once, and again if none was lost
                pause(procs["worker-embed"], 2.5)  # > the lost gate's lease_ms
                paused[0] = time.monotonic()
            return not missing

        try:
            wait_for(answered, 45, "series for every expression", interval=1.0)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; no series yet:\n  " + "\n  ".join(missing)) from None

        health = rule_health(api)
        assert set(health) == {str(r["alert"]) for r in alert_rules()}
        bad = {name: h for name, h in health.items() if h[0] != "ok" or h[1]}
        assert not bad, f"rules that failed to evaluate: {bad}"
        leaders = query(api, "fleetgate_coordinator_leader == 1")
        assert len(leaders) == 1, leaders
