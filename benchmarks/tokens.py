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

Figures per way over a window after a warm-up: goodput (prompt + output tokens of the calls
completed per second), the simulator's preemptions in the window, each tenant's share of the
tokens completed (target: within 10 % of its weight's share, 0.75 / 0.25), and for the token
budget the estimate error the gate learnt (``gate.snapshot().token_usage``: 1 - tokens used
per token charged). Goals: goodput >= 1.2 x the best request-only cap, 0 preemptions. Part of
the goodput comes from the shares themselves: by tokens, the chat tenant gets three quarters
of the cache, and short calls complete more tokens per KV token held than long ones.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from ._common import Flavor, Headline, Options, figure, log, open_fleet, save, table
from ._server import private_redis
from .burst import sim_process

NAME = "tokens"
KV_TOKENS, BLOCK, SLOTS, MS_PER_TOKEN, PREFILL_MS_PER_TOKEN = 16_384, 16, 64, 8.0, 0.01
KINDS = {"chat": (192, 64), "long": (3_840, 256)}  # prompt, output tokens
#: what each tenant sends: the chat service (weight 3) and a long-context team (weight 1)
KIND_OF = {"a": "chat", "b": "long"}
TENANTS = {"a": 3, "b": 1}
CALLERS = 48  # per tenant
GOODPUT_TARGET, SHARE_TOLERANCE = 1.2, 0.10
#: token budgets tried, as multiples of the cache: 1x never overcommits it; above 1x it counts
#: on calls holding less than their peak most of the time (the headline is the 1x budget)
BUDGETS = (1.0,)


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
    budget: int = KV_TOKENS  # the token budget (with cap None)
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
    stop_at = time.monotonic() + warm + window
    start = time.monotonic() + warm
    limits = httpx.Limits(max_connections=2 * CALLERS * len(TENANTS))
    async with (
        open_fleet(url, flavor) as fleet,
        httpx.AsyncClient(base_url=sim_url, limits=limits, timeout=120) as http,
    ):
        gate = fleet.gate(name, **settings)
        prompts = {kind: (prompt_text(p), out) for kind, (p, out) in KINDS.items()}

        async def caller(tenant: str) -> None:
            while time.monotonic() < stop_at:
                text, out = prompts[KIND_OF[tenant]]
                tokens = charge(text, out) if way.cap is None else 0
                body = {"model": "sim-model", "prompt": text, "max_tokens": out}
                async with gate.permit(deadline=120, tenant=tenant, tokens=tokens) as lease:
                    resp = await http.post("/v1/completions", json=body)
                    resp.raise_for_status()
                    used = int(resp.json()["usage"]["total_tokens"])
                    lease.report("ok", tokens=used)
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
        snap = await gate.snapshot()
        way.usage = {
            t: {"reports": u.reports, "asked": u.asked, "used": u.used, "ratio": u.ratio}
            for t, u in snap.token_usage.items()
        }


def run(opts: Options) -> list[Headline]:
    caps = opts.pick([6, 8, 12, 16, 24, 32, 48], [8, 16, 32])
    warm, window = opts.pick((5.0, 40.0), (3.0, 15.0))
    ways = [Way(f"cap{n}", n) for n in caps]
    ways += [Way(f"budget{f:g}x", None, round(f * KV_TOKENS)) for f in BUDGETS]
    sim_args = ["--capacity", str(SLOTS), "--kv-tokens", str(KV_TOKENS)]
    sim_args += ["--block-size", str(BLOCK), "--ms-per-token", str(MS_PER_TOKEN)]
    sim_args += ["--prefill-ms-per-token", str(PREFILL_MS_PER_TOKEN)]
    with private_redis() as rp, sim_process("vllm", *sim_args) as sim:
        for way in ways:
            log(f"{NAME}: {way.label} ({warm:.0f} s warm-up, {window:.0f} s window)")
            opts.flavor.run(_run_way(rp.url, sim.url, way, warm, window, opts.flavor))
        return _report(opts, rp.url, ways)


def _report(opts: Options, url: str, ways: list[Way]) -> list[Headline]:
    static = [w for w in ways if w.cap is not None]
    best = max(static, key=Way.goodput)
    budget = next(w for w in ways if w.cap is None)
    ratio = budget.goodput() / best.goodput() if best.goodput() else 0.0
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
    }
    fig, ax = figure(2)
    labels = [w.label for w in ways]
    colors = ["C0"] * len(static) + ["C2"] * (len(ways) - len(static))
    ax[0][0].bar(labels, [w.goodput() for w in ways], color=colors)
    ax[0][0].set_ylabel("goodput (tokens completed / s)")
    ax[0][0].set_title("request-only caps vs a token budget")
    ax[0][1].bar(labels, [w.preemptions for w in ways], color=colors)
    ax[0][1].set_ylabel("preemptions in the window")
    ax[0][1].set_title(f"KV cache {KV_TOKENS:,} tokens, {SLOTS} slots")
    save(NAME, opts, url, data, text, fig)
    return [
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
