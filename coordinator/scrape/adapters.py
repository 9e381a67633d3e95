"""One adapter per model-server kind: which gauges mean "in flight" and "waiting", where they live.

An adapter is data (:class:`GaugeAdapter`) plus one pure reading rule, :meth:`GaugeAdapter.read`:

* samples are matched by exact **sample** name (``vllm:num_requests_waiting`` is a prefix of
  ``..._by_reason``; prometheus_client strips ``_total`` from counter *families*);
* the model filter uses the kind's model label (``model_name``); kinds without one (TGI, TEI,
  llama.cpp serve one model per process) count every sample;
* series are **summed** over engines, data-parallel ranks and replicas, but series that differ
  only in a *shard* label (SGLang's ``tp_rank``/``pp_rank``/``moe_ep_rank``: every rank of one
  replica may report
  the same batch; a ``pid`` of prometheus_client's multiprocess mode) are the same requests, so
  the **maximum** of those is taken first;
* a metric that is absent, or a model that is not in the text, is **unknown** (None), never 0;
  NaN, infinite or negative values are refused and named in ``error``;
* an answer without a single sample of the kind's in-flight or waiting gauge that is no
  Prometheus text (an HTML page, JSON, plain text) or another kind's metrics is a failed scrape
  saying what it got (:func:`foreign_answer`), never a good one with every value unknown; a
  Prometheus text of no other kind is unknown, as ever (TGI and TEI export a gauge only once
  they have set it).

Names and paths are each server's own; ``docs/servers.md`` cites the source file of every one.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from fleetgate.errors import ConfigError

from .promtext import Sample, first_foreign_line, sample_names_present, select_samples
from .signal_struct import Signals

__all__ = [
    "ADAPTERS",
    "AUTO",
    "DETECTION_ORDER",
    "GaugeAdapter",
    "detect_kind",
    "foreign_answer",
    "get_adapter",
    "validate_server",
]

AUTO = "auto"


@dataclass
class _Acc:
    """Sum (or max) of the finite, non-negative values of one metric; ``bad`` if any was not."""

    use_max: bool = False
    total: float = 0.0
    seen: bool = False
    bad: str | None = None

    def refuse(self, what: str, value: float) -> None:
        self.bad = self.bad or f"{what} has invalid value {value!r}"

    def add(self, what: str, value: float) -> None:
        self.total = max(self.total, value) if self.use_max else self.total + value
        self.seen = True
        if not math.isfinite(self.total):
            self.bad = self.bad or f"{what} sums to {self.total!r}"

    def value(self) -> float | None:
        return self.total if self.seen and self.bad is None else None


def _valid(value: float) -> bool:
    return math.isfinite(value) and value >= 0


@dataclass(frozen=True)
class GaugeAdapter:
    """The gauges of one server kind.

    ``running`` is the in-flight gauge (None: the server exports none, e.g. TEI). ``waiting``
    counts every queued request; ``capacity`` is ``(metric, label, value)`` of a gauge that counts
    only requests waiting for lack of capacity -- when the text has no such sample for the model,
    ``waiting`` stands in for it (errs towards "saturated"). ``kv_usage`` lists fraction gauges
    (1 = full) in order of preference. ``metrics_path`` is where the server serves the text.
    ``preemptions`` / ``rejections`` name the preemption (retraction, pause) and admission
    rejection metric (None: the kind exports none); ``preemptions_counter`` says the first is a
    counter (its increase between polls is the signal, see :mod:`.sources`), else a gauge whose
    value is. ``max_requests`` is the gauge of the requests the server admits at once, as it
    states it; ``kv_tokens`` a gauge of its KV cache in tokens, or ``kv_info`` an info gauge
    ``(metric, blocks label, block size label)`` whose labels give it (vLLM). ``props_path``:
    the server states its slots at that path instead (llama.cpp's ``/props``). ``hidden_queue``:
    the kind does not count requests it has not dispatched yet. ``total_label``: series with
    this label carry the total under the value ``""`` and a breakdown under the others (SGLang's
    ``priority``); only the total is read.
    """

    server: str
    running: str | None
    waiting: str
    capacity: tuple[str, str, str] | None = None
    kv_usage: tuple[str, ...] = ()
    model_label: str | None = "model_name"
    shard_labels: frozenset[str] = frozenset()
    metrics_path: str = "/metrics"
    preemptions: str | None = None
    rejections: str | None = None
    preemptions_counter: bool = False
    max_requests: str | None = None
    kv_tokens: str | None = None
    kv_info: tuple[str, str, str] | None = None
    kv_blocks: tuple[str, str] | None = None
    props_path: str | None = None
    hidden_queue: bool = False
    total_label: str | None = None
    _wanted: frozenset[str] = field(init=False, repr=False, compare=False)
    _markers: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        names = {self.waiting, *self.kv_usage}
        optional = (self.running, self.preemptions, self.rejections, self.max_requests)
        names.update(n for n in (*optional, self.kv_tokens) if n)
        if self.capacity is not None:
            names.add(self.capacity[0])
        if self.kv_info is not None:
            names.add(self.kv_info[0])
        if self.kv_blocks is not None:
            names.update(self.kv_blocks)
        object.__setattr__(self, "_wanted", frozenset(names))
        markers = frozenset(n for n in (self.running, self.waiting) if n)
        object.__setattr__(self, "_markers", markers)

    @property
    def wanted(self) -> frozenset[str]:
        """Every sample name this adapter reads."""
        return self._wanted

    def parse(self, text: str, model_name: str | None) -> Signals:
        """Signals for ``model_name`` (None = every model in the text)."""
        return self.read(text, model_name)[0]

    def read(
        self, text: str, model_name: str | None, prefer: str | None = None
    ) -> tuple[Signals, str | None]:
        """Signals and the model label value they were filtered by (None = all models).

        With no ``model_name``, ``prefer`` (the gate's name) is used as the filter when some
        wanted sample carries that model label value; otherwise every model is summed.
        """
        try:
            samples = select_samples(text, self._wanted)
        # The parser is third-party code fed untrusted text; whatever it raises, the answer is
        # "unknown" with the reason kept, never a crashed poll loop.
        except Exception as exc:
            return Signals.failure(f"unparseable metrics: {type(exc).__name__}: {exc}"), None
        if not any(s.name in self._markers for s in samples):
            foreign = foreign_answer(text, self.server)
            if foreign is not None:
                gauges = " and ".join(sorted(self._markers))
                return Signals.failure(
                    f"no {self.server} metrics ({gauges} absent): {foreign}"
                ), None
        label = self.model_label
        model = model_name if label is not None else None
        if model is None and prefer is not None and label is not None:
            if any(s.labels.get(label) == prefer for s in samples):
                model = prefer
        info = self.kv_info[0] if self.kv_info is not None else None
        if model is not None and label is not None:
            # An info gauge describes the engine, not a model: it carries no model label.
            samples = [s for s in samples if s.labels.get(label) == model or s.name == info]
        return self._signals(samples), model

    def _key(self, s: Sample) -> str | None:
        """Which accumulator a sample feeds (None: not ours, e.g. ``reason="deferred"``)."""
        if self.capacity is not None and s.name == self.capacity[0]:
            metric, label, value = self.capacity
            return f"{metric}{{{label}={value!r}}}" if s.labels.get(label) == value else None
        return s.name

    def _signals(self, samples: list[Sample]) -> Signals:
        accs: dict[str, _Acc] = {}
        # Cells: one value per (metric, series without its shard labels). Shards of one series
        # count once (their maximum); different series are summed.
        cells: dict[tuple[str, tuple[tuple[str, str], ...] | int], float] = {}
        shard = self.shard_labels
        total = self.total_label
        for i, s in enumerate(samples):
            key = self._key(s)
            if key is None or (self.kv_info is not None and key == self.kv_info[0]):
                continue
            if total is not None and s.labels.get(total, "") != "":
                continue  # a breakdown of the total beside it
            acc = accs.get(key)
            if acc is None:
                # fractions and a block's size are the engines' maximum, not their sum
                per_block = self.kv_blocks is not None and key == self.kv_blocks[1]
                acc = accs[key] = _Acc(use_max=key in self.kv_usage or per_block)
            if not _valid(s.value):
                acc.refuse(key, s.value)
                continue
            series: tuple[tuple[str, str], ...] | int = (
                tuple(sorted((k, v) for k, v in s.labels.items() if k not in shard)) if shard else i
            )
            cell = (key, series)
            previous = cells.get(cell)
            cells[cell] = s.value if previous is None else max(previous, s.value)
        for (key, _), value in cells.items():
            accs[key].add(key, value)

        def get(name: str | None) -> _Acc:
            return accs.get(name, _Acc()) if name is not None else _Acc()

        waiting = get(self.waiting)
        cap = waiting
        if self.capacity is not None:
            metric, label, reason = self.capacity
            by_reason = accs.get(f"{metric}{{{label}={reason!r}}}")
            if by_reason is not None and (by_reason.seen or by_reason.bad):
                cap = by_reason
        kv = next((accs[n] for n in self.kv_usage if n in accs), _Acc())
        running = get(self.running)
        preemptions, rejections = get(self.preemptions), get(self.rejections)
        stated, tokens = get(self.max_requests), get(self.kv_tokens)
        if self.kv_info is not None:
            tokens = _info_tokens(samples, *self.kv_info)
        elif self.kv_blocks is not None:
            tokens = _block_tokens(get(self.kv_blocks[0]), get(self.kv_blocks[1]))
        reported = (kv, preemptions, rejections, stated, tokens)
        errors = [a.bad for a in (running, cap, waiting, *reported) if a.bad]
        return Signals(
            running=running.value(),
            waiting=waiting.value(),
            waiting_capacity=cap.value(),
            kv_cache_usage=kv.value(),
            # Only the signals the controller acts on decide ``ok``; a broken KV gauge must not
            # stall adaptation. Every invalid value is still named in ``error``.
            ok=running.bad is None and cap.bad is None,
            error="; ".join(dict.fromkeys(errors)) or None,
            preemptions=preemptions.value(),
            admission_rejections=rejections.value(),
            max_requests=stated.value(),
            kv_tokens=tokens.value(),
            # A gauge's value is this poll's signal; a counter's needs the last poll (sources).
            preempted=None if self.preemptions_counter else preemptions.value(),
            hidden_queue=self.hidden_queue,
        )


def _info_tokens(samples: list[Sample], metric: str, blocks: str, size: str) -> _Acc:
    """KV tokens from an info gauge's labels (``num_gpu_blocks`` x ``block_size``), summed over
    its series (engines); unknown while any series lacks them (vLLM writes ``"None"`` until it
    has profiled its memory)."""
    acc = _Acc()
    for s in samples:
        if s.name != metric:
            continue
        try:
            value = float(s.labels.get(blocks, "")) * float(s.labels.get(size, ""))
        except ValueError:
            return _Acc()
        if not _valid(value):
            acc.refuse(f"{metric} {blocks} x {size}", value)
            continue
        acc.add(metric, value)
    return acc


def _block_tokens(blocks: _Acc, per_block: _Acc) -> _Acc:
    """KV tokens as blocks (summed over engines) x tokens per block; unknown without both."""
    acc = _Acc(bad=blocks.bad or per_block.bad)
    b, t = blocks.value(), per_block.value()
    if b is not None and t is not None:
        acc.add("kv blocks x tokens per block", b * t)
    return acc


VLLM = GaugeAdapter(
    server="vllm",
    running="vllm:num_requests_running",
    waiting="vllm:num_requests_waiting",
    capacity=("vllm:num_requests_waiting_by_reason", "reason", "capacity"),
    # gpu_cache_usage_perc: the name before vLLM renamed it; read only when the current is absent
    kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    preemptions="vllm:num_preemptions_total",
    preemptions_counter=True,
    rejections="vllm:admission_rejections_total",
    kv_info=("vllm:cache_config_info", "num_gpu_blocks", "block_size"),
)
SGLANG = GaugeAdapter(
    server="sglang",
    running="sglang:num_running_reqs",
    waiting="sglang:num_queue_reqs",
    kv_usage=("sglang:token_usage",),
    shard_labels=frozenset({"tp_rank", "pp_rank", "moe_ep_rank", "pid"}),
    preemptions="sglang:num_retracted_reqs",
    kv_tokens="sglang:max_total_num_tokens",
    total_label="priority",
)
TGI = GaugeAdapter(
    server="tgi",
    running="tgi_batch_current_size",
    waiting="tgi_queue_size",
    model_label=None,
    # set once at warm-up: the tokens a batch may hold (the KV cache TGI sized for itself)
    kv_tokens="tgi_batch_max_total_tokens",
)
TEI = GaugeAdapter(server="tei", running=None, waiting="te_queue_size", model_label=None)
LLAMACPP = GaugeAdapter(
    server="llamacpp",
    running="llamacpp:requests_processing",
    waiting="llamacpp:requests_deferred",
    model_label=None,
    props_path="/props",
    hidden_queue=True,
)
TRTLLM = GaugeAdapter(
    server="trtllm",
    running="trtllm_num_requests_running",
    waiting="trtllm_num_requests_waiting",
    kv_usage=("trtllm_kv_cache_utilization",),
    shard_labels=frozenset({"pid"}),
    preemptions="trtllm_num_paused_requests",
    max_requests="trtllm_max_num_active_requests",
    kv_blocks=("trtllm_kv_cache_max_blocks", "trtllm_kv_cache_tokens_per_block"),
    metrics_path="/prometheus/metrics",
)
NIM = GaugeAdapter(
    server="nim",
    running="num_requests_running",
    waiting="num_requests_waiting",
    kv_usage=("gpu_cache_usage_perc",),
    max_requests="num_request_max",
    metrics_path="/v1/metrics",
)

#: Adapters by ``server`` kind (the gate config's ``server`` key).
ADAPTERS: Mapping[str, GaugeAdapter] = MappingProxyType(
    {a.server: a for a in (VLLM, SGLANG, TGI, TEI, LLAMACPP, TRTLLM, NIM)}
)
#: Detection tries the kinds in this order; NIM's unprefixed names come last.
DETECTION_ORDER: tuple[str, ...] = ("vllm", "sglang", "trtllm", "tgi", "tei", "llamacpp", "nim")
_MARKERS = frozenset(n for a in ADAPTERS.values() for n in (a.running, a.waiting) if n)


def validate_server(server: str) -> str:
    """``server`` if it is ``"auto"`` or a known kind, else ConfigError listing them."""
    if server == AUTO or server in ADAPTERS:
        return server
    known = ", ".join([AUTO, *sorted(ADAPTERS)])
    raise ConfigError(f"unknown server kind {server!r} (known: {known})")


def get_adapter(server: str) -> GaugeAdapter:
    """The adapter for ``server``, or ConfigError listing the known kinds."""
    try:
        return ADAPTERS[server]
    except KeyError:
        known = ", ".join(sorted(ADAPTERS))
        raise ConfigError(f"unknown server kind {server!r} (known: {known})") from None


def foreign_answer(text: str, server: str) -> str | None:
    """Why ``text``, an answer without the gauges of ``server`` (a kind, or ``auto``), is no
    metrics of that kind: an HTML page (with its title), JSON, not the Prometheus text format,
    or another kind's metrics. None for a Prometheus text of no other kind (the gauges may not
    be set yet: unknown, not a failure)."""
    head = text.lstrip()[:4096]
    lowered = head.lower()
    if lowered.startswith(("<!doctype html", "<html")) or "<html" in lowered[:512]:
        title = re.search(r"<title[^>]*>([^<]*)</title>", head, re.IGNORECASE)
        named = f" ({title.group(1).strip()[:80]!r})" if title and title.group(1).strip() else ""
        return f"the body is an HTML page{named}, not Prometheus text"
    if head[:1] in ("{", "["):
        return "the body is JSON, not Prometheus text"
    line = first_foreign_line(text)
    if line is not None:
        return f"the body is not Prometheus text (a line reads {line[:80]!r})"
    kind = detect_kind(text)
    if kind is not None and kind != server:
        return f'the metrics are of a {kind} server (set server = "{kind}" or "auto")'
    return None


def detect_kind(text: str) -> str | None:
    """The server kind whose in-flight or waiting gauge has a sample in ``text``, or None."""
    present = sample_names_present(text, _MARKERS)
    for kind in DETECTION_ORDER:
        adapter = ADAPTERS[kind]
        if adapter.waiting in present or (adapter.running in present):
            return kind
    return None
