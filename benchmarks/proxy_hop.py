"""proxy_hop: what one gateway hop costs, fleetgate's proxy beside nginx and LiteLLM, one run.

The same upstream for all, the vLLM simulator answering at once (``--service-ms 0``), and the
same caller (:mod:`._hop_load`: keep-alive connections, one pre-built request, answers framed by
httptools, so the caller's own CPU stays small). The ways in, each a process of its own:

- **direct**: the simulator itself;
- **fleetgate**: ``fleetgate proxy --upstream SIM --gate G``, access log on as deployed, the
  gate's limit far above the load (**free**: each request takes and returns a permit without
  waiting) and, on a second proxy and gate, **binding** (limit 8 under 32 callers: requests
  queue fleet-wide and each release wakes the next);
- **nginx** with ``limit_conn`` (free: nginx answers 503 beyond it, it does not queue), a master
  and one worker, ``proxy_buffering off``, keep-alive to the upstream (:mod:`._anchors`);
- **LiteLLM**'s proxy with ``max_parallel_requests`` when installed.

Absent anchors get a line saying so. Every figure is taken in rounds, the ways interleaved (the
order reversed each round), and reported as the median over rounds:

1. **at saturation** (32 connections back to back): req/s and the proxy's CPU per request from
   its own counters (``/proc/<pid>/stat`` utime + stime, the process and its children) -- on a
   shared machine CPU per request is the robust figure, req/s depends on what else runs;
2. **added p50 at a fixed rate** (200 req/s, an open loop): each way's p50 minus direct's;
3. **streaming**: 16 connections back to back, each a streamed chat completion of 16 tokens:
   the proxy's CPU per stream.

Targets (issue 46): fleetgate's CPU per request ≤ 10× nginx's, binding ≤ 1.3× free, streaming
≤ 5× nginx per stream, added p50 ≤ 1 ms.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from fleetgate.tools.proxyproc import start_proxy_process, stop_process

from ._anchors import litellm_process, nginx_process
from ._common import Headline, Options, log, percentiles, save, table
from ._hop_load import Load, chat_request, paced, saturate
from ._server import PREFIX, busy_fraction, configure_gate, machine_jiffies, private_redis
from .burst import sim_process

NAME = "proxy_hop"
FREE, BIND = "bench-hop-free", "bench-hop-bind"
CONNS, BIND_LIMIT, RATE, STREAM_CONNS, TOKENS = 32, 8, 200.0, 16, 16
TARGETS = {"cpu_vs_nginx": 10.0, "binding_vs_free": 1.3, "stream_vs_nginx": 5.0, "added_p50": 1.0}


def tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` and its children (Linux /proc)."""
    pids = [pid]
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            pids += [int(p) for p in f.read().split()]
    total = 0.0
    for p in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


@dataclass
class Way:
    """One way to the upstream: its URL, the process whose CPU is the hop's (None: direct),
    extra request headers."""

    name: str
    url: str
    pid: int | None
    headers: str = ""

    def request(self, *, stream: bool) -> bytes:
        parts = urlsplit(self.url)
        assert parts.hostname is not None and parts.port is not None
        raw = chat_request(parts.hostname, parts.port, stream=stream, tokens=TOKENS)
        return raw.replace(b"\r\n\r\n", b"\r\n" + self.headers.encode() + b"\r\n", 1)

    def cpu(self) -> float:
        return tree_cpu(self.pid) if self.pid is not None else 0.0


def measure(way: Way, fn: Callable[[str, int, bytes], Any], *, stream: bool) -> dict[str, Any]:
    """Run one load shape against ``way``: its answers, req/s, the hop's CPU per request."""
    parts = urlsplit(way.url)
    assert parts.hostname is not None and parts.port is not None
    request = way.request(stream=stream)
    cpu0, busy0 = way.cpu(), machine_jiffies()
    load: Load = asyncio.run(fn(parts.hostname, parts.port, request))
    cpu1, busy1 = way.cpu(), machine_jiffies()
    done = max(1, load.ok)
    out: dict[str, Any] = {
        "ok": load.ok,
        "not_ok": sum(n for s, n in load.statuses.items() if s != 200) + load.failed,
        "rps": load.ok / load.elapsed if load.elapsed else 0.0,
        "machine_busy": busy_fraction(busy0, busy1),
        "p50_ms": percentiles(load.latencies, (50,))["p50"] * 1000 if load.latencies else None,
    }
    if way.pid is not None:
        out["cpu_us"] = (cpu1 - cpu0) / done * 1e6
    return out


@contextlib.contextmanager
def fleetgate(redis_url: str, upstream: str, gate: str, logdir: str) -> Iterator[Way]:
    """``fleetgate proxy`` on a free port with its access log to a file."""
    args = ["--upstream", upstream, "--gate", gate, "--redis", redis_url, "--prefix", PREFIX]
    with tempfile.NamedTemporaryFile(dir=logdir, suffix=".log", delete=False) as logfile:
        log_path = logfile.name
    proc, url = start_proxy_process(args, log_path)
    try:
        with open(log_path, errors="replace") as f:
            started = [line.strip() for line in f if "parser" in line or "loop" in line]
        log(f"fleetgate proxy pid {proc.pid} on {url}, gate {gate}: {started[:1]}")
        yield Way("fleetgate " + ("binding" if gate == BIND else "free"), url, proc.pid)
    finally:
        stop_process(proc, timeout=30)


def rounds(ways: list[Way], n: int, shapes: dict[str, tuple[Callable[..., Any], bool]]) -> Any:
    """Each shape on each way, ``n`` rounds, the ways' order reversed every other round."""
    got: dict[str, dict[str, list[dict[str, Any]]]] = {
        s: {w.name: [] for w in ways} for s in shapes
    }
    for r in range(n):
        for way in ways if r % 2 == 0 else ways[::-1]:
            for shape, (fn, stream) in shapes.items():
                res = measure(way, fn, stream=stream)
                got[shape][way.name].append(res)
                cpu = f", {res['cpu_us']:,.0f} µs CPU each" if "cpu_us" in res else ""
                p50 = f", p50 {res['p50_ms']:.2f} ms" if shape == "paced" else ""
                log(f"{NAME}: round {r + 1} {shape} {way.name}: {res['rps']:,.0f}/s, "
                    f"{res['not_ok']} not ok{cpu}{p50}")  # fmt: skip
    return got


def median_of(runs: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def run(opts: Options) -> list[Headline]:
    # quick (CI's smoke run, and versions.py's --quick comparisons): one round, ~25 s
    n, sat_s, paced_s = opts.pick(3, 1), opts.pick(8.0, 2.0), opts.pick(10.0, 1.0)
    stream_s = opts.pick(8.0, 1.5)
    shapes: dict[str, tuple[Callable[..., Any], bool]] = {
        "saturation": (lambda h, p, q: saturate(h, p, q, CONNS, sat_s), False),
        "paced": (lambda h, p, q: paced(h, p, q, RATE, paced_s), False),
        "stream": (lambda h, p, q: saturate(h, p, q, STREAM_CONNS, stream_s), True),
    }
    logdir = tempfile.mkdtemp(prefix="fleetgate-bench-hop-")
    sim_args = ("--service-ms", "0", "--capacity", "100000")
    missing: list[str] = []
    with contextlib.ExitStack() as stack:
        rp = stack.enter_context(private_redis())
        for gate, limit in ((FREE, 100_000), (BIND, BIND_LIMIT)):
            configure_gate(rp.url, gate, floor=limit, ceiling=limit, max_queued=100_000,
                           lease_ms=10_000, waiter_ms=5_000)  # fmt: skip
        sim = stack.enter_context(sim_process("vllm", *sim_args))
        ways = [Way("direct", sim.url, None)]
        ways.append(stack.enter_context(fleetgate(rp.url, sim.url, FREE, logdir)))
        ways.append(stack.enter_context(fleetgate(rp.url, sim.url, BIND, logdir)))
        upstream = urlsplit(sim.url).netloc
        ngx = stack.enter_context(nginx_process(upstream, 10_000))
        if ngx is None:
            missing.append("nginx: not installed (Debian: apt-get install nginx-light)")
        else:
            ways.append(Way("nginx", ngx.url, ngx.proc.pid))
        llm = stack.enter_context(litellm_process(sim.url, 100_000))
        if llm is None:
            missing.append("LiteLLM: not installed (pip install 'litellm[proxy]')")
        else:
            ways.append(Way("litellm", llm.url, llm.proc.pid, "Authorization: Bearer sk-bench"))
        for line in missing:
            log(f"{NAME}: {line}")
        for way in ways:  # warm: connections, the gates' first registration
            asyncio.run(saturate(*_hp(way.url), way.request(stream=False), 4, 0.3))
        got = rounds(ways, n, shapes)
        return report(opts, rp.url, ways, got, missing, n)


def _hp(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


def report(
    opts: Options, url: str, ways: list[Way], got: Any, missing: list[str], n: int
) -> list[Headline]:
    def med(shape: str, way: str, key: str) -> float | None:
        return median_of(got[shape][way], key)

    direct_p50 = med("paced", "direct", "p50_ms")
    summary: dict[str, dict[str, Any]] = {}
    for way in ways:
        p50 = med("paced", way.name, "p50_ms")
        summary[way.name] = {
            "cpu_us_per_request": med("saturation", way.name, "cpu_us"),
            "rps": med("saturation", way.name, "rps"),
            "p50_ms_at_rate": p50,
            "added_p50_ms": None if p50 is None or direct_p50 is None else p50 - direct_p50,
            "cpu_us_per_stream": med("stream", way.name, "cpu_us"),
            "streams_per_s": med("stream", way.name, "rps"),
            "not_ok": sum(r["not_ok"] for s in got for r in got[s][way.name]),
        }

    def f(v: float | None, fmt: str = ",.0f") -> str:
        return "-" if v is None else format(v, fmt)

    rows = [
        (w, f(s["cpu_us_per_request"]), f(s["rps"]), f(s["added_p50_ms"], "+.2f"),
         f(s["cpu_us_per_stream"]), s["not_ok"])
        for w, s in summary.items()
    ]  # fmt: skip
    text = table(
        ("way", "CPU µs/request", "req/s (32 conns)", f"added p50 ms at {RATE:g}/s",
         f"CPU µs/stream ({TOKENS} tokens)", "not 200"),
        rows,
    )  # fmt: skip
    text += "".join(f"\n{line}" for line in missing)
    free, bind = summary["fleetgate free"], summary["fleetgate binding"]
    ngx = summary.get("nginx", {})

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else a / b

    ratios = {
        "cpu_vs_nginx": ratio(free["cpu_us_per_request"], ngx.get("cpu_us_per_request")),
        "binding_vs_free": ratio(bind["cpu_us_per_request"], free["cpu_us_per_request"]),
        "stream_vs_nginx": ratio(free["cpu_us_per_stream"], ngx.get("cpu_us_per_stream")),
        "added_p50": free["added_p50_ms"],
    }
    text += "\n" + "\n".join(
        f"{k}: {f(v, '.2f')} (target ≤ {TARGETS[k]:g})" for k, v in ratios.items()
    )
    data = {"rounds": n, "summary": summary, "ratios": ratios, "runs": got, "missing": missing,
            "cpus": os.cpu_count(), "loadavg": os.getloadavg()}  # fmt: skip
    save(NAME, opts, url, data, text)
    labels = {
        "cpu_vs_nginx": "fleetgate / nginx proxy CPU per request",
        "binding_vs_free": "fleetgate binding / free proxy CPU per request",
        "stream_vs_nginx": "fleetgate / nginx proxy CPU per stream",
        "added_p50": f"fleetgate added p50 at {RATE:g} req/s (ms)",
    }
    return [
        Headline(NAME, labels[k], f(v, ".2f"), f"<= {TARGETS[k]:g}",
                 None if v is None else v <= TARGETS[k])
        for k, v in ratios.items()
    ]  # fmt: skip


if __name__ == "__main__":
    from ._common import main as _main

    sys.exit(_main(only=[NAME]))
