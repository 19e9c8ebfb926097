"""Sandbox templates: the sizes and files a sandbox starts from.

Built-ins match the hosted platform's defaults (2 vCPU / 2048 MB) so jobs see the
same limits locally. A template directory adds one: ``DIR/template.json`` (name,
cpu, memory_mb, disk_mb, pids_max, nofile) and an optional ``DIR/rootfs/`` whose
files are copied into every sandbox made from it.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import pythonenv

TEMPLATE_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
# The platform's 2 vCPU, but never the whole host: one CPU stays for the server and its neighbours.
DEFAULT_CPU = max(1, min(2, (os.cpu_count() or 2) - 1))


@dataclass(frozen=True)
class Template:
    name: str
    cpu: int = DEFAULT_CPU
    memory_mb: int = 2048
    disk_mb: int = 1024
    pids_max: int = 256
    nofile: int = 1024
    rootfs: Path | None = None
    # A host Python environment and code directories bound read-only (pythonenv.py).
    python_env: Path | None = None
    code_dirs: tuple[Path, ...] = ()


BUILTIN_TEMPLATES = (
    Template("code-interpreter"),
    Template("base"),
)


class TemplateError(ValueError):
    """A template directory that cannot be used."""


def load_template_dir(directory: str | Path) -> Template:
    """Read ``DIR/template.json``; the name defaults to the directory name."""
    path = Path(directory)
    spec: dict[str, Any] = {}
    meta = path / "template.json"
    if meta.exists():
        try:
            spec = json.loads(meta.read_text())
        except ValueError as exc:
            raise TemplateError(f"{meta}: invalid JSON: {exc}") from exc
    elif not path.is_dir():
        raise TemplateError(f"{path}: not a directory")
    name = str(spec.get("name") or path.name)
    if not TEMPLATE_NAME_RE.match(name):
        raise TemplateError(f"{path}: invalid template name {name!r}")
    rootfs = path / "rootfs"
    fields: dict[str, Any] = {
        k: int(spec[k]) for k in ("cpu", "memory_mb", "disk_mb", "pids_max", "nofile") if k in spec
    }
    for key, value in fields.items():
        if value <= 0:
            raise TemplateError(f"{path}: {key} must be positive")
    try:
        env_fields = pythonenv.parse(path, spec)
    except ValueError as exc:
        raise TemplateError(str(exc)) from None
    return Template(name=name, rootfs=rootfs.resolve() if rootfs.is_dir() else None, **fields, **env_fields)


def template_registry(template_dirs: tuple[str, ...] | list[str] = ()) -> dict[str, Template]:
    registry = {t.name: t for t in BUILTIN_TEMPLATES}
    for directory in template_dirs:
        template = load_template_dir(directory)
        registry[template.name] = template
    return registry
