"""The manifests stay in step with the CLI: every ``fleetgate`` command a container or a probe of
deploy/kubernetes/ runs parses with the real argument parsers (``fleetgate.cli.build_parser``,
and for the commands that pass their options on, the parser of the module that runs them), every
``$(VAR)`` in it is a variable the container defines, every ``--config FILE`` is a file a volume
mounts, and every ``FLEETGATE_*`` variable a manifest sets is one the code reads.

A flag renamed or removed in the CLI fails here, naming the manifest and the container.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import re
from pathlib import Path
from typing import Any

import pytest

from fleetgate import cli
from fleetgate.tools import load
from fleetgate.tools.sim import rerank, vllm

from ._manifests import ROOT, Doc, containers, documents, fleetgate_argvs, pod_template

SOURCES = ("fleetgate", "client", "coordinator", "proxy", "tools", "cli")
VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def parsers_of(argv: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """The parser that really parses ``fleetgate <argv>``, and the arguments it gets."""
    if argv[:1] == ["worker"]:
        return load.build_parser(), argv[1:]
    if argv[:2] == ["sim", "vllm"]:
        return vllm.build_parser(), argv[2:]
    if argv[:2] == ["sim", "rerank"]:
        return rerank.build_parser(), argv[2:]
    assert argv[:1] != ["demo"], "the demo is no deployment"
    return cli.build_parser(), argv


def parse_error(argv: list[str]) -> str | None:
    """None if ``fleetgate <argv>`` parses, else what argparse said."""
    parser, args = parsers_of(argv)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            parser.parse_args(args)
        except SystemExit as exc:
            return err.getvalue().strip() or f"exit {exc.code}"
    return None


def commands() -> list[tuple[str, dict[str, Any], list[str]]]:
    """``(where, container, argv)`` of every fleetgate command of every manifest."""
    found = []
    for doc in documents():
        for c in containers(doc):
            for where, argv in fleetgate_argvs(c):
                found.append((f"{doc} {where}", c, argv))
    return found


def test_the_commands_are_found() -> None:
    subcommands = {argv[0] for _, _, argv in commands()}
    assert {"coordinator", "check", "proxy"} <= subcommands


@pytest.mark.parametrize(
    ("where", "container", "argv"), [pytest.param(*c, id=c[0]) for c in commands()]
)
def test_every_fleetgate_command_parses(where: str, container: Any, argv: list[str]) -> None:
    assert argv, f"{where}: runs the image without a command (prints --help and exits)"
    error = parse_error(argv)
    assert error is None, f"{where}: fleetgate {' '.join(argv)}\n{error}"
    defined = {e["name"] for e in container.get("env", [])}
    for arg in argv:
        for var in VAR.findall(arg):
            assert var in defined, f"{where}: $({var}) is not in the container's env"


@pytest.mark.parametrize(
    "argv",
    [
        ["coordinator", "--config", "c.toml", "--no-such-flag"],
        ["coordinator"],  # --config is required
        ["check", "--redis-url", "redis://r"],
        ["proxy", "--upstream", "http://u", "--gate", "g", "--workers", "0"],
        ["worker", "--gate", "g"],  # --target-url is required
    ],
)
def test_a_bad_command_is_found(argv: list[str]) -> None:
    assert parse_error(argv) is not None


def test_every_config_file_is_mounted() -> None:
    for doc in documents():
        template = pod_template(doc)
        if template is None:
            continue
        volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
        config_maps = {d.name: d for d in documents() if d.kind == "ConfigMap"}
        for c in containers(doc):
            for where, argv in fleetgate_argvs(c):
                for flag, value in itertools.pairwise(argv):
                    if flag == "--config":
                        assert_mounted(f"{doc} {where}", c, volumes, config_maps, value)


def assert_mounted(
    where: str, c: dict[str, Any], volumes: dict[str, Any], maps: dict[str, Doc], path: str
) -> None:
    """``path`` is a key of a ConfigMap a volume of ``c`` mounts at its directory."""
    file = Path(path)
    mounts = [m for m in c.get("volumeMounts", []) if Path(m["mountPath"]) == file.parent]
    assert mounts, f"{where}: nothing mounted at {file.parent}"
    source = volumes[mounts[0]["name"]]
    assert "configMap" in source, f"{where}: {file.parent} is no ConfigMap"
    data = maps[source["configMap"]["name"]].body["data"]
    assert file.name in data, f"{where}: the ConfigMap has no {file.name}"


def test_every_fleetgate_variable_is_one_the_code_reads() -> None:
    names = {
        e["name"]
        for doc in documents()
        for c in containers(doc)
        for e in c.get("env", [])
        if e["name"].startswith("FLEETGATE_")
    }
    assert "FLEETGATE_REDIS_URL" in names
    code = "\n".join(
        p.read_text() for top in SOURCES for p in (ROOT / top).rglob("*.py") if "test" not in p.name
    )
    unread = sorted(n for n in names if f'"{n}"' not in code)
    assert not unread, f"set by a manifest, read by no code: {unread}"
