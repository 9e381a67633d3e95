"""The ``proxy_hop`` benchmark's anchors: nginx (``limit_conn``) and LiteLLM's proxy
(``max_parallel_requests``) in front of the same upstream, each as a private process.

nginx runs with a config and prefix directory of its own (no root, no system config: a master
and one worker, ``daemon off``, on a free port, its access log to a file as fleetgate's is);
absent (``nginx`` not on PATH, Debian's ``nginx-light`` or ``nginx``), :func:`nginx_process`
yields ``None`` and the benchmark says so. LiteLLM runs offline (``LITELLM_MASTER_KEY``,
``LITELLM_LOCAL_MODEL_COST_MAP=True``, ``HF_HUB_OFFLINE=1``) when its ``litellm`` command is
installed, likewise ``None`` otherwise.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx

from ._common import log
from .burst import free_port

__all__ = ["Anchor", "litellm_process", "nginx_process"]

_NGINX_CONF = """\
worker_processes 1;
daemon off;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log {prefix}/access.log;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    limit_conn_zone $server_name zone=gate:1m;
    upstream sim {{ server {upstream}; keepalive 64; }}
    server {{
        listen 127.0.0.1:{port};
        server_name gate;
        location / {{
            limit_conn gate {limit};
            proxy_pass http://sim;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""


@dataclass
class Anchor:
    """A proxy process under test: its URL and its process (children summed for CPU)."""

    proc: subprocess.Popen[bytes]
    url: str


def _wait_ready(proc: subprocess.Popen[bytes], url: str, what: str, timeout: float) -> None:
    end = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            httpx.get(url + "/health", timeout=1)
            return
        except httpx.HTTPError:
            pass
        if time.monotonic() > end:
            raise RuntimeError(f"{what} did not answer at {url} in {timeout:g} s")
        time.sleep(0.1)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@contextlib.contextmanager
def nginx_process(upstream: str, limit: int) -> Iterator[Anchor | None]:
    """nginx proxying to ``upstream`` (``host:port``) with ``limit_conn`` at ``limit``; None
    when nginx is not installed."""
    binary = shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.path.exists(p)), None
    )
    if binary is None:
        yield None
        return
    prefix = tempfile.mkdtemp(prefix="fleetgate-bench-nginx-")
    port = free_port()
    conf = os.path.join(prefix, "nginx.conf")
    with open(conf, "w") as f:
        f.write(_NGINX_CONF.format(prefix=prefix, upstream=upstream, port=port, limit=limit))
    proc = subprocess.Popen(
        [binary, "-p", prefix, "-c", conf, "-e", os.path.join(prefix, "error.log")],
        stdin=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(proc, url, "nginx", 20)
        log(f"nginx pid {proc.pid} on {url} -> {upstream}, limit_conn {limit}")
        yield Anchor(proc, url)
    finally:
        _stop(proc)
        shutil.rmtree(prefix, ignore_errors=True)


_LITELLM_CONF = """\
model_list:
  - model_name: sim-model
    litellm_params:
      model: openai/sim-model
      api_base: {upstream}/v1
      api_key: none
litellm_settings:
  max_parallel_requests: {limit}
"""


@contextlib.contextmanager
def litellm_process(upstream: str, limit: int) -> Iterator[Anchor | None]:
    """LiteLLM's proxy in front of ``upstream`` (a URL), offline; None when not installed."""
    here = os.path.dirname(sys.executable)
    binary = shutil.which("litellm") or shutil.which("litellm", path=here)
    if binary is None:
        yield None
        return
    workdir = tempfile.mkdtemp(prefix="fleetgate-bench-litellm-")
    conf = os.path.join(workdir, "config.yaml")
    with open(conf, "w") as f:
        f.write(_LITELLM_CONF.format(upstream=upstream, limit=limit))
    port = free_port()
    env = {
        **os.environ,
        "LITELLM_MASTER_KEY": "sk-bench",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "HF_HUB_OFFLINE": "1",
    }
    with open(os.path.join(workdir, "litellm.log"), "wb") as out:
        proc = subprocess.Popen(
            [binary, "--config", conf, "--host", "127.0.0.1", "--port", str(port)],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(proc, url, "litellm", 90)
        log(f"litellm pid {proc.pid} on {url} -> {upstream}, max_parallel_requests {limit}")
        yield Anchor(proc, url)
    finally:
        _stop(proc)
        shutil.rmtree(workdir, ignore_errors=True)
