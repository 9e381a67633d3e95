"""The package list and the image build name every room pyproject's ``package-dir`` maps.

``[tool.setuptools] packages`` is an explicit list: a subpackage missing from it is absent from
the wheel (an editable install, which the suite runs on, finds it anyway). The Dockerfile copies
the sources folder by folder: a room it misses is absent from the image.
"""

from __future__ import annotations

import re
from pathlib import Path

from ._tree import ROOT, package_dirs


def packages_on_disk(dirs: dict[str, Path]) -> set[str]:
    """Every package (a folder with ``__init__.py``) under the mapped folders, by import name."""
    found = set()
    for name, top in dirs.items():
        for init in top.rglob("__init__.py"):
            rel = init.parent.relative_to(top).parts
            if not any(p.startswith(".") or p == "__pycache__" for p in rel):
                found.add(".".join((name, *rel)))
    return found


def listed_packages() -> set[str]:
    import tomllib

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return set(data["tool"]["setuptools"]["packages"])


def copied_folders(dockerfile: str) -> set[str]:
    """The source folders a Dockerfile's ``COPY <src> ./<src>`` lines bring into the image."""
    return set(re.findall(r"^COPY\s+([\w.-]+)\s+\./\1\s*$", dockerfile, re.MULTILINE))


def test_every_package_is_listed() -> None:
    on_disk = packages_on_disk(package_dirs())
    assert "fleetgate.coordinator.scrape" in on_disk and "fleetgate.testing" in on_disk
    assert on_disk - listed_packages() == set(), "pyproject's packages misses these"
    assert listed_packages() - on_disk == set(), "pyproject lists packages that do not exist"


def test_the_image_copies_every_room() -> None:
    folders = {str(p.relative_to(ROOT)) for p in package_dirs().values()}
    assert folders - copied_folders((ROOT / "Dockerfile").read_text()) == set()


def test_a_missing_copy_is_found() -> None:
    text = "FROM x\nCOPY fleetgate ./fleetgate\nCOPY lua ./lua\nCOPY a ./b\n"
    assert copied_folders(text) == {"fleetgate", "lua"}
