"""``fleetgate proxy``: an HTTP reverse proxy that takes a fleet-wide permit per forwarded
request, so services in any language get the gate by changing one base URL.

::

    fleetgate proxy --upstream http://reranker:8000 --gate rerank --listen 0.0.0.0:8080
    fleetgate proxy --config proxy.toml        # [[routes]]: path / model -> upstream, gate
    fleetgate proxy --config proxy.toml --workers 4   # 4 processes, one port

Modules: :mod:`.config` (the TOML and the one-route flags), :mod:`.policy` (pure decisions:
the ``X-Fleetgate-*`` headers, hop-by-hop headers, outcomes, ``Retry-After``), :mod:`.app` (the
ASGI app: routing, the gate; one request's state in :mod:`._exchange`, the upstream through
httpx's transport in :mod:`._upstream`, the proxy's own errors in :mod:`._answers`),
:mod:`.server` (uvicorn, the drain), :mod:`.metrics`; ``--workers N``: :mod:`.workers` (the parent
supervising N worker processes on one port), :mod:`._worker` (one of them), :mod:`._shared` (their
shared metrics and health). Built on the client
(:class:`fleetgate.client.Fleet`), which never imports this package. Needs the ``proxy`` extra
(``pip install 'fleetgate[proxy]'``: uvicorn; httpx is a core dependency); with the ``fast``
extra it runs on httptools and uvloop.
"""

from .app import ProxyApp
from .config import ProxyConfig, RouteConfig, load_config, one_route
from .policy import Ask, BadHeader, classify, parse_ask
from .server import serve, serve_in_thread

__all__ = [
    "Ask",
    "BadHeader",
    "ProxyApp",
    "ProxyConfig",
    "RouteConfig",
    "classify",
    "load_config",
    "one_route",
    "parse_ask",
    "serve",
    "serve_in_thread",
]
