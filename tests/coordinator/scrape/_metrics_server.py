"""A metrics server for the scrape tests: vLLM expositions (current and older) and the answers
of a misbehaving server (404, a redirect, huge, endless and trickling bodies, Latin-1), each at
its own path (an HTML page among them), served by a thread of the test process."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# A vLLM (V1, 2026) exposition: process metrics first, two models, two engines each, the
# `_by_reason` gauge, counters with `_total`/`_created`, histograms with buckets.
VLLM_TEXT = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 18231.0
python_gc_objects_collected_total{generation="1"} 3561.0
# HELP process_resident_memory_bytes Resident memory size in bytes.
# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes 1.284521984e+09
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="bge-m3"} 7.0
vllm:num_requests_running{engine="1",model_name="bge-m3"} 5.0
vllm:num_requests_running{engine="0",model_name="llama"} 30.0
vllm:num_requests_running{engine="1",model_name="llama"} 34.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="bge-m3"} 0.0
vllm:num_requests_waiting{engine="1",model_name="bge-m3"} 1.0
vllm:num_requests_waiting{engine="0",model_name="llama"} 6.0
vllm:num_requests_waiting{engine="1",model_name="llama"} 3.0
# HELP vllm:num_requests_waiting_by_reason Number of requests waiting, by the reason they wait.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="bge-m3",reason="capacity"} 0.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="bge-m3",reason="deferred"} 0.0
vllm:num_requests_waiting_by_reason{engine="1",model_name="bge-m3",reason="capacity"} 0.0
vllm:num_requests_waiting_by_reason{engine="1",model_name="bge-m3",reason="deferred"} 1.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="llama",reason="capacity"} 4.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="llama",reason="deferred"} 2.0
vllm:num_requests_waiting_by_reason{engine="1",model_name="llama",reason="capacity"} 3.0
vllm:num_requests_waiting_by_reason{engine="1",model_name="llama",reason="deferred"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="bge-m3"} 0.05
vllm:kv_cache_usage_perc{engine="1",model_name="bge-m3"} 0.07
vllm:kv_cache_usage_perc{engine="0",model_name="llama"} 0.81
vllm:kv_cache_usage_perc{engine="1",model_name="llama"} 0.92
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="llama"} 17.0
vllm:num_preemptions_created{engine="0",model_name="llama"} 1.7712e+09
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="bge-m3"} 912345.0
vllm:prompt_tokens_created{engine="0",model_name="bge-m3"} 1.7712e+09
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="llama"} 1021.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="llama"} 12.0
vllm:request_success_created{engine="0",finished_reason="stop",model_name="llama"} 1.7712e+09
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3",model_name="llama"} 10.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="1.0",model_name="llama"} 700.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="llama"} 1033.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="llama"} 1033.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="llama"} 1544.2
vllm:e2e_request_latency_seconds_created{engine="0",model_name="llama"} 1.7712e+09
# HELP vllm:request_queue_time_seconds Histogram of time spent in WAITING phase.
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_bucket{engine="0",le="0.5",model_name="llama"} 900.0
vllm:request_queue_time_seconds_bucket{engine="0",le="+Inf",model_name="llama"} 1033.0
vllm:request_queue_time_seconds_count{engine="0",model_name="llama"} 1033.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="llama"} 301.5
"""


# vLLM before March 2026: no `_by_reason`, the old KV gauge name.
OLD_VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="llama"} 48.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="llama"} 5.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="llama"} 0.97
"""


# What a wrong URL may answer with 200: a web page.
HTML_PAGE = """\
<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Sign in - Model Gateway</title></head>
<body><form method="post"><input name="user"><input name="password" type="password"></form>
</body></html>
"""


class MetricsHandler(BaseHTTPRequestHandler):
    """Answers by path: ``/metrics``, ``/old/metrics`` the two expositions; the rest fail."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        path = self.path
        if path == "/metrics":
            self._send(200, VLLM_TEXT.encode(), {"Content-Type": "text/plain; version=0.0.4"})
        elif path == "/old/metrics":
            self._send(200, OLD_VLLM_TEXT.encode())
        elif path == "/missing":
            self._send(404, b"not found")
        elif path == "/redirect":
            self._send(302, b"", {"Location": "/metrics"})
        elif path == "/big":
            self._send(200, b"#" * 100_000)
        elif path in ("/endless", "/trickle"):
            # No Content-Length: the body ends when the connection does.
            self.close_connection = True
            self.send_response(200)
            self.end_headers()
            endless = path == "/endless"
            chunk, pause = (b"# " + b"x" * 8190 + b"\n", 0.001) if endless else (b"#", 0.1)
            deadline = time.monotonic() + 10
            try:
                while time.monotonic() < deadline:
                    self.wfile.write(chunk)
                    self.wfile.flush()
                    time.sleep(pause)
            except OSError:
                pass
        elif path == "/html":  # a login page, a UI, a proxy's error page: 200, not metrics
            self._send(200, HTML_PAGE.encode(), {"Content-Type": "text/html; charset=utf-8"})
        elif path == "/text":  # a plain-text answer of something else, with 200
            self._send(200, b"It works!\nSee /docs for the API.\n")
        elif path == "/latin1":
            self._send(200, "vllm:num_requests_running 1 # \xe9".encode("latin-1"))
        else:
            self._send(500, b"boom")


class MetricsServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        pass


@contextmanager
def serve_metrics() -> Iterator[str]:
    """A :class:`MetricsServer` on a free port of 127.0.0.1; yields its base URL."""
    server = MetricsServer(("127.0.0.1", 0), MetricsHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
