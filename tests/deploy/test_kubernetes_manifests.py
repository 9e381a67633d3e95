"""deploy/kubernetes/ is valid Kubernetes and wired together: every document passes the API
schemas (``kubernetes-validate``, strict: an unknown field fails; its wheel ships the schemas,
so no network), selectors select, probes point at ports that exist, and no pod spec holds a
secret in plain text.

Versions: the oldest and a recent minor the package ships that the manifests target (native
sidecars, ``policy/v1`` PodDisruptionBudget and ``networking.k8s.io/v1`` are in both).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from fleetgate.coordinator.config import Config

from ._manifests import (
    KUBE,
    KUSTOMIZATION,
    Doc,
    containers,
    documents,
    labels_match,
    manifest_files,
    pod_labels,
    pod_template,
)

kubernetes_validate = pytest.importorskip("kubernetes_validate")

K8S_VERSIONS = ("1.29.0", "1.33.0")
#: a URL carrying a password: scheme://[user]:password@host
CREDENTIAL_URL = re.compile(r"[a-z+]+://[^/\s:@]*:[^/\s@]+@")
SECRET_ENV = re.compile(r"(URL|PASSWORD|AUTH|TOKEN|SECRET)", re.IGNORECASE)


def by_kind(kind: str) -> list[Doc]:
    return [d for d in documents() if d.kind == kind]


def one(kind: str, name: str) -> Doc:
    found = [d for d in by_kind(kind) if d.name == name]
    assert len(found) == 1, f"want one {kind}/{name}, found {[str(d) for d in found]}"
    return found[0]


def test_the_manifests_are_found() -> None:
    names = {p.name for p in manifest_files()}
    assert {"coordinator.yaml", "proxy.yaml", "redis.yaml", "secret.yaml"} <= names
    kinds = {d.kind for d in documents()}
    assert {"Deployment", "StatefulSet", "Service", "Secret", "PodDisruptionBudget"} <= kinds
    assert "NetworkPolicy" in kinds and "ConfigMap" in kinds


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: p.name)
def test_every_document_passes_the_schema(path: Any, version: str) -> None:
    docs = documents(path)
    assert docs, f"{path.name} holds no document"
    for doc in docs:
        try:
            kubernetes_validate.validate(doc.body, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = "/".join(str(p) for p in exc.path)
            pytest.fail(f"{doc} (Kubernetes {version}): {where}: {exc.message}")


def test_the_schema_check_refuses_a_bad_field() -> None:
    doc = one("Deployment", "fleetgate-coordinator").body
    bad = yaml.safe_load(yaml.safe_dump(doc))
    bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}  # a typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[0], strict=True)


def test_the_kustomization_lists_every_manifest() -> None:
    kust = yaml.safe_load((KUBE / KUSTOMIZATION).read_text())
    assert set(kust["resources"]) == {p.name for p in manifest_files()}


def test_coordinators_two_replicas_a_budget_probes_and_resources() -> None:
    deploy = one("Deployment", "fleetgate-coordinator").body
    assert deploy["spec"]["replicas"] == 2
    template = deploy["spec"]["template"]
    pdbs = [
        d
        for d in by_kind("PodDisruptionBudget")
        if labels_match(d.body["spec"]["selector"]["matchLabels"], template["metadata"]["labels"])
    ]
    assert len(pdbs) == 1 and pdbs[0].body["spec"]["minAvailable"] == 1
    (container,) = template["spec"]["containers"]
    assert container["readinessProbe"]["exec"]["command"][:2] == ["fleetgate", "check"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/metrics"


@pytest.mark.parametrize("doc", [d for d in documents() if pod_template(d)], ids=str)
def test_every_container_has_resources_and_probes_on_its_ports(doc: Doc) -> None:
    for c in containers(doc):
        res = c.get("resources", {})
        assert res.get("requests", {}).get("cpu") and res["requests"].get("memory"), c["name"]
        assert res.get("limits", {}).get("memory"), f"{doc} {c['name']}: no memory limit"
        named = {p["name"]: p["containerPort"] for p in c.get("ports", []) if "name" in p}
        numbers = {p["containerPort"] for p in c.get("ports", [])}
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            port = c.get(probe, {}).get("httpGet", {}).get("port")
            if port is not None:
                assert port in named or port in numbers, f"{doc} {c['name']} {probe}: {port}"
        if c["name"] != "app":  # the sidecar example's placeholder application
            assert "readinessProbe" in c and "livenessProbe" in c, f"{doc} {c['name']}"


def test_every_selector_selects_a_pod() -> None:
    pods = pod_labels()
    selectors: list[tuple[str, dict[str, str]]] = []
    for doc in documents():
        spec = doc.body.get("spec", {})
        if doc.kind == "Service":
            selectors.append((str(doc), spec["selector"]))
        elif doc.kind in ("PodDisruptionBudget", "Deployment", "StatefulSet"):
            selectors.append((str(doc), spec["selector"]["matchLabels"]))
        elif doc.kind == "NetworkPolicy" and spec["podSelector"]:
            selectors.append((str(doc), spec["podSelector"]["matchLabels"]))
        if doc.kind == "NetworkPolicy":  # peers inside the namespace (no namespaceSelector)
            for rule in [*spec.get("ingress", []), *spec.get("egress", [])]:
                for peer in rule.get("from", rule.get("to", [])):
                    if "podSelector" in peer and "namespaceSelector" not in peer:
                        selectors.append((f"{doc} peer", peer["podSelector"]["matchLabels"]))
    assert len(selectors) > 10
    lonely = [w for w, sel in selectors if not any(labels_match(sel, lab) for _, lab in pods)]
    assert not lonely, f"select no pod of the manifests: {lonely}"


def test_redis_is_reached_only_by_pods_labelled_as_its_clients() -> None:
    policy = one("NetworkPolicy", "redis-ingress").body["spec"]
    (rule,) = policy["ingress"]
    (peer,) = rule["from"]
    clients = peer["podSelector"]["matchLabels"]
    for doc in documents():
        names = {e["name"] for c in containers(doc) for e in c.get("env", [])}
        if "FLEETGATE_REDIS_URL" in names:
            labels = pod_template(doc)["metadata"]["labels"]  # type: ignore[index]
            assert labels_match(clients, labels), f"{doc} talks to Redis without the label"


def test_no_secret_in_plain_text_in_any_pod_spec() -> None:
    secret = one("Secret", "fleetgate-redis").body
    keys = set(secret.get("stringData", {})) | set(secret.get("data", {}))
    refs = 0
    for doc in documents():
        if pod_template(doc) is None:
            continue
        text = yaml.safe_dump(pod_template(doc))
        assert not CREDENTIAL_URL.search(text), f"{doc}: a URL with a password"
        for c in containers(doc):
            for env in c.get("env", []):
                if SECRET_ENV.search(env["name"]) and env["name"] != "OPENAI_BASE_URL":
                    ref = env.get("valueFrom", {}).get("secretKeyRef")
                    assert ref and "value" not in env, f"{doc} {c['name']}: {env['name']} literal"
                    assert ref["name"] == "fleetgate-redis" and ref["key"] in keys, ref
                    refs += 1
    assert refs >= 4


def test_the_coordinator_config_loads_and_listens_where_it_is_probed() -> None:
    config_map = one("ConfigMap", "fleetgate-coordinator").body
    cfg = Config.from_toml_text(
        config_map["data"]["coordinator.toml"], env={"FLEETGATE_REDIS_URL": "redis://redis:6379/0"}
    )
    assert cfg.redis.url == "redis://redis:6379/0"  # the Secret's URL wins over the file
    host, port = cfg.coordinator.metrics_address
    assert host == "0.0.0.0"
    template = one("Deployment", "fleetgate-coordinator").body["spec"]["template"]
    (container,) = template["spec"]["containers"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]}["metrics"] == port
    assert template["metadata"]["annotations"]["prometheus.io/port"] == str(port)
    assert len(cfg.gates) >= 2
