"""deploy/kubernetes/ as data: every YAML document of every manifest, and the pod specs and
containers inside them (shared by the schema and the CLI checks of this room)."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
#: kustomize's own file: no Kubernetes API object, so not in the API schemas
KUSTOMIZATION = "kustomization.yaml"
#: the image every fleetgate container runs (built from ./Dockerfile; entrypoint `fleetgate`)
IMAGE = "fleetgate"
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}


@dataclass(frozen=True)
class Doc:
    """One YAML document of one manifest file."""

    file: str
    index: int
    body: dict[str, Any]

    @property
    def kind(self) -> str:
        return str(self.body["kind"])

    @property
    def name(self) -> str:
        return str(self.body["metadata"]["name"])

    def __str__(self) -> str:
        return f"{self.file}[{self.index}] {self.kind}/{self.name}"


def manifest_files() -> list[Path]:
    """Every manifest (the kustomization aside), sorted."""
    return sorted(p for p in KUBE.glob("*.yaml") if p.name != KUSTOMIZATION)


def documents(path: Path | None = None) -> list[Doc]:
    """The documents of ``path`` (None: of every manifest), empty ones skipped (parsed once per
    file: treat them as read-only)."""
    paths = manifest_files() if path is None else [path]
    return [doc for p in paths for doc in _parsed(p)]


@functools.cache
def _parsed(path: Path) -> tuple[Doc, ...]:
    bodies = yaml.safe_load_all(path.read_text())
    return tuple(Doc(path.name, i, body) for i, body in enumerate(bodies) if body)


def pod_template(doc: Doc) -> dict[str, Any] | None:
    """The pod template (metadata + spec) of a workload, the pod itself for a Pod, else None."""
    if doc.kind in WORKLOADS:
        template: dict[str, Any] = doc.body["spec"]["template"]
        return template
    if doc.kind == "Pod":
        return doc.body
    return None


def containers(doc: Doc) -> Iterator[dict[str, Any]]:
    """Every container (init containers included) of a workload's pod spec."""
    template = pod_template(doc)
    if template is None:
        return
    spec = template["spec"]
    yield from spec.get("initContainers", [])
    yield from spec["containers"]


def is_fleetgate(container: dict[str, Any]) -> bool:
    """Whether ``container`` runs the fleetgate image (``fleetgate:<tag>`` or ``.../fleetgate``)."""
    repo = str(container["image"]).rsplit(":", 1)[0]
    return repo.rsplit("/", 1)[-1] == IMAGE


def fleetgate_argvs(container: dict[str, Any]) -> Iterator[tuple[str, list[str]]]:
    """``(where, argv after "fleetgate")`` of each fleetgate command a container runs: its main
    process (the image's entrypoint with ``args``, or a ``command`` starting with
    ``fleetgate``) and every exec probe or hook that runs ``fleetgate``."""
    name = container["name"]
    if is_fleetgate(container):
        command = container.get("command")
        if command is None:
            yield f"{name}: args", [str(a) for a in container.get("args", [])]
        elif command[0] == "fleetgate":
            yield f"{name}: command", [str(a) for a in [*command[1:], *container.get("args", [])]]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        cmd = container.get(probe, {}).get("exec", {}).get("command")
        if cmd and cmd[0] == "fleetgate":
            yield f"{name}: {probe}", [str(a) for a in cmd[1:]]
    for hook in ("postStart", "preStop"):
        cmd = container.get("lifecycle", {}).get(hook, {}).get("exec", {}).get("command")
        if cmd and cmd[0] == "fleetgate":
            yield f"{name}: {hook}", [str(a) for a in cmd[1:]]


def labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    """A ``matchLabels`` selector against a pod's labels."""
    return all(labels.get(k) == v for k, v in selector.items())


def pod_labels() -> list[tuple[str, dict[str, str]]]:
    """``(workload, its pod template's labels)`` for every workload of every manifest."""
    out = []
    for doc in documents():
        template = pod_template(doc)
        if template is not None:
            out.append((str(doc), dict(template["metadata"].get("labels", {}))))
    return out
