"""The local PandaStack server as the suites use it: template directories and the leak guard."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

# The suites' one backend switch: LocalServer's default isolation (bwrap unless set to gvisor).
ISOLATION = os.environ.get("PANDASTACK_LOCAL_ISOLATION") or "bwrap"
GVISOR = ISOLATION == "gvisor"


def write_template(directory: Path, files: dict[str, str] | None = None, **spec: object) -> Path:
    """A template directory: ``template.json`` from ``spec``, ``files`` under ``rootfs/``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "template.json").write_text(json.dumps(spec))
    for path, text in (files or {}).items():
        target = directory / "rootfs" / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return directory


def fail_on_leftovers(server: Any) -> None:
    """The leak guard: a test must leave zero sandboxes (they are deleted, then the test fails)."""
    if not server.running():
        return
    leftovers = server.delete_leftovers()
    if leftovers:
        pytest.fail(f"test left {len(leftovers)} sandbox(es) on the local server: {', '.join(leftovers)}")
