"""docker-compose.yml, deploy/coordinator.toml and deploy/prometheus.yml agree with each other.

No Docker engine is needed: ``docker-compose config`` only renders and validates the file. The
compose checks skip where ``docker-compose`` is not installed (Debian: ``apt-get install
docker-compose``); the prometheus.yml check uses ``promtool`` (Debian: ``prometheus``) when there.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from fleetgate.coordinator.config import Config

from .._tree import package_dirs

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = shutil.which("docker-compose")
PROMTOOL = shutil.which("promtool")
SERVICES = {
    "redis",
    "coordinator-a",
    "coordinator-b",
    "vllm-embed",
    "vllm-chat",
    "reranker",
    "worker",
    "proxy",
    "prometheus",
}
FLEETGATE_SERVICES = SERVICES - {"redis", "prometheus"}
CONFIG_IN_CONTAINER = "/etc/fleetgate/coordinator.toml"

needs_compose = pytest.mark.skipif(
    COMPOSE is None, reason="docker-compose not installed (Debian: apt-get install docker-compose)"
)


def _yaml_load(text: str) -> Any | None:
    """Parse YAML without adding a dependency: PyYAML if importable, else the interpreter of
    docker-compose 1.x (a Python program that ships PyYAML); None if neither is there."""
    try:
        import yaml  # type: ignore[import-untyped]
    except ImportError:
        pass
    else:
        return yaml.safe_load(text)
    if COMPOSE is None:
        return None
    first = Path(COMPOSE).read_bytes()[:200].split(b"\n", 1)[0].decode(errors="replace")
    if not (first.startswith("#!") and "python" in first):
        return None
    code = "import json, sys, yaml; json.dump(yaml.safe_load(sys.stdin), sys.stdout)"
    out = subprocess.run(
        [*first[2:].split(), "-c", code], input=text, capture_output=True, text=True, timeout=30
    )
    return json.loads(out.stdout) if out.returncode == 0 else None


def _compose(*args: str) -> subprocess.CompletedProcess[str]:
    assert COMPOSE is not None
    cmd = [COMPOSE, "-f", str(ROOT / "docker-compose.yml"), "--project-directory", str(ROOT)]
    return subprocess.run([*cmd, *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def rendered() -> dict[str, Any]:
    """The compose file as ``docker-compose config`` renders it (anchors and merges resolved)."""
    if COMPOSE is None:
        pytest.skip("docker-compose not installed (Debian: apt-get install docker-compose)")
    as_json = _compose("config", "--format", "json")  # Compose v2; 1.x has no --format
    if as_json.returncode == 0 and as_json.stdout.lstrip().startswith("{"):
        return dict(json.loads(as_json.stdout))
    out = _compose("config")
    assert out.returncode == 0, f"docker-compose config failed:\n{out.stderr}"
    data = _yaml_load(out.stdout)
    if data is None:
        pytest.skip("no YAML parser to read `docker-compose config` output")
    return dict(data)


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """{container path: host path} of a service's bind mounts (short or long syntax)."""
    found = {}
    for v in service.get("volumes", []):
        if isinstance(v, str):
            source, target = v.split(":")[:2]
        else:
            source, target = v["source"], v["target"]
        found[target] = str(Path(source).resolve())
    return found


def _argv(service: dict[str, Any]) -> list[str]:
    entry, command = service.get("entrypoint") or [], service.get("command") or []
    return [*entry, *command]


def _option(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag]


def _config() -> Config:
    return Config.from_toml_text((ROOT / "deploy/coordinator.toml").read_text(), env={})


@needs_compose
def test_compose_services(rendered: dict[str, Any]) -> None:
    services = rendered["services"]
    assert set(services) == SERVICES
    listed = _compose("config", "--services")
    assert listed.returncode == 0, listed.stderr
    assert set(listed.stdout.split()) == SERVICES
    for name in FLEETGATE_SERVICES:  # one image, built from the repository's Dockerfile
        build = services[name]["build"]
        assert services[name]["image"] == services["worker"]["image"], name
        assert Path(build["context"]).resolve() == ROOT, name
        assert build.get("dockerfile", "Dockerfile") == "Dockerfile", name
    assert services["redis"]["image"].startswith("redis:7")
    redis_args = services["redis"]["command"]
    assert "noeviction" in _option(redis_args, "--maxmemory-policy")


@needs_compose
def test_compose_coordinators_use_the_config_file(rendered: dict[str, Any]) -> None:
    for name in ("coordinator-a", "coordinator-b"):
        svc = rendered["services"][name]
        argv = _argv(svc)
        assert argv[0] == "coordinator" and _option(argv, "--config") == [CONFIG_IN_CONTAINER]
        assert _mounts(svc)[CONFIG_IN_CONTAINER] == str(ROOT / "deploy/coordinator.toml")
        assert "redis" in svc["depends_on"]


@needs_compose
def test_compose_prometheus_mounts_its_config(rendered: dict[str, Any]) -> None:
    prom = rendered["services"]["prometheus"]
    assert prom["image"].startswith("prom/prometheus")
    assert _mounts(prom)["/etc/prometheus/prometheus.yml"] == str(ROOT / "deploy/prometheus.yml")
    # rule_files is relative to the config: the rules sit beside it as in deploy/
    rules = _mounts(prom)["/etc/prometheus/prometheus/alerts.yml"]
    assert rules == str(ROOT / "deploy/prometheus/alerts.yml")


@needs_compose
def test_compose_workers_and_simulators_match_the_gates(rendered: dict[str, Any]) -> None:
    services, config = rendered["services"], _config()
    worker = services["worker"]
    replicas = (worker.get("deploy") or {}).get("replicas", worker.get("scale"))
    assert replicas == 2
    argv = _argv(worker)
    assert argv[:3] == ["python", "-m", "fleetgate.tools.load"] or argv[0] == "worker", argv
    assert _option(argv, "--redis") == [config.redis.url]
    assert _option(argv, "--metrics-listen") == ["0.0.0.0:9100"]
    gates, urls = _option(argv, "--gate"), _option(argv, "--target-url")
    assert set(gates) == {g.name for g in config.gates}
    for gate, url in zip(gates, urls, strict=True):
        host = urlsplit(url).hostname
        assert host in services, f"{gate}: {url} is not a compose service"
        sim = _argv(services[host])
        assert sim[0] == "sim" and _option(sim, "--port") == [str(urlsplit(url).port)]
        gc = config.gate(gate)
        if gc.has_metrics:  # the coordinator scrapes the simulator the workers call
            assert gc.metrics_urls == (f"http://{host}:{urlsplit(url).port}/metrics",)
            assert _option(sim, "--model") == [gc.model_name]


@needs_compose
def test_compose_proxy_gates_the_reranker_with_the_workers_gate(rendered: dict[str, Any]) -> None:
    services, config = rendered["services"], _config()
    argv = _argv(services["proxy"])
    assert argv[0] == "proxy"
    upstream = _option(argv, "--upstream")[0]
    host = urlsplit(upstream).hostname
    assert host == "reranker" and _argv(services[host])[:2] == ["sim", "rerank"]
    worker = _argv(services["worker"])
    urls = dict(zip(_option(worker, "--gate"), _option(worker, "--target-url"), strict=True))
    (gate,) = _option(argv, "--gate")
    assert urlsplit(urls[gate]).hostname == host  # one gate for the workers and the proxy
    config.gate(gate)  # configured by the coordinator
    assert _option(argv, "--redis") == [config.redis.url]
    assert _option(argv, "--prefix") == _option(worker, "--prefix")
    assert _option(argv, "--listen") == ["0.0.0.0:8080"]
    assert "reranker" in services["proxy"]["depends_on"]


def test_deploy_coordinator_toml() -> None:
    config = _config()
    assert urlsplit(config.redis.url).hostname == "redis"
    assert config.coordinator.metrics_address == ("0.0.0.0", 9464)
    assert {g.name for g in config.gates} == {
        "bge-m3",
        "llama-3.1-8b",
        "rerank/nemoretriever-500m-v2",
    }
    adaptive = {g.name for g in config.gates if config.is_adaptive(g)}
    assert adaptive == {"bge-m3", "llama-3.1-8b"}
    for gate in config.gates:
        for url in gate.metrics_urls:
            assert urlsplit(url).hostname in SERVICES, url


def test_deploy_prometheus_yml() -> None:
    path = ROOT / "deploy/prometheus.yml"
    if PROMTOOL is None and _yaml_load("a: 1") is None:
        pytest.skip("neither promtool (Debian: prometheus) nor a YAML parser is installed")
    if PROMTOOL is not None:
        out = subprocess.run(
            [PROMTOOL, "check", "config", str(path)], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stdout + out.stderr
    data = _yaml_load(path.read_text())
    if data is None:
        return
    jobs = {job["job_name"]: job for job in data["scrape_configs"]}
    static = {
        t for job in jobs.values() for sc in job.get("static_configs", []) for t in sc["targets"]
    }
    port = _config().coordinator.metrics_address[1]
    assert {f"coordinator-a:{port}", f"coordinator-b:{port}"} <= static
    dns = [sd for job in jobs.values() for sd in job.get("dns_sd_configs", [])]
    assert any(sd["names"] == ["worker"] and sd["port"] == 9100 for sd in dns), dns


def test_the_image_installs_every_package_and_the_fast_extra() -> None:
    """The image runs the proxy and the workers on their fast paths (hiredis, uvloop,
    httptools) and holds every root folder the package is built from."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    [install] = re.findall(r'pip install "\.\[([a-z,]+)\]"', dockerfile)
    assert {"sim", "proxy", "fast"} <= set(install.split(","))
    roots = {path.relative_to(ROOT).parts[0] for path in package_dirs().values()}
    copied = set(re.findall(r"^COPY (\w+) \./\w+$", dockerfile, re.M))
    assert roots <= copied, roots - copied
