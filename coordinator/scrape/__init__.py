"""The coordinator's scrape room: reading model servers' ``/metrics`` into :class:`Signals`.

One direction only: the rest of the coordinator imports this room, never the other way round.

* :mod:`.sources` -- a gate's :class:`MetricsSource`: its server kind (named or detected), its
  URL(s), its kept-alive connections (:class:`Fetcher`);
* :mod:`.httpget` -- the lean bounded HTTP GET the sources use by default (:class:`LeanHttp`);
  :mod:`.signals` has the httpx one (:func:`~.signals.scrape`), the metrics-URL rules and the
  combination of replicas;
* :mod:`.adapters` -- one :class:`~.adapters.GaugeAdapter` per server kind (which gauges mean
  "in flight" and "waiting");
* :mod:`.promtext` -- the Prometheus text parsing the adapters read samples with;
* :mod:`.signal_struct` -- :class:`Signals`, what one poll of a gate's servers reports.
"""

from .httpget import LeanHttp
from .signal_struct import Signals
from .signals import ScrapeResult
from .sources import Fetcher, HttpxFetcher, MetricsSource, ScrapedGate, new_client

__all__ = [
    "Fetcher",
    "HttpxFetcher",
    "LeanHttp",
    "MetricsSource",
    "ScrapeResult",
    "ScrapedGate",
    "Signals",
    "new_client",
]
