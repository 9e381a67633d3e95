"""Streamed replies of the vLLM simulator: OpenAI's server-sent events for chat and completions.

A streamed reply is ``data: {chunk}\\n\\n`` events: for chat, a first chunk with the assistant's
role, then one chunk per piece of text in ``choices[0].delta.content``, a last chunk with the
``finish_reason``, a chunk of ``usage`` with no choices when ``stream_options.include_usage``
asks (every other chunk then has ``"usage": null``), and ``data: [DONE]\\n\\n``. Completions are
the same with ``choices[i].text`` (one chunk per prompt and piece) and no role chunk.
:class:`StreamReply` makes the events, :class:`EventStream` sends them.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from fleetgate.tools.sim._openai import prompts_of, reply_seed, usage, words
from fleetgate.tools.sim._server import run_unless_disconnected
from fleetgate.tools.sim._vllm_config import VllmSimConfig

__all__ = ["DONE", "EventStream", "StreamReply"]

#: the event that ends every stream
DONE = b"data: [DONE]\n\n"
_ENCODER = msgspec.json.Encoder()


class StreamReply:
    """The events of one streamed chat or completion reply (``kind``: ``chat``, ``completion``)."""

    def __init__(
        self,
        kind: str,
        cfg: VllmSimConfig,
        body: dict[str, Any],
        tokens: tuple[int, int, str],
        include_usage: bool,
    ) -> None:
        """Plan the reply to ``body``; ``tokens`` is (prompt tokens, generated tokens, reason)."""
        self.kind = kind
        self.prompt, self.gen, self.reason = tokens
        self.include_usage = include_usage
        seed = reply_seed(body)
        if kind == "chat":
            self.texts = [words(seed, self.gen)]
        else:
            count = len(prompts_of(body["prompt"]))
            self.texts = [words(f"{seed}:{i}", self.gen) for i in range(count)]
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        self._head = {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
            "created": int(time.time()),
            "model": cfg.model,
        }

    @property
    def pieces(self) -> int:
        """How many pieces of text each choice is sent in."""
        return len(self.texts[0])

    def opening(self) -> bytes:
        """The events before the first piece: chat's chunk with the assistant's role."""
        if self.kind != "chat":
            return b""
        return self._event([self._choice(0, "", role=True)])

    def piece(self, i: int) -> bytes:
        """The events of piece ``i``: one chunk per choice."""
        text = self.texts
        return b"".join(
            self._event([self._choice(c, (" " if i else "") + text[c][i])])
            for c in range(len(text))
        )

    def closing(self) -> bytes:
        """The last events: each choice's ``finish_reason``, the usage if asked, ``[DONE]``."""
        events = [
            self._event([self._choice(c, "", reason=self.reason)]) for c in range(len(self.texts))
        ]
        if self.include_usage:
            total = usage(self.prompt, self.gen * len(self.texts))
            events.append(self._event([], total))
        return b"".join(events) + DONE

    def _choice(
        self, index: int, text: str, *, role: bool = False, reason: str | None = None
    ) -> dict[str, Any]:
        """One choice of a chunk: chat's ``delta`` or a completion's ``text``."""
        choice: dict[str, Any] = {"index": index}
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text or reason is None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text
        choice["logprobs"] = None
        choice["finish_reason"] = reason
        return choice

    def _event(self, choices: list[dict[str, Any]], total: dict[str, int] | None = None) -> bytes:
        """One ``data:`` event of a chunk with ``choices`` (and ``usage`` when asked for)."""
        chunk: dict[str, Any] = {**self._head, "choices": choices}
        if self.include_usage:
            chunk["usage"] = total
        return b"data: " + _ENCODER.encode(chunk) + b"\n\n"


class EventStream(Response):
    """A ``text/event-stream`` answer of ``events``, sent as they come.

    The caller going away (a disconnect, or a write that fails) stops it at once; ``close`` is
    awaited at the end in every case, so the work behind the events (a slot) is given back.
    """

    def __init__(self, events: AsyncIterator[bytes], close: Callable[[], Awaitable[None]]) -> None:
        """Stream ``events``; ``close()`` ends the work that makes them."""
        self.events = events
        self.close = close
        self.status_code = 200
        self.media_type = "text/event-stream"
        self.background = None
        self.init_headers({"cache-control": "no-cache"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Send the head and every event, unless the caller goes away first."""
        try:
            await run_unless_disconnected(Request(scope, receive), self._send_all(send))
        except OSError:  # the connection broke under a write: nobody to answer
            pass
        finally:
            await self.close()

    async def _send_all(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        async for event in self.events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
