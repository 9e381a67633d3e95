"""The OpenAI shapes the vLLM simulator speaks: request bodies checked and sized in tokens, and
the chat, completion and embedding replies (deterministic text and vectors per request)."""

from __future__ import annotations

import math
import random
import time
import uuid
from typing import Any

import msgspec

from fleetgate.tools.sim._vllm_config import VllmSimConfig

__all__ = [
    "BadRequest",
    "openai_body",
    "parse_request",
    "prompts_of",
    "reply_seed",
    "stream_mode",
    "usage",
    "words",
]

_DEFAULT_GEN_TOKENS = 16
_VOCAB = (
    "the",
    "model",
    "server",
    "token",
    "batch",
    "queue",
    "fleet",
    "gate",
    "simulated",
    "reply",
    "of",
    "and",
    "a",
    "to",
    "in",
    "is",
)
_FIELDS = {"chat": "messages", "completion": "prompt", "embedding": "input"}


class BadRequest(Exception):
    """A request body the server refuses with 400; the message says why."""


def _count_tokens(value: Any) -> int:
    """A rough token count: 4 characters a token for text, one per id for token-id lists."""
    if isinstance(value, str):
        return max(1, (len(value) + 3) // 4)
    if isinstance(value, list):
        if value and all(isinstance(v, int) for v in value):
            return len(value)
        return sum(_count_tokens(v) for v in value)
    if isinstance(value, dict):
        return _count_tokens(value.get("text") or value.get("content") or "")
    return 0


def words(seed: str, n: int) -> list[str]:
    """The words of a reply of ``n`` tokens, deterministic per ``seed`` (capped at 256)."""
    return random.Random(seed).choices(_VOCAB, k=min(n, 256))


def reply_seed(body: dict[str, Any]) -> str:
    """The seed of a request's reply text: the request body itself."""
    return msgspec.json.encode(body).decode()


def prompts_of(value: Any) -> list[Any]:
    """The prompts of a completion's ``prompt`` or an embedding's ``input``, one choice each: a
    list of them, or one (a string, or a list of token ids)."""
    many = isinstance(value, list) and not all(isinstance(p, int) for p in value)
    return list(value) if many else [value]


def _embedding(seed: str, dim: int) -> list[float]:
    rng = random.Random(seed)
    vec = [rng.gauss(0.0, 1.0) for _ in range(dim)]
    norm = math.sqrt(sum(v * v for v in vec)) or 1.0
    return [v / norm for v in vec]


def parse_request(kind: str, body: dict[str, Any], cfg: VllmSimConfig) -> tuple[int, int, str]:
    """Validate a request body; return (prompt tokens, generation tokens, finish reason).

    Raises :class:`BadRequest` (400) or ``LookupError`` for a model not served here (404).
    """
    if body.get("model") not in (None, cfg.model):
        raise LookupError(f"The model `{body['model']}` does not exist.")
    if kind == "embedding" and body.get("stream"):
        raise BadRequest("stream=true is not supported for embeddings")
    field = _FIELDS[kind]
    value = body.get(field)
    if not isinstance(value, list if kind == "chat" else (str, list)) or not value:
        raise BadRequest(f"{field} must be a non-empty {'list' if kind == 'chat' else 'value'}")
    if kind == "embedding":
        return _count_tokens(value), 0, "stop"
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    if limit is None:
        return _count_tokens(value), _DEFAULT_GEN_TOKENS, "stop"
    if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= cfg.max_model_len:
        raise BadRequest(f"max_tokens must be an integer in [1, {cfg.max_model_len}]")
    return _count_tokens(value), limit, "length"


def stream_mode(body: dict[str, Any]) -> tuple[bool, bool]:
    """(streamed, usage chunk wanted) of a request: ``stream`` and
    ``stream_options.include_usage``. Raises :class:`BadRequest` for options of another type."""
    stream, options = body.get("stream", False), body.get("stream_options")
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest("stream must be a boolean")
    if options is None:
        return stream, False
    if not stream or not isinstance(options, dict):
        raise BadRequest("stream_options is an object, and only with stream=true")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise BadRequest("stream_options.include_usage must be a boolean")
    return stream, include


def usage(prompt: int, completion: int) -> dict[str, int]:
    """The ``usage`` object of a reply."""
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def openai_body(
    kind: str, cfg: VllmSimConfig, body: dict[str, Any], prompt: int, gen: int, reason: str
) -> dict[str, Any]:
    """The reply to a ``kind`` request (``chat``, ``completion``, ``embedding``) once served."""
    created, seed = int(time.time()), reply_seed(body)
    if kind == "chat":
        return _chat_body(cfg, created, seed, prompt, gen, reason)
    if kind == "completion":
        return _completion_body(cfg, created, seed, body["prompt"], prompt, gen, reason)
    return _embedding_body(cfg, created, body["input"], prompt)


def _chat_body(
    cfg: VllmSimConfig, created: int, seed: str, prompt: int, gen: int, reason: str
) -> dict[str, Any]:
    message = {"role": "assistant", "content": " ".join(words(seed, gen))}
    choices: list[dict[str, Any]] = [
        {"index": 0, "message": message, "logprobs": None, "finish_reason": reason}
    ]
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": created,
        "model": cfg.model,
        "choices": choices,
        "usage": usage(prompt, gen),
    }


def _completion_body(
    cfg: VllmSimConfig, created: int, seed: str, prompts: Any, prompt: int, gen: int, reason: str
) -> dict[str, Any]:
    n = len(prompts_of(prompts))
    choices = [
        {
            "index": i,
            "text": " ".join(words(f"{seed}:{i}", gen)),
            "logprobs": None,
            "finish_reason": reason,
        }
        for i in range(n)
    ]
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": created,
        "model": cfg.model,
        "choices": choices,
        "usage": usage(prompt, gen * n),
    }


def _embedding_body(cfg: VllmSimConfig, created: int, inputs: Any, prompt: int) -> dict[str, Any]:
    items = prompts_of(inputs)
    data = [
        {
            "index": i,
            "object": "embedding",
            "embedding": _embedding(f"{cfg.model}:{item}", cfg.embedding_dim),
        }
        for i, item in enumerate(items)
    ]
    return {
        "id": f"embd-{uuid.uuid4().hex}",
        "object": "list",
        "created": created,
        "model": cfg.model,
        "data": data,
        "usage": usage(prompt, 0),
    }
