"""Token budgets through ``fleetgate proxy`` (a route's ``tokens = "openai"``): the permit asks
what the OpenAI-compatible body estimates (prompt + output), the gate's token budget holds across
proxied calls, the answer's ``usage`` settles the call (``gate.snapshot().token_usage``), a
stream the proxy asked ``include_usage`` for reaches the caller byte for byte as without it, and
a route without the option is unchanged. Against a real redis-server and the test upstream's
OpenAI-like endpoints (``_proxy.openai_routes``)."""

from __future__ import annotations

import logging
import re
import statistics
import threading
import time
from typing import Any

import httpx
import openai
import pytest
import redis

from fleetgate.admission import tokens_of
from fleetgate.keys import GateKeys
from fleetgate.observed import TokenUsage
from fleetgate.proxy import _tokens
from fleetgate.tools.sim._server import Served

from ..conftest import RedisUnderTest
from ._proxy import serve_proxy, upstream_log, wait_idle, wait_until

BUDGET = {"floor": 50, "token_limit": 100_000}
CHAT = "/v1/chat/completions"


def _held(rut: RedisUnderTest, gate: str = "g") -> list[int]:
    """The tokens of each lease ``gate`` holds now (they are in the lease ids)."""
    keys = GateKeys.of(rut.prefix, gate)
    with redis.Redis.from_url(rut.url) as r:
        return [tokens_of(m.decode()) for m in r.zrange(keys.holders, 0, -1)]


def _usage(rut: RedisUnderTest, gate: str = "g") -> dict[str, TokenUsage]:
    with redis.Redis.from_url(rut.url) as r:
        return TokenUsage.parse(r.hgetall(GateKeys.of(rut.prefix, gate).obs))


def _during(rut: RedisUnderTest, call: Any) -> tuple[Any, list[int]]:
    """``call()`` on a thread; the tokens held once the gate holds its permit."""
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(call()))
    thread.start()
    wait_until(lambda: bool(_held(rut)), 10, "a permit held")
    held = _held(rut)
    thread.join(10)
    return result[0], held


def _chat_body(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": text}], **extra}


def test_the_permit_asks_the_bodys_estimate(rut: RedisUnderTest, upstream: Served) -> None:
    """Chat: characters / 4 per message + 4 a message + 3, plus max_tokens (times n); the
    route's output_tokens without one; completions: the prompt; embeddings: the inputs only.
    X-Fleetgate-Tokens wins; a body that is not JSON asks none and is forwarded as it is."""
    text = "x" * 400  # 100 tokens
    hold = {"x-hold-ms": "300"}
    route = {"tokens": "openai", "output_tokens": 64, "gate_defaults": BUDGET}
    with serve_proxy(rut, upstream, **route) as url, httpx.Client(base_url=url, timeout=10) as h:

        def post(path: str, body: Any, **headers: str) -> Any:
            return lambda: h.post(path, json=body, headers={**hold, **headers})

        cases = [
            (post(CHAT, _chat_body(text, max_tokens=50)), 100 + 4 + 3 + 50),
            (post(CHAT, _chat_body(text, max_completion_tokens=20, max_tokens=50, n=2)), 107 + 40),
            (post(CHAT, _chat_body(text)), 107 + 64),
            (post("/v1/completions", {"prompt": [text, text], "max_tokens": 10}), 200 + 10),
            (post("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 10}), 3 + 10),
            (post(CHAT, _chat_body(text), **{"X-Fleetgate-Tokens": "999"}), 999),
        ]
        for call, expected in cases:
            response, held = _during(rut, call)
            assert response.status_code == 200, response.text
            assert held == [expected]
        # not JSON: no tokens, forwarded untouched (the upstream's own error)
        r = h.post(CHAT, content=b"not json", headers={"content-type": "text/plain"})
        assert r.status_code == 500 and r.text == "Internal Server Error"
    wait_idle(rut.url, rut.prefix, "g")


def test_embeddings_and_bad_bodies(
    rut: RedisUnderTest, upstream: Served, caplog: pytest.LogCaptureFixture
) -> None:
    """Embeddings ask their inputs' tokens and no output; a body of another shape asks none
    and is answered by the upstream as without the proxy (never a proxy error)."""
    caplog.set_level(logging.INFO, logger="fleetgate.proxy.access")
    route = {"tokens": "openai", "gate_defaults": BUDGET}
    with serve_proxy(rut, upstream, **route) as url, httpx.Client(base_url=url, timeout=10) as h:
        r = h.post("/v1/embeddings", json={"model": "e", "input": ["abcd" * 10, "abcd"]})
        assert r.status_code == 200
        r = h.post("/v1/embeddings", json={"model": "e", "input": "abcdefgh"})
        assert r.status_code == 200
        r = h.post("/echo", json=_chat_body("hello", max_tokens=5))  # not an OpenAI path
        assert r.status_code == 200
    lines = [x.getMessage() for x in caplog.records if x.name == "fleetgate.proxy.access"]
    assert " tokens=11 used=" in lines[0], lines  # 10 + 1
    assert " tokens=2 used=" in lines[1], lines
    assert "tokens=" not in lines[2], lines
    wait_idle(rut.url, rut.prefix, "g")


def test_a_route_without_the_option_is_unchanged(rut: RedisUnderTest, upstream: Served) -> None:
    """Off by default: no tokens asked, the body forwarded as sent (no include_usage added),
    nothing settled."""
    body = _chat_body("hello there", max_tokens=8, stream=True)
    with serve_proxy(rut, upstream) as url, httpx.Client(base_url=url, timeout=10) as h:
        response, held = _during(rut, lambda: h.post(CHAT, json=body, headers={"x-hold-ms": "300"}))
        assert response.status_code == 200
        assert held == [0]
    assert upstream_log(upstream).bodies == [body]
    assert _usage(rut) == {}
    wait_idle(rut.url, rut.prefix, "g")


def test_the_token_budget_holds_across_concurrent_proxied_calls(
    rut: RedisUnderTest, upstream: Served
) -> None:
    """12 calls of ~300 tokens at once under a 1,000-token budget (and 50 units): at most 3 run
    at a time, and the tokens held never pass the budget."""
    budget = {"floor": 50, "token_limit": 1000}
    route = {"tokens": "openai", "gate_defaults": budget}
    body = _chat_body("x" * 1000, max_tokens=43)  # 250 + 7 + 43 = 300
    peak = [0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], sum(_held(rut)))
            time.sleep(0.005)

    with serve_proxy(rut, upstream, **route) as url:
        watcher = threading.Thread(target=watch)
        watcher.start()

        def call(_: int) -> int:
            with httpx.Client(base_url=url, timeout=30) as h:
                return h.post(CHAT, json=body, headers={"x-hold-ms": "150"}).status_code

        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(12) as pool:
            statuses = list(pool.map(call, range(12)))
        stop.set()
        watcher.join()
    assert statuses == [200] * 12
    assert upstream_log(upstream).peak == 3
    assert 600 <= peak[0] <= 1000, peak
    wait_idle(rut.url, rut.prefix, "g")


def test_answers_settle_the_tokens_they_used(rut: RedisUnderTest, upstream: Served) -> None:
    """The usage of a JSON answer and of a stream's last chunk is reported with the release:
    the tenant's token_usage counts every call, asked and used."""
    route = {"tokens": "openai", "tenants": ["*"], "gate_defaults": BUDGET}
    with serve_proxy(rut, upstream, **route) as url, httpx.Client(base_url=url, timeout=10) as h:
        tenant = {"X-Fleetgate-Tenant": "team"}
        for stream in (False, True, False, True):
            body = _chat_body("the quick brown fox", max_tokens=20, stream=stream)
            r = h.post(CHAT, json=body, headers={**tenant, "x-output-tokens": "12"})
            assert r.status_code == 200
        r = h.post("/v1/embeddings", json={"input": "hello world"}, headers=tenant)
        assert r.status_code == 200
        wait_until(lambda: _usage(rut).get("team", TokenUsage()).reports == 5, 10, "5 reports")
    usage = _usage(rut)["team"]
    assert usage.used == sum(upstream_log(upstream).used)
    assert usage.asked == 4 * (5 + 4 + 3 + 20) + 3  # chars/4 of the prompt + overheads + bound
    wait_idle(rut.url, rut.prefix, "g")


def _stream(url: str, body: dict[str, Any]) -> bytes:
    with httpx.Client(timeout=10) as h, h.stream("POST", url + CHAT, json=body) as r:
        assert r.status_code == 200
        return b"".join(r.iter_raw())


@pytest.mark.parametrize("options", [None, {"include_usage": False}])
def test_a_stream_is_unchanged_byte_for_byte_when_the_proxy_added_include_usage(
    rut: RedisUnderTest, upstream: Served, options: dict[str, bool] | None
) -> None:
    """The proxy asks the upstream for the usage chunk (and the upstream then puts
    ``"usage":null`` in every chunk, as OpenAI's API does); the caller's stream is what the
    upstream sends without the option, and the call is settled from it."""
    body = _chat_body("a streamed question", max_tokens=30, stream=True)
    if options is not None:
        body["stream_options"] = options
    direct = _stream(upstream.url, body)
    assert b'"usage"' not in direct
    route = {"tokens": "openai", "gate_defaults": BUDGET}
    with serve_proxy(rut, upstream, **route) as url:
        proxied = _stream(url, body)
        wait_until(lambda: _usage(rut).get("", TokenUsage()).reports == 1, 10, "a report")
    assert proxied == direct
    seen = upstream_log(upstream).bodies
    assert seen[1]["stream_options"]["include_usage"] is True
    assert {k: v for k, v in seen[1].items() if k != "stream_options"} == {
        k: v for k, v in body.items() if k != "stream_options"
    }
    assert _usage(rut)[""].used == upstream_log(upstream).used[-1]
    wait_idle(rut.url, rut.prefix, "g")


def test_a_caller_that_asked_for_usage_gets_it(rut: RedisUnderTest, upstream: Served) -> None:
    body = _chat_body("hi", max_tokens=5, stream=True, stream_options={"include_usage": True})
    route = {"tokens": "openai", "gate_defaults": BUDGET}
    with serve_proxy(rut, upstream, **route) as url:
        proxied = _stream(url, body)
        wait_until(lambda: _usage(rut).get("", TokenUsage()).reports == 1, 10, "a report")
    assert proxied == _stream(upstream.url, body)
    assert b'"usage":{' in proxied and proxied.count(b'"usage":null') == 5
    wait_idle(rut.url, rut.prefix, "g")


def test_through_the_openai_sdk(rut: RedisUnderTest, upstream: Served) -> None:
    """The real SDK, plain and streamed: the answers are whole, the calls settled."""
    route = {"tokens": "openai", "gate_defaults": BUDGET}
    with serve_proxy(rut, upstream, **route) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-test", timeout=20)
        with client:
            messages: Any = [{"role": "user", "content": "What is a token budget?"}]
            answer = client.chat.completions.create(model="m", messages=messages, max_tokens=9)
            assert answer.usage is not None and answer.usage.completion_tokens == 9
            chunks = list(
                client.chat.completions.create(
                    model="m", messages=messages, max_tokens=7, stream=True
                )
            )
            assert len(chunks) == 7 and all(c.usage is None for c in chunks)
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            assert text == "word " * 7
            embedded = client.embeddings.create(model="e", input=["one", "two"])
            assert embedded.usage.total_tokens == 2
        wait_until(lambda: _usage(rut).get("", TokenUsage()).reports == 3, 10, "3 reports")
    assert _usage(rut)[""].used == sum(upstream_log(upstream).used)
    wait_idle(rut.url, rut.prefix, "g")


# -- the estimate's error on a realistic mix ------------------------------------------------------

_WORDS = (
    "the model answers questions about invoices shipping routes and the customer's account "
    "history; it summarises tickets, drafts replies, extracts dates, amounts and names, "
    "translates short passages and explains error messages step by step"
).split()


def _text(rng: Any, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words)).capitalize() + "."


@pytest.mark.long
def test_the_estimate_error_on_a_realistic_mix(
    rut: RedisUnderTest,
    upstream: Served,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A mix of chat calls (system + user, 20-400 words; with max_tokens the answer uses 60-100
    % of it; without, 40-200 tokens, learnt after 20 reports), completions and embeddings: the
    estimate error |asked - used| / used per call, as the access log and the metric
    ``fleetgate_proxy_token_estimate_error`` say, printed per kind."""
    import random

    monkeypatch.setattr(_tokens, "REFRESH_S", 0.2)
    caplog.set_level(logging.INFO, logger="fleetgate.proxy.access")
    rng = random.Random(7)
    route = {"tokens": "openai", "output_tokens": 256, "gate_defaults": BUDGET}
    kinds: list[str] = []
    with serve_proxy(rut, upstream, **route) as url, httpx.Client(base_url=url, timeout=10) as h:
        for i in range(200):
            kind = rng.choice(["chat+max", "chat+max", "chat", "chat", "completions", "embed"])
            kinds.append(kind)
            if kind == "embed":
                texts = [_text(rng, rng.randint(5, 60)) for _ in range(rng.randint(1, 4))]
                r = h.post("/v1/embeddings", json={"model": "e", "input": texts})
            else:
                bound = rng.randint(50, 400)
                out = (
                    rng.randint(int(bound * 0.6), bound) if "max" in kind else rng.randint(40, 200)
                )
                headers = {"x-output-tokens": str(out)}
                if kind == "completions":
                    body: dict[str, Any] = {"prompt": _text(rng, rng.randint(20, 400))}
                    body["max_tokens"] = bound
                else:
                    system = {"role": "system", "content": _text(rng, rng.randint(10, 40))}
                    user = {"role": "user", "content": _text(rng, rng.randint(20, 400))}
                    body = {"model": "m", "messages": [system, user]}
                    if kind == "chat+max":
                        body["max_tokens"] = bound
                    body["stream"] = bool(i % 2)
                r = h.post(
                    f"/v1/{'chat/completions' if 'chat' in kind else kind}",
                    json=body,
                    headers=headers,
                )
            assert r.status_code == 200, r.text
            if i == 60:
                time.sleep(0.5)  # the learnt use read (it refreshes in the background)
        count = 'fleetgate_proxy_token_estimate_error_count{route="/"} 200.0'
        wait_until(lambda: count in h.get("/metrics").text, 10, "200 settled")  # (the last's
        metrics = h.get("/metrics").text  # accounting follows its answer)
    lines = [x.getMessage() for x in caplog.records if x.name == "fleetgate.proxy.access"]
    lines = [line for line in lines if " err=" in line]
    assert len(lines) == 200
    errors: dict[str, list[float]] = {}
    for i, (kind, line) in enumerate(zip(kinds, lines, strict=True)):
        err = float(re.search(r" err=([\d.]+)", line).group(1))  # type: ignore[union-attr]
        key = kind if kind != "chat" else ("chat (learnt)" if i > 60 else "chat (default)")
        errors.setdefault(key, []).append(err)
    report = {k: (len(v), statistics.median(v), statistics.mean(v)) for k, v in errors.items()}
    every = [e for v in errors.values() for e in v]
    print("\nestimate error |asked - used| / used per kind (calls, median, mean):")
    for k, (n, med, mean) in sorted(report.items()):
        print(f"  {k:16} {n:4} {med:6.1%} {mean:6.1%}")
    print(
        f"  {'all':16} {len(every):4} {statistics.median(every):6.1%} {statistics.mean(every):6.1%}"
    )
    m = re.search(r'fleetgate_proxy_token_estimate_error_sum\{route="/"\} (\S+)', metrics)
    c = re.search(r'fleetgate_proxy_token_estimate_error_count\{route="/"\} (\S+)', metrics)
    assert m is not None and c is not None and float(c.group(1)) == 200
    print(f"  metric mean: {float(m.group(1)) / float(c.group(1)):.1%}")
    assert report["embed"][1] < 0.3  # the prompt alone: characters / 4 vs the server's count
    assert report["chat (learnt)"][1] < report["chat (default)"][1]
    wait_idle(rut.url, rut.prefix, "g")
