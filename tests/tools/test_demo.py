"""``fleetgate demo`` end to end: it runs, fails over, plots, and leaves no process behind."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis

from fleetgate.coordinator.config import Config, CoordinatorSettings
from fleetgate.demo.picture import (
    BATCH_QUEUE_COLOUR,
    BUDGET_LABEL,
    SERVER_QUEUE_COLOUR,
    STATED_KV_LABEL,
    TOKEN_PANEL_TITLE,
    TOKENS_HELD_LABEL,
    CapacityMark,
    capacity_marks,
    figure,
    kept_samples,
    kept_waits,
    over_lowered_limit,
)
from fleetgate.demo.plan import GATES
from fleetgate.demo.processes import _config_toml
from fleetgate.demo.report import (
    DemoRecord,
    Event,
    GateInfo,
    GateSample,
    Sample,
    format_summary,
    render_view,
    summarize,
)
from fleetgate.demo.token_budget import token_budget_run
from fleetgate.tools.redisproc import INSTALL_HINT, RedisProcess

from ..conftest import RedisUnderTest


def _alive(pid: int) -> bool:
    """True if ``pid`` runs (a zombie counts as gone: it has exited)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _run_demo(
    out: Path, *extra: str, env: dict[str, str] | None = None
) -> tuple[dict[str, Any], str]:
    proc = subprocess.run(
        [sys.executable, "-m", "fleetgate.demo", "--out", str(out), "--quiet", *extra],
        capture_output=True,
        text=True,
        timeout=150,
        env=env,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "failover:" in proc.stdout and "peak targets" in proc.stdout
    assert (out / "demo.png").stat().st_size > 10_000
    data: dict[str, Any] = json.loads((out / "demo.json").read_text())
    still = {name: pid for name, pid in data["pids"].items() if _alive(pid)}
    assert not still, f"processes left behind: {still}"
    return data, proc.stdout


def _check_failover_and_ramp(data: dict[str, Any]) -> None:
    samples = data["samples"]
    leaders = {s["leader"] for s in samples if s["leader"]}
    epochs = [s["epoch"] for s in samples if s["epoch"] is not None]
    assert len(leaders) >= 2, leaders
    assert max(epochs) > min(epochs), epochs
    fo = data["failover"]
    assert fo["killed"] in leaders and fo["new_leader"] in leaders - {fo["killed"]}
    assert fo["new_epoch"] > fo["old_epoch"]
    assert 0 < fo["elected_after"] <= fo["published_after"] < 30
    for gate in data["gates"]:
        targets = [
            s["gates"][gate["name"]]["target"]
            for s in samples
            if gate["name"] in s["gates"] and s["gates"][gate["name"]]["target"] is not None
        ]
        if gate["adaptive"]:
            assert max(targets) > gate["floor"], (gate["name"], targets)
        else:
            assert not targets  # a fixed gate has no target: its limit is the floor
    assert data["summary"]["requests_ok"] > 0
    if shutil.which("curl"):  # the non-Python caller, through fleetgate proxy on the same gate
        gateway = data["summary"]["gateway"]
        assert gateway["ok"] >= 1, gateway
        assert set(gateway["codes"]) <= {"200", "000"}, gateway  # 000: cut by the demo's end


def _check_token_budget(data: dict[str, Any], stdout: str) -> None:
    """The chat gate's token budget starts a quarter of the cache, is tuned to within 10 % of
    the KV cache its simulator states in tokens the calls use (the budget x the used / charged
    ratio the coordinator measured; never to the ceiling above it), and the report says so."""
    (info,) = [g for g in data["gates"] if g["token_limit"] is not None]
    rows = [s["gates"][info["name"]] for s in data["samples"] if info["name"] in s["gates"]]
    budgets = [g["token_limit"] for g in rows if g["token_limit"] is not None]
    stated = {g["server_kv_tokens"] for g in rows if g["server_kv_tokens"] is not None}
    assert stated == {info["kv_tokens"]}, stated  # what the simulator states, every second
    cache = info["kv_tokens"]
    # the first sample: the configured budget, or one doubling of it -- the load starts right
    # before the live view and, the prefix stamped, is granted at once, so a coordinator poll
    # may fall between them (the recovery fence used to hold the first ~3 s of it)
    assert info["token_ceiling"] > cache and info["token_limit"] <= cache // 4
    assert budgets[0] in (info["token_limit"], 2 * info["token_limit"]), budgets[:3]
    in_use = [g["token_limit"] * (g["token_use_ratio"] or 1.0) for g in rows if g["token_limit"]]
    assert any(abs(u - cache) <= 0.1 * cache for u in in_use), (budgets, in_use)
    assert max(in_use) <= 1.1 * cache, in_use  # tuned to the cache, not to the ceiling
    ratios = {round(g["token_use_ratio"], 2) for g in rows if g["token_use_ratio"]}
    assert ratios and all(0.7 <= r <= 0.9 for r in ratios), ratios  # 736 used per 928 charged
    assert max(g["tokens_held"] for g in rows) > info["token_limit"]  # the budget was used
    run = data["summary"]["token_budgets"][info["name"]]
    assert run["reached_at"] is not None and run["stated"] == cache, run
    assert f"token budget {info['name']}" in stdout and f"({cache:,} tokens) at" in stdout
    fig = figure(msgspec.convert(data, type=DemoRecord))
    (panel,) = [ax for ax in fig.axes if TOKEN_PANEL_TITLE in ax.get_title(loc="left")]
    lines = {ln.get_label(): ln for ln in panel.get_lines()}
    assert set(lines[STATED_KV_LABEL].get_ydata()) == {cache}
    assert max(lines[BUDGET_LABEL].get_ydata()) == max(budgets)
    assert max(lines[TOKENS_HELD_LABEL].get_ydata()) > 0


def test_generated_config_is_valid() -> None:
    urls = {g.name: f"http://127.0.0.1:{9000 + i}" for i, g in enumerate(GATES)}
    cfg = Config.from_toml_text(_config_toml("redis://127.0.0.1:1/0", "fg", urls), env={})
    assert [g.name for g in cfg.gates] == [g.name for g in GATES]
    assert [cfg.is_adaptive(g) for g in cfg.gates] == [True, True, False]
    # the chat gate's token budget: tuned, from a quarter of its simulator's cache, up to a
    # ceiling above it (so the cache, not the ceiling, is where the tuning stops)
    assert [g.tokens_tuned for g in cfg.gates] == [True, False, False]
    chat = cfg.gates[0]
    assert GATES[0].kv_tokens is not None and chat.token_limit == GATES[0].kv_tokens // 4
    assert chat.token_ceiling is not None and chat.token_ceiling > GATES[0].kv_tokens
    # the default lifetimes, not shorter ones that hide a slow takeover
    defaults = CoordinatorSettings()
    assert cfg.coordinator.leader_ttl == defaults.leader_ttl
    assert cfg.coordinator.poll_interval == defaults.poll_interval
    assert cfg.coordinator.target_ttl_polls == defaults.target_ttl_polls
    assert cfg.coordinator.takeover < cfg.coordinator.target_ttl  # targets outlive a failover


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_demo_embedded_redis(tmp_path: Path) -> None:
    if not RedisProcess.available():
        pytest.fail(INSTALL_HINT, pytrace=False)
    env = {k: v for k, v in os.environ.items() if k != "FLEETGATE_REDIS_URL"}
    # 20 s: the leader is killed at 10 s, once the budget has had the polls to reach the cache
    data, stdout = _run_demo(tmp_path / "out", "--duration", "20", env=env)
    _check_failover_and_ramp(data)
    _check_token_budget(data, stdout)
    assert "redis" in data["pids"]
    assert data["prefix"] == "fg"
    # stamped before the coordinators start: its gates' first permits skip the recovery fence
    assert data["stamp"].startswith("prefix 'fg' is new: stamped"), data["stamp"]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_demo_external_redis_uses_own_prefix(tmp_path: Path, shared_redis: RedisUnderTest) -> None:
    """With FLEETGATE_REDIS_URL the demo starts no Redis, uses a fresh prefix and removes only
    its own keys."""
    sentinel = f"t{uuid.uuid4().hex[:10]}:keep"
    with redis.Redis.from_url(shared_redis.url) as r:
        r.set(sentinel, "1")
        try:
            env = dict(os.environ, FLEETGATE_REDIS_URL=shared_redis.url)
            data, _ = _run_demo(tmp_path / "out", "--duration", "8", "--workers", "1", env=env)
            _check_failover_and_ramp(data)
            assert "redis" not in data["pids"]
            prefix = data["prefix"]
            assert prefix.startswith("demo-")
            assert data["stamp"].startswith(f"prefix {prefix!r} is new: stamped"), data["stamp"]
            assert not list(r.scan_iter(match=f"{prefix}:*"))
            assert r.get(sentinel) == b"1"
        finally:
            r.delete(sentinel)


# -- the picture's decisions (pure functions) and what the plot draws from them ----------------

CHAT, RERANK = "llama-3.1-8b", "rerank/nemoretriever-500m-v2"


def _gs(limit: int, in_flight: int, capacity: int, *, queued: int = 0) -> GateSample:
    return GateSample(
        limit=limit, target=limit, in_flight=in_flight, queued=queued, saturated=False,
        reason=None, server_running=min(in_flight, capacity), server_waiting=0,
        server_capacity=capacity,
    )  # fmt: skip


def _record() -> DemoRecord:
    """The chat server halved at t = 4.5 s; the limit follows at 6 s while 35 leases still run
    (they finish by 7 s); a sample and two interactive calls from before the load started."""
    chat = [(48, 48, 48)] * 5 + [(48, 48, 24), (24, 35, 24)] + [(24, 24, 24)] * 4
    samples = [Sample(t=-1.0, leader="a", epoch=1, gates={CHAT: _gs(4, 0, 48)})]
    for i, (limit, fl, cap) in enumerate(chat):
        gates = {CHAT: _gs(limit, fl, cap), RERANK: _gs(32, 32, 32, queued=10 * i)}
        samples.append(Sample(t=float(i), leader="a", epoch=1, gates=gates))
    return DemoRecord(
        started_at=0.0, duration=10.0, redis="r", prefix="fg",
        gates=[
            GateInfo(name=CHAT, kind="chat", floor=4, adaptive=True, capacity=48, url="u"),
            GateInfo(name=RERANK, kind="rerank", floor=32, adaptive=False, capacity=32, url="u"),
        ],
        events=[
            Event(t=0.0, kind="start", text="started"),
            Event(t=4.5, kind="capacity", text="chat 48 -> 24", gate=CHAT),
            Event(t=5.0, kind="capacity_failed", text="could not", gate=RERANK),
        ],
        samples=samples,
        interactive={"gate": RERANK, "waits": [[-0.5, 2600.0], [-0.01, 2400.0], [0.0, 2200.0],
                                               [3.0, 20.0]]},
    )  # fmt: skip


def test_no_sample_or_call_before_the_load_started_is_kept() -> None:
    rec = _record()
    assert [s.t for s in kept_samples(rec)] == [float(i) for i in range(11)]
    assert kept_waits(rec.interactive["waits"]) == [(0.0, 2200.0), (3.0, 20.0)]


def test_the_capacity_marker_sits_at_the_change_time_on_its_gate_only() -> None:
    rec = _record()
    (mark,) = capacity_marks(rec, CHAT)
    assert mark.t == 4.5  # the event's time, not the next sample's
    assert (mark.before, mark.after) == (48, 24)
    assert capacity_marks(rec, RERANK) == []  # a failed change moved nothing


def test_the_capacity_marker_reads_the_change_from_the_samples_around_it() -> None:
    """The sample of the tick that changed the capacity carries the tick's start time, a few ms
    before the change's event, yet already the new capacity (a live run drew '24 → 24')."""
    rec = _record()
    rec.events[1] = Event(t=5.01, kind="capacity", text="chat 48 -> 24", gate=CHAT)
    assert capacity_marks(rec, CHAT) == [CapacityMark(t=5.01, before=48, after=24)]


def test_in_flight_above_a_lowered_limit_is_found_where_it_is() -> None:
    rec = _record()
    (span,) = over_lowered_limit(kept_samples(rec), CHAT)
    assert (span.start, span.end, span.in_flight, span.limit) == (6.0, 7.0, 35, 24)
    assert over_lowered_limit(kept_samples(rec), RERANK) == []  # at its limit, never above


def test_a_limit_lowered_in_two_steps_gets_two_hatches_and_one_note() -> None:
    """A cut to 30 then to 24 (the demo's chat gate from 60): in-flight above each, one note."""
    pytest.importorskip("matplotlib")
    rec = _record()
    chat = [(60, 44, 24), (30, 41, 24), (30, 30, 24), (24, 29, 24)] + [(24, 24, 24)] * 6
    for s, (limit, fl, cap) in zip(kept_samples(rec)[1:], chat, strict=True):
        s.gates[CHAT] = _gs(limit, fl, cap)
    spans = over_lowered_limit(kept_samples(rec), CHAT)
    assert [(x.start, x.in_flight, x.limit) for x in spans] == [(2.0, 41, 30), (4.0, 29, 24)]
    chat_ax = figure(rec).axes[0]
    hatched = [p for p in chat_ax.patches if p.get_hatch() == "///"]
    notes = [t.get_text() for t in chat_ax.texts if "never revokes" in t.get_text()]
    assert len(hatched) == 2 and len(notes) == 1
    assert notes[0].startswith("in-flight 41 > limit 30:")


def test_in_flight_above_a_limit_never_lowered_is_not_called_a_lowered_limit() -> None:
    samples = [Sample(t=float(i), leader="a", epoch=1, gates={CHAT: _gs(8, 9, 48)}) for i in (0, 1)]
    assert over_lowered_limit(samples, CHAT) == []


def test_the_plot_draws_those_decisions() -> None:
    pytest.importorskip("matplotlib")
    fig = figure(_record())
    chat, rerank, priority = fig.axes[:3]
    marker = [ln for ln in chat.get_lines() if ln.get_label() == "server capacity changed"]
    assert [list(ln.get_xdata()) for ln in marker] == [[4.5, 4.5]]
    assert not [ln for ln in rerank.get_lines() if ln.get_label() == "server capacity changed"]
    texts = " ".join(t.get_text() for t in chat.texts)
    assert "48 → 24" in texts and "never revokes" in texts
    for ax in fig.axes:
        assert ax.get_xlim()[0] >= 0
        for ln in ax.get_lines():
            assert min(ln.get_xdata(), default=0) >= 0, ln.get_label()
        for coll in ax.collections:
            offsets = coll.get_offsets()
            assert not len(offsets) or offsets[:, 0].min() >= 0
    batch = [ln for ax in fig.axes for ln in ax.get_lines() if "batch queue" in str(ln.get_label())]
    assert batch and all(ln.get_color() == BATCH_QUEUE_COLOUR for ln in batch)
    assert BATCH_QUEUE_COLOUR != SERVER_QUEUE_COLOUR
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "server capacity changed" in legend and len(legend) == len(set(legend))
    assert priority.get_title(loc="left").startswith(f"gate {RERANK}")


def _token_record() -> DemoRecord:
    """The chat gate with a token budget: 8,192 at the start, 16,384 at 2 s, the stated
    32,768 at 4 s (a sample still at 16,384 between), held there."""
    rec = _record()
    budgets = [8192, 8192, 16384, 16384, 32768, 16384, 32768, 32768, 32768, 32768, 32768]
    for s, budget in zip(kept_samples(rec), budgets, strict=True):
        g = s.gates[CHAT]
        g.token_limit, g.tokens_held, g.token_reason = budget, budget - 1000, "grow"
        g.server_kv_tokens, g.server_kv_used, g.server_preemptions = 32768, budget // 2, 3
    rec.gates[0].token_limit, rec.gates[0].kv_tokens = 8192, 32768
    return rec


def test_where_the_token_budget_reached_the_cache_and_settled() -> None:
    run = token_budget_run(kept_samples(_token_record()), CHAT)
    assert run is not None
    assert (run.first, run.final, run.stated) == (8192, 32768, 32768)
    assert run.reached_at == 4.0 and not run.stayed  # it left the cache at 5 s
    assert run.final_since == 6.0 and run.peak_held == 31768 and run.preemptions == 0
    assert token_budget_run(kept_samples(_token_record()), RERANK) is None  # no budget
    rec = _token_record()
    rec.summary = summarize(rec)
    text = format_summary(rec, Path("out"))
    assert f"token budget {CHAT}: 8,192 tokens at the start" in text
    assert "(32,768 tokens) at 4.0 s but left it; converged at 32,768 from 6.0 s" in text
    assert "tokens 31768/32768 grow" in render_view(rec, rec.samples[-1])


def test_the_plot_has_a_token_panel_under_the_chat_gate() -> None:
    pytest.importorskip("matplotlib")
    assert len(figure(_record()).axes) == 4  # no budget recorded: no token panel
    fig = figure(_token_record())
    chat, tokens, rerank = fig.axes[:3]
    assert chat.get_title(loc="left").startswith(f"gate {CHAT} — adaptive")
    assert tokens.get_title(loc="left").startswith(f"gate {CHAT} — {TOKEN_PANEL_TITLE}")
    assert rerank.get_title(loc="left").startswith(f"gate {RERANK}")
    lines = {ln.get_label(): ln for ln in tokens.get_lines()}
    assert list(lines[BUDGET_LABEL].get_ydata())[:5] == [8192, 8192, 16384, 16384, 32768]
    assert set(lines[STATED_KV_LABEL].get_ydata()) == {32768}
    assert lines[STATED_KV_LABEL].get_linestyle() == "--"
    assert max(lines[TOKENS_HELD_LABEL].get_ydata()) == 31768
    texts = " ".join(t.get_text() for t in tokens.texts)
    assert "within 10% of the stated cache (in tokens used) at 4.0 s" in texts
    assert "converged at 32,768 charged" in texts
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert {BUDGET_LABEL, STATED_KV_LABEL, TOKENS_HELD_LABEL} <= set(legend)
