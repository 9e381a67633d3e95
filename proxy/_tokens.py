"""Token budgets through the proxy, for OpenAI-compatible routes (``tokens = "openai"``).

Before the permit (:class:`TokenPlan.estimate`): a POST to ``/v1/chat/completions``,
``/v1/completions`` or ``/v1/embeddings`` whose whole body is JSON of that shape asks the gate
for *prompt tokens + output tokens*:

* the prompt: the body's text counted by the route's ``tokenizer`` -- by default no tokenizer,
  ``ceil(characters / 4)`` per text, plus :data:`MESSAGE_OVERHEAD` tokens per chat message and
  :data:`REPLY_PRIMING` for the reply (the chat template's tokens); token-id prompts are their
  length; a chat's ``tools`` and ``response_format`` are counted as their JSON text;
* the output: ``max_completion_tokens`` (else ``max_tokens``) when the body gives one; else the
  tenant's learnt use (the gate's ``token_usage``, fleet-wide, from a snapshot cached per gate
  and refreshed in the background at most every :data:`REFRESH_S`: no Redis call on a request's
  path); else the route's ``output_tokens``; times ``n`` (``best_of``) sequences. Embeddings
  have no output.

Any other body (not JSON, not this shape, another path or method) asks no tokens, as before.

After the answer (:class:`Settle`): its ``usage`` -- a JSON answer's, or a stream's last usage
chunk -- is what the call used, reported with the permit's release
(``lease.report(outcome, tokens=used)``). A streamed request that did not ask for
``stream_options.include_usage`` gets it added upstream (``stream_usage``, on by default), and the
usage-only chunk that adds -- and the ``"usage":null`` member some servers then put in every
chunk -- is taken out of what the caller receives, so its stream is byte for byte what the
upstream sends without the option. Only events holding the bytes ``"usage"`` are decoded.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import math
import re
from collections.abc import Callable
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from fleetgate.admission import MAX_TOKENS
from fleetgate.client import Gate
from fleetgate.observed import TokenUsage

__all__ = [
    "MESSAGE_OVERHEAD",
    "REFRESH_S",
    "REPLY_PRIMING",
    "Estimate",
    "Learnt",
    "Settle",
    "SseTap",
    "TokenPlan",
    "load_tokenizer",
    "used_of_json",
]

log = logging.getLogger("fleetgate.proxy")

#: tokens a chat template adds per message (role markers, separators), and for the reply's start
MESSAGE_OVERHEAD = 4
REPLY_PRIMING = 3
#: the learnt use is read from a gate snapshot at most this often (seconds), in the background
REFRESH_S = 5.0
#: a JSON answer larger than this is not parsed for its usage (nothing settled)
MAX_ANSWER_PARSE = 4 * 1024 * 1024
#: an SSE event larger than this (no end in sight) stops the tap: the rest passes untouched
MAX_EVENT = 1024 * 1024

CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
KINDS = (CHAT, COMPLETIONS, EMBEDDINGS)

Tokenizer = Callable[[str], int]


def chars_over_4(text: str) -> int:
    """The tokenizer-free count: one token per 4 characters, rounded up."""
    return -(-len(text) // 4)


def load_tokenizer(spec: str) -> Tokenizer:
    """The route's ``tokenizer``: ``""`` (characters / 4), ``"tiktoken:<encoding>"`` or
    ``"module:function"`` (a callable taking the text, returning its token count). Raises
    ValueError (or ImportError) when it cannot be loaded."""
    if not spec:
        return chars_over_4
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"expected 'module:function' or 'tiktoken:<encoding>', got {spec!r}")
    if module == "tiktoken":
        tiktoken = importlib.import_module("tiktoken")
        encoding = tiktoken.get_encoding(name)

        def count(text: str) -> int:
            return len(encoding.encode(text, disallowed_special=()))

        return count
    found: Any = importlib.import_module(module)
    for part in name.split("."):
        found = getattr(found, part)
    if not callable(found):
        raise ValueError(f"{spec!r} is not callable")
    tokenizer: Tokenizer = found
    return tokenizer


# -- the request body ---------------------------------------------------------------------------


class _Message(msgspec.Struct):
    content: Any = None
    name: str | None = None
    tool_calls: msgspec.Raw | None = None


class _StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


class _Body(msgspec.Struct):
    """The fields of an OpenAI-compatible request the estimate reads (others are skipped)."""

    messages: list[_Message] | None = None
    prompt: Any = None
    input: Any = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = None
    best_of: int | None = None
    stream: bool | None = None
    stream_options: _StreamOptions | UnsetType | None = UNSET
    tools: msgspec.Raw | None = None
    response_format: msgspec.Raw | None = None


class Estimate(msgspec.Struct, frozen=True):
    """A request's token estimate: ``prompt`` + ``output`` held at the peak; ``source`` says
    where the output came from (``max_tokens``, ``learnt``, ``default``, ``none``);
    ``body`` the body to send upstream when ``include_usage`` was added (else None)."""

    prompt: int
    output: int
    source: str
    body: bytes | None = None
    added_usage: bool = False

    @property
    def tokens(self) -> int:
        return self.prompt + self.output


def _text_tokens(value: Any, count: Tokenizer) -> int:
    """A prompt or input: a string, a list of strings, token ids or lists of token ids."""
    if isinstance(value, str):
        return count(value)
    if isinstance(value, list):
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return len(value)
        return sum(_text_tokens(v, count) for v in value)
    return 0


def _content_tokens(content: Any, count: Tokenizer) -> int:
    """A chat message's content: a string, or parts (``{"type": "text", "text": ...}``; other
    parts -- images, audio -- are not estimated)."""
    if isinstance(content, str):
        return count(content)
    if isinstance(content, list):
        total = 0
        for part in content:
            if isinstance(part, str):
                total += count(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                total += count(part["text"])
        return total
    return 0


def _with_usage(body: bytes, parsed: _Body) -> bytes | None:
    """``body`` with ``stream_options.include_usage`` true: spliced after the opening brace
    when the body has no ``stream_options``, else re-encoded. None when it cannot be done."""
    if parsed.stream_options is UNSET:
        stripped = body.lstrip()
        if not stripped.startswith(b"{"):
            return None
        rest = stripped[1:]
        sep = b"," if rest.strip() != b"}" else b""
        return b'{"stream_options":{"include_usage":true}' + sep + rest
    try:
        whole = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return None
    if not isinstance(whole, dict):
        return None
    options = whole.get("stream_options")
    whole["stream_options"] = {
        **(options if isinstance(options, dict) else {}),
        "include_usage": True,
    }
    return msgspec.json.encode(whole)


class Learnt:
    """What one gate's tenants use (``gate.snapshot().token_usage``) and its token ceiling,
    from a snapshot refreshed in the background at most every :data:`REFRESH_S` seconds."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        self.usage: dict[str, TokenUsage] = {}
        self.ceiling: int | None = None
        self.at = -math.inf
        self.done = False  # a snapshot was read
        self._task: asyncio.Task[None] | None = None

    def read(self) -> None:
        """Start a refresh when the last is older than :data:`REFRESH_S` (never waited for)."""
        now = asyncio.get_running_loop().time()
        if now - self.at < REFRESH_S or (self._task is not None and not self._task.done()):
            return
        self.at = now
        self._task = asyncio.ensure_future(self._refresh())

    async def _refresh(self) -> None:
        try:
            snap = await self.gate.snapshot()
        except Exception as exc:  # Redis unreachable: keep what was learnt
            log.debug("proxy: token usage of gate %r not read: %s", self.gate.name, exc)
            return
        self.usage = snap.token_usage
        self.done = True
        self.ceiling = snap.token_ceiling if snap.token_ceiling is not None else snap.token_limit

    async def ready(self, timeout: float) -> None:
        """The first snapshot, waited for up to ``timeout`` seconds (once per gate and process:
        the ceiling an estimate is clamped to); later ones are never waited for."""
        if self.done:
            return
        self.read()
        task = self._task
        if task is not None and not task.done():
            await asyncio.wait({task}, timeout=timeout)

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


class TokenPlan:
    """One route's token estimate (``tokens = "openai"``)."""

    def __init__(
        self, tokenizer: Tokenizer, output_tokens: int, stream_usage: bool, learnt: Learnt
    ) -> None:
        self.count = tokenizer
        self.output_tokens = output_tokens
        self.stream_usage = stream_usage
        self.learnt = learnt

    def estimate(self, path: str, body: bytes, tenant: str | None) -> Estimate | None:
        """The estimate of a request to upstream ``path`` with ``body``, None when it is not an
        OpenAI-compatible body (no tokens asked)."""
        kind = next((k for k in KINDS if path == k or path == k + "/"), None)
        if kind is None or not body:
            return None
        try:
            parsed = msgspec.json.decode(body, type=_Body)
            return self._estimate(kind, body, parsed, tenant)
        except (msgspec.DecodeError, ValueError, TypeError, RecursionError):
            return None
        except Exception:  # a tokenizer hook that failed: no tokens, never an error
            log.warning("proxy: the tokenizer failed; the request asks no tokens", exc_info=True)
            return None

    def _estimate(
        self, kind: str, body: bytes, parsed: _Body, tenant: str | None
    ) -> Estimate | None:
        count = self.count
        if kind == EMBEDDINGS:
            if parsed.input is None:
                return None
            return Estimate(_text_tokens(parsed.input, count), 0, "none")
        if kind == CHAT:
            if parsed.messages is None:
                return None
            prompt = REPLY_PRIMING
            for m in parsed.messages:
                prompt += MESSAGE_OVERHEAD + _content_tokens(m.content, count)
                if m.name:
                    prompt += count(m.name)
                if m.tool_calls is not None:
                    prompt += count(bytes(m.tool_calls).decode("utf-8", "replace"))
            for extra in (parsed.tools, parsed.response_format):
                if extra is not None:
                    prompt += count(bytes(extra).decode("utf-8", "replace"))
        else:
            if parsed.prompt is None:
                return None
            prompt = _text_tokens(parsed.prompt, count)
        bound = parsed.max_completion_tokens if kind == CHAT else None
        if bound is None:
            bound = parsed.max_tokens
        sequences = max(parsed.n or 1, parsed.best_of or 1, 1)
        if bound is not None and bound >= 0:
            output, source = bound, "max_tokens"
        else:
            output, source = self._learnt(prompt, tenant)
        body_out, added = None, False
        options = parsed.stream_options
        asked_usage = (
            not isinstance(options, UnsetType) and options is not None and options.include_usage
        )
        if parsed.stream and self.stream_usage and not asked_usage:
            body_out = _with_usage(body, parsed)
            added = body_out is not None
        return Estimate(prompt, output * sequences, source, body_out, added)

    def _learnt(self, prompt: int, tenant: str | None) -> tuple[int, str]:
        """The output of a call with no bound: what the tenant's calls used beyond this prompt
        (fleet-wide, :meth:`TokenUsage.use_per_call`, once its reports are in), else the
        route's ``output_tokens``. (The mean used per call does not depend on what was asked:
        a ratio used / asked applied to asks already scaled by it would feed back.)"""
        usage = self.learnt.usage.get(tenant or "")
        mean = usage.use_per_call() if usage is not None else None
        if mean is None:
            return self.output_tokens, "default"
        return max(1, math.ceil(mean) - prompt), "learnt"

    def clamp(self, tokens: int) -> int:
        """``tokens`` within the gate's token ceiling (as last read; an estimate above it would
        be refused, and a caller's habit of a huge ``max_tokens`` must not be an outage)."""
        ceiling = self.learnt.ceiling
        return min(tokens, MAX_TOKENS if ceiling is None else ceiling)


# -- the answer ---------------------------------------------------------------------------------


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    total_tokens: int | None = None

    def used(self) -> int | None:
        if self.total_tokens is not None and self.total_tokens >= 0:
            return self.total_tokens
        if self.prompt_tokens is None:
            return None
        return max(0, self.prompt_tokens) + max(0, self.completion_tokens or 0)


class _Answer(msgspec.Struct):
    usage: _Usage | None = None


class _Chunk(msgspec.Struct):
    choices: list[msgspec.Raw] | None = None
    usage: _Usage | UnsetType | None = UNSET


def used_of_json(body: bytes) -> int | None:
    """The tokens a JSON answer says it used (``usage.total_tokens``, else prompt +
    completion); None when it says nothing."""
    try:
        usage = msgspec.json.decode(body, type=_Answer).usage
    except (msgspec.DecodeError, ValueError):
        return None
    return None if usage is None else usage.used()


_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_USAGE_NULL = re.compile(rb'\s*"usage"\s*:\s*null\s*,|,\s*"usage"\s*:\s*null(?=\s*})')


def _last_end(data: bytes) -> int:
    """The index just past the last event's end in ``data`` (0: none ends there)."""
    end = 0
    for mark in (b"\n\n", b"\r\n\r\n", b"\r\r"):
        at = data.rfind(mark)
        if at >= 0:
            end = max(end, at + len(mark))
    return end


class SseTap:
    """Reads a server-sent-events answer for its usage chunk as it passes (:meth:`feed` each
    chunk, :meth:`end` at its end). With ``strip`` (the proxy added ``include_usage``), what it
    returns is what the caller gets: the usage-only event removed, a ``"usage":null`` member
    removed from the others, everything else byte for byte; an event is held until its end has
    arrived. Without, the chunks pass as they came."""

    def __init__(self, strip: bool) -> None:
        self.strip = strip
        self.used: int | None = None
        self.tail = b""
        self.off = False  # an event too large to follow: the rest passes untouched

    def feed(self, chunk: bytes) -> bytes:
        if self.off:
            return chunk
        data = self.tail + chunk if self.tail else chunk
        end = _last_end(data)
        done, self.tail = data[:end], data[end:]
        if len(self.tail) > MAX_EVENT:
            self.off = True  # no usage event is this large: give up on it, lose nothing
            out = data if self.strip else chunk
            self.tail = b""
            return out
        if b'"usage"' in done:
            done = self._events(done)
        return done if self.strip else chunk

    def end(self) -> bytes:
        """What is left at the stream's end (an event the upstream did not close)."""
        rest, self.tail = self.tail, b""
        if self.off or not rest:
            return rest if self.strip else b""
        if b'"usage"' in rest:
            rest = self._events(rest)
        return rest if self.strip else b""

    def _events(self, data: bytes) -> bytes:
        """The complete events in ``data``, the usage read off the ones that say it (and, with
        ``strip``, taken out)."""
        out: list[bytes] = []
        start = 0
        for m in _EVENT_END.finditer(data):
            out.append(self._event(data[start : m.end()], m.end() - m.start()))
            start = m.end()
        if start < len(data):
            out.append(self._event(data[start:], 0))
        return b"".join(out)

    def _event(self, event: bytes, ending: int) -> bytes:
        if b'"usage"' not in event:
            return event
        text = event[: len(event) - ending] if ending else event
        lines = [line for line in re.split(rb"\r\n|\n|\r", text) if line.startswith(b"data:")]
        payload = b"\n".join(line[6:] if line.startswith(b"data: ") else line[5:] for line in lines)
        try:
            chunk = msgspec.json.decode(payload, type=_Chunk)
        except (msgspec.DecodeError, ValueError):
            return event
        usage = chunk.usage
        if isinstance(usage, _Usage):
            used = usage.used()
            if used is not None:
                self.used = used
            if self.strip and not chunk.choices:
                return b""  # the usage-only chunk include_usage added
        elif usage is None and self.strip:
            return _USAGE_NULL.sub(b"", event, count=1)
        return event


class Settle:
    """What the answer of an estimated call used, read as it passes: a JSON answer's
    ``usage`` (its body kept up to :data:`MAX_ANSWER_PARSE`), a stream's usage chunk
    (:class:`SseTap`)."""

    def __init__(self, content_type: str, strip: bool) -> None:
        self.sse = SseTap(strip) if content_type.startswith("text/event-stream") else None
        self.parts: list[bytes] | None = None if self.sse is not None else []
        self.size = 0

    def feed(self, chunk: bytes) -> bytes:
        if self.sse is not None:
            return self.sse.feed(chunk)
        if self.parts is not None:
            self.size += len(chunk)
            if self.size > MAX_ANSWER_PARSE:
                self.parts = None
            else:
                self.parts.append(chunk)
        return chunk

    def end(self) -> bytes:
        return b"" if self.sse is None else self.sse.end()

    @property
    def used(self) -> int | None:
        if self.sse is not None:
            return self.sse.used
        return None if not self.parts else used_of_json(b"".join(self.parts))
