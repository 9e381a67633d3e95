"""tokens: a token budget against the best request-only cap, on a KV-limited vLLM simulator.

One vLLM simulator process with a KV cache (``--kv-tokens 16384 --block-size 16``: 1,024 blocks,
64 slots; ``--ms-per-token 8``: a sequence decodes one token each 8 ms, so what the server
completes per second grows with the sequences it holds, up to the cache;
``--prefill-ms-per-token 0.01``: a prefill of 100,000 tokens/s that stalls the whole batch,
paid again for what a preempted sequence holds when it is recomputed). Two tenants, weighted
3:1, 48 closed-loop callers each, from one client process: the chat service (tenant ``a``:
192 prompt tokens, 64 out) and a long-context team (tenant ``b``: 3,840 prompt tokens, 256
out, a quarter of the cache). Every call sits inside a permit of one gate; one gate per way:

* **request-only caps** (floor = ceiling = N, for N in a sweep; no token budget): the cap the
  project offered before. Tenants share a cap by calls (3:1), so the long calls, four times
  longer, hold most slots; the server admits on prompts and preempts (recomputes) when their
  outputs outgrow the cache.
* **token budget**: floor 64 (the simulator's slots), ``token_limit`` = the cache, each call
  charged what its caller can estimate without the server's tokenizer (its prompt at 3
  characters a token, the server counts 4, plus ``max_tokens``, in whole blocks) and
  reporting the tokens its answer's ``usage`` says it used (``lease.report(tokens=...)``).
  Tenants share it by tokens (3:1).

* **tuned token budgets** (issue "token budgets that tune themselves"): the token budget way, but
  the gate's ``token_limit`` starts 4x too small and 4x too large, and an in-process coordinator
  (polling every second) tunes it from the simulator's ``vllm:cache_config_info`` and
  preemptions (``docs/aimd.md``, "The token budget"); ``token_ceiling`` 4x the cache, so no
  call is refused while the budget is too small. Compared with the best **static budget** of a
  sweep (0.5-1.25x the cache) in the same run, each led by the same coordinator with
  ``tune_tokens = false`` (the same poll beside the callers, only the tuning differs); the
  static and tuned ways alternate, so a change of the machine's load falls on both.

Figures per way over a window after a warm-up: goodput (prompt + output tokens of the calls
completed per second), the simulator's preemptions in the window, each tenant's share of the
tokens completed (target: within 10 % of its weight's share, 0.75 / 0.25), and for the token
budget the estimate error the gate learnt (``gate.snapshot().token_usage``: 1 - tokens used
per token charged). Goals: goodput >= 1.2 x the best request-only cap, 0 preemptions; tuned
from either side: within 10 % of the stated cache in <= 8 polls, 0 preemptions in the window
(steady state), goodput >= 0.97 x the best static budget. The callers charge about 1.3 x what
their calls use, so the best static budget lies above the cache: the tuned budget is compared
with the cache in tokens used (the budget x the used / charged ratio the coordinator measures
from the settlements, ``docs/aimd.md``). Part of
the goodput comes from the shares themselves: by tokens, the chat tenant gets three quarters
of the cache, and short calls complete more tokens per KV token held than long ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from ._common import Flavor, Headline, Options, figure, log, open_fleet, save, table
from ._server import PREFIX, private_redis
from ._tokens_proxy import TENANT_HEADER, estimate_errors, proxy_for
from ._tokens_tuned import POLL, converged_at, effective, tuned_coordinator
from .burst import sim_process

NAME = "tokens"
KV_TOKENS, BLOCK, SLOTS, MS_PER_TOKEN, PREFILL_MS_PER_TOKEN = 16_384, 16, 64, 8.0, 0.01
KINDS = {"chat": (192, 64), "long": (3_840, 256)}  # prompt, output tokens
#: what each tenant sends: the chat service (weight 3) and a long-context team (weight 1)
KIND_OF = {"a": "chat", "b": "long"}
TENANTS = {"a": 3, "b": 1}
CALLERS = 48  # per tenant
GOODPUT_TARGET, SHARE_TOLERANCE = 1.2, 0.10
#: static token budgets tried, as multiples of the cache: 1x never overcommits it; above 1x it
#: counts on calls holding less than their peak most of the time (the headline is the 1x budget)
BUDGETS, QUICK_BUDGETS = (0.5, 0.75, 1.0, 1.25, 1.5), (0.5, 1.0, 1.25)
#: where the tuned ways' token_limit starts, as multiples of the cache
TUNED_FROM = (0.25, 4.0)
TUNED_GOODPUT, TUNED_POLLS = 0.97, 8


def prompt_text(tokens: int) -> str:
    """A prompt the simulator counts as ``tokens`` tokens (4 characters a token)."""
    return "word " * (tokens * 4 // 5) + "w" * (tokens * 4 % 5)


def charge(text: str, out: int) -> int:
    """What a caller without the server's tokenizer charges for a call: its prompt at 3
    characters a token (an estimate on the safe side: the server counts 4), plus
    ``max_tokens``, in whole KV blocks."""
    return math.ceil((math.ceil(len(text) / 3) + out) / BLOCK) * BLOCK


@dataclass
class Way:
    """One run: a gate's settings and what its calls completed."""

    label: str
    cap: int | None  # request-only cap, or None for a token budget
    budget: int = KV_TOKENS  # the token budget (with cap None): where a tuned one starts
    tuned: bool = False  # the coordinator tunes the budget
    led: bool = False  # a coordinator leads the gate (tuning or not)
    proxied: bool = False  # the calls go through fleetgate proxy (it estimates their tokens)
    proxy_errors: dict[str, dict[str, float]] = field(default_factory=dict)  # per route
    polls: list[dict[str, Any]] = field(default_factory=list)  # its decisions
    done: list[tuple[float, str, int]] = field(default_factory=list)  # (time, tenant, tokens)
    preemptions: int = 0
    window: float = 0.0
    usage: dict[str, Any] = field(default_factory=dict)

    def goodput(self) -> float:
        return sum(t for _, _, t in self.done) / self.window if self.window else 0.0

    def share(self, tenant: str) -> float:
        total = sum(t for _, _, t in self.done)
        return sum(t for _, x, t in self.done if x == tenant) / total if total else 0.0


async def _run_way(
    url: str, sim_url: str, way: Way, warm: float, window: float, flavor: Flavor
) -> None:
    """Drive the load through ``way``'s gate for ``warm + window`` seconds."""
    name = f"llm-{way.label}"
    settings: dict[str, Any] = {"tenant_weights": TENANTS, "max_queued": 10_000}
    if way.cap is None:
        settings |= {"floor": SLOTS, "token_limit": way.budget}
    else:
        settings |= {"floor": way.cap, "ceiling": way.cap}
    if way.led:
        settings["token_ceiling"] = 4 * KV_TOKENS
    stop_at = time.monotonic() + warm + window
    start = time.monotonic() + warm
    limits = httpx.Limits(max_connections=2 * CALLERS * len(TENANTS))
    async with contextlib.AsyncExitStack() as stack:
        if way.led:
            way.polls = await stack.enter_async_context(
                tuned_coordinator(url, PREFIX, sim_url, name, settings, TENANTS, tune=way.tuned)
            )
        fleet = await stack.enter_async_context(open_fleet(url, flavor))
        http = await stack.enter_async_context(
            httpx.AsyncClient(base_url=sim_url, limits=limits, timeout=120)
        )
        gate = fleet.gate(name, **settings)
        prompts = {kind: (prompt_text(p), out) for kind, (p, out) in KINDS.items()}
        via = http
        if way.proxied:  # the callers count no tokens: the proxy estimates them
            proxy_url = stack.enter_context(proxy_for(url, PREFIX, sim_url, name, list(KINDS)))
            via = await stack.enter_async_context(
                httpx.AsyncClient(base_url=proxy_url, limits=limits, timeout=120)
            )

        async def call(tenant: str) -> int:
            """One call of ``tenant``'s kind; the tokens its answer says it used."""
            kind = KIND_OF[tenant]
            text, out = prompts[kind]
            body = {"model": "sim-model", "prompt": text, "max_tokens": out}
            if way.proxied:
                resp = await via.post(
                    f"/{kind}/v1/completions", json=body, headers={TENANT_HEADER: tenant}
                )
                resp.raise_for_status()
                return int(resp.json()["usage"]["total_tokens"])
            tokens = charge(text, out) if way.cap is None else 0
            async with gate.permit(deadline=120, tenant=tenant, tokens=tokens) as lease:
                resp = await http.post("/v1/completions", json=body)
                resp.raise_for_status()
                used = int(resp.json()["usage"]["total_tokens"])
                lease.report("ok", tokens=used)
            return used

        async def caller(tenant: str) -> None:
            while time.monotonic() < stop_at:
                used = await call(tenant)
                now = time.monotonic()
                if start <= now <= stop_at:
                    way.done.append((now, tenant, used))

        callers = [asyncio.create_task(caller(t)) for t in TENANTS for _ in range(CALLERS)]
        await asyncio.sleep(warm)
        stats0 = (await http.get("/admin/stats")).json()
        await asyncio.sleep(window)
        stats1 = (await http.get("/admin/stats")).json()
        for task in callers:  # the calls still queued or running are not waited for
            task.cancel()
        await asyncio.gather(*callers, return_exceptions=True)
        way.preemptions = int(stats1["preemptions"]) - int(stats0["preemptions"])
        way.window = window
        if way.proxied:
            way.proxy_errors = await estimate_errors(str(via.base_url))
        snap = await gate.snapshot()
        way.usage = {
            t: {"reports": u.reports, "asked": u.asked, "used": u.used, "ratio": u.ratio}
            for t, u in snap.token_usage.items()
        }


def run(opts: Options) -> list[Headline]:
    caps = opts.pick([6, 8, 12, 16, 24, 32, 48], [8, 16, 32])
    warm, window = opts.pick((5.0, 40.0), (3.0, 15.0))
    ways = [Way(f"cap{n}", n) for n in caps]
    static = [
        Way(f"budget{f:g}x", None, round(f * KV_TOKENS), led=True)
        for f in opts.pick(BUDGETS, QUICK_BUDGETS)
    ]
    tuned = [
        Way(f"tuned{f:g}x", None, round(f * KV_TOKENS), tuned=True, led=True) for f in TUNED_FROM
    ]
    # alternate: the 1x budget, a tuned way, the rest of the sweep, the other tuned way
    one = next(w for w in static if w.budget == KV_TOKENS)
    ways += [one, tuned[0], *(w for w in static if w is not one), tuned[1]]
    # the proxy estimating the tokens of callers that count none, the budget tuned from 0.25x
    start = round(TUNED_FROM[0] * KV_TOKENS)
    ways.append(Way("proxy-tuned0.25x", None, start, tuned=True, led=True, proxied=True))
    sim_args = ["--capacity", str(SLOTS), "--kv-tokens", str(KV_TOKENS)]
    sim_args += ["--block-size", str(BLOCK), "--ms-per-token", str(MS_PER_TOKEN)]
    sim_args += ["--prefill-ms-per-token", str(PREFILL_MS_PER_TOKEN)]
    with private_redis() as rp, sim_process("vllm", *sim_args) as sim:
        for way in ways:
            # a tuned way's warm-up holds its convergence (<= 8 polls) and a drain period
            w = max(warm, (TUNED_POLLS + 3) * POLL) if way.tuned else warm
            log(f"{NAME}: {way.label} ({w:.0f} s warm-up, {window:.0f} s window)")
            opts.flavor.run(_run_way(rp.url, sim.url, way, w, window, opts.flavor))
        return _report(opts, rp.url, ways)


def _report(opts: Options, url: str, ways: list[Way]) -> list[Headline]:
    static = [w for w in ways if w.cap is not None]
    best = max(static, key=Way.goodput)
    budgets = [w for w in ways if w.cap is None and not w.tuned]
    budget = next(w for w in budgets if w.budget == KV_TOKENS)
    ratio = budget.goodput() / best.goodput() if best.goodput() else 0.0
    best_budget = max(budgets, key=Way.goodput)
    tuned = [w for w in ways if w.tuned and not w.proxied]
    proxied = [w for w in ways if w.proxied]
    weight_share = {t: w / sum(TENANTS.values()) for t, w in TENANTS.items()}
    rows = [
        (
            w.label,
            f"{w.goodput():,.0f}",
            f"{w.goodput() / best.goodput():.2f}" if best.goodput() else "-",
            w.preemptions,
            f"{w.share('a'):.3f}",
            len(w.done),
        )
        for w in ways
    ]
    text = table(("way", "tokens/s", "vs best cap", "preemptions", "share a", "calls"), rows)
    usage = budget.usage
    errors = {t: 1 - (u["ratio"] or 0.0) for t, u in usage.items()}
    text += (
        f"\nbest request-only cap: {best.label}; token budget / best cap = {ratio:.2f} "
        f"(target >= {GOODPUT_TARGET}); tenant a's share {budget.share('a'):.3f} "
        f"(weight share {weight_share['a']:.2f} +- {SHARE_TOLERANCE:.0%}); estimate error "
        + ", ".join(f"{t or 'default'} {e:.1%}" for t, e in sorted(errors.items()))
    )
    share_ok = all(abs(budget.share(t) - s) <= SHARE_TOLERANCE * s for t, s in weight_share.items())
    tuned_rows, tuned_data = _tuned_figures(tuned, best_budget)
    text += "\n\n" + table(
        (
            "tuned from",
            "within 10 % at poll",
            "budget at the end",
            "used / charged",
            "in use / cache",
            "preemptions",
            "vs best budget",
        ),
        tuned_rows,
    )
    text += f"\nbest static token budget: {best_budget.label}"
    proxy_rows, proxy_data = _proxy_figures(proxied)
    text += "\n\n" + table(
        ("proxied way", "route", "calls", "asked", "used", "mean error", "within 10 % at poll"),
        proxy_rows,
    )
    data = {
        "kv_tokens": KV_TOKENS,
        "block_size": BLOCK,
        "slots": SLOTS,
        "ms_per_token": MS_PER_TOKEN,
        "prefill_ms_per_token": PREFILL_MS_PER_TOKEN,
        "kinds": KINDS,
        "kind_of": KIND_OF,
        "tenants": TENANTS,
        "ways": [
            {
                "label": w.label,
                "cap": w.cap,
                "token_budget": None if w.cap is not None else w.budget,
                "goodput_tokens_per_s": w.goodput(),
                "preemptions": w.preemptions,
                "share": {t: w.share(t) for t in TENANTS},
                "calls": len(w.done),
                "token_usage": w.usage,
            }
            for w in ways
        ],
        "best_cap": best.label,
        "budget_vs_best_cap": ratio,
        "estimate_error": errors,
        "best_static_budget": best_budget.label,
        "tuned": tuned_data,
        "proxied": proxy_data,
    }
    fig, ax = figure(3)
    labels = [w.label for w in ways]
    colors = ["C0"] * len(static) + ["C2"] * (len(ways) - len(static))
    ax[0][0].bar(labels, [w.goodput() for w in ways], color=colors)
    ax[0][0].set_ylabel("goodput (tokens completed / s)")
    ax[0][0].set_title("request-only caps vs a token budget")
    ax[0][1].bar(labels, [w.preemptions for w in ways], color=colors)
    ax[0][1].set_ylabel("preemptions in the window")
    ax[0][1].set_title(f"KV cache {KV_TOKENS:,} tokens, {SLOTS} slots")
    for w in tuned:
        ax[0][2].plot([p["budget"] for p in w.polls], marker=".", label=w.label)
    ax[0][2].axhline(KV_TOKENS, color="grey", linestyle="--", label="stated KV cache")
    ax[0][2].set_yscale("log", base=2)
    ax[0][2].set_xlabel(f"poll ({POLL:g} s)")
    ax[0][2].set_ylabel("token budget published")
    ax[0][2].set_title("the coordinator tuning the budget")
    ax[0][2].legend()
    save(NAME, opts, url, data, text, fig)
    return [
        *_tuned_headlines(tuned_data),
        *_proxy_headlines(proxy_data),
        Headline(
            NAME,
            "goodput: token budget / best request-only cap",
            f"{ratio:.2f}",
            f">= {GOODPUT_TARGET}",
            ratio >= GOODPUT_TARGET,
        ),
        Headline(
            NAME,
            "preemptions with the token budget",
            str(budget.preemptions),
            "0",
            budget.preemptions == 0,
        ),
        Headline(
            NAME,
            "tenant a's share of tokens (weight 3 of 4)",
            f"{budget.share('a'):.3f}",
            f"0.75 +- {SHARE_TOLERANCE:.0%}",
            share_ok,
        ),
    ]


def _tuned_figures(
    tuned: list[Way], best_budget: Way
) -> tuple[list[tuple[Any, ...]], dict[str, Any]]:
    """Per tuned way: the poll from which its budget stays within 10 % of the stated cache, its
    preemptions in the window (steady state) and its goodput against the best static budget."""
    rows, data = [], {}
    for w in tuned:
        at = converged_at(w.polls, KV_TOKENS)
        vs = w.goodput() / best_budget.goodput() if best_budget.goodput() else 0.0
        end = w.polls[-1] if w.polls else None
        ratio = end.get("use_ratio") if end else None
        rows.append(
            (
                w.label,
                at if at is not None else "never",
                end["budget"] if end else "-",
                f"{ratio:.3f}" if ratio else "-",
                f"{effective(end) / KV_TOKENS:.3f}" if end else "-",
                w.preemptions,
                f"{vs:.3f}",
            )
        )
        data[w.label] = {
            "start": w.budget,
            "converged_at_poll": at,
            "vs_best_static_budget": vs,
            "preemptions": w.preemptions,
            "polls": w.polls,
        }
    return rows, data


def _tuned_headlines(data: dict[str, Any]) -> list[Headline]:
    polls = [d["converged_at_poll"] for d in data.values()]
    worst = max((p if p is not None else 10**9 for p in polls), default=10**9)
    vs = min((d["vs_best_static_budget"] for d in data.values()), default=0.0)
    pre = sum(d["preemptions"] for d in data.values())
    return [
        Headline(
            NAME,
            "tuned budget within 10 % of the cache, from 0.25x and 4x: at poll (worst)",
            str(worst) if worst < 10**9 else "never",
            f"<= {TUNED_POLLS}",
            worst <= TUNED_POLLS,
        ),
        Headline(NAME, "preemptions in steady state, tuned (both)", str(pre), "0", pre == 0),
        Headline(
            NAME,
            "goodput: tuned / best static budget (worse of both)",
            f"{vs:.3f}",
            f">= {TUNED_GOODPUT}",
            vs >= TUNED_GOODPUT,
        ),
    ]


def _proxy_figures(proxied: list[Way]) -> tuple[list[tuple[Any, ...]], dict[str, Any]]:
    """Per proxied way and route: the proxy's estimates against the answers' usage."""
    rows, data = [], {}
    for w in proxied:
        at = converged_at(w.polls, KV_TOKENS)
        for route, e in sorted(w.proxy_errors.items()):
            rows.append(
                (w.label, route, int(e["calls"]), int(e["asked"]), int(e["used"]),
                 f"{e['mean_error']:.1%}", at if at is not None else "never")
            )  # fmt: skip
        data[w.label] = {
            "routes": w.proxy_errors,
            "converged_at_poll": at,
            "preemptions": w.preemptions,
            "goodput_tokens_per_s": w.goodput(),
            "polls": w.polls,
        }
    return rows, data


def _proxy_headlines(data: dict[str, Any]) -> list[Headline]:
    errors = [e["mean_error"] for d in data.values() for e in d["routes"].values()]
    worst = max(errors, default=float("nan"))
    return [
        Headline(
            NAME,
            "proxy: mean estimate error, worst route",
            f"{worst:.1%}",
            "<= 20 %",
            bool(errors) and worst <= 0.20,
        )
    ]
