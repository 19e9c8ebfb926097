"""Sandbox templates: the sizes, software and files a sandbox starts from.

Built-ins match the hosted platform's (2 vCPU / 2048 MB; ``code-interpreter`` with
the data stack, ``base`` with python3 and node) so a job that runs locally runs
there. A template directory adds one: ``DIR/template.json`` (name, cpu, memory_mb,
disk_mb, pids_max, nofile, ``requirements``: a pip requirements file, ``apt``: a
Debian package list, ``env``: variables) and an optional ``DIR/rootfs/`` whose
files are copied into every sandbox made from it. The software is built once by
``templates.build`` and shared read-only by every sandbox of the template.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pandastack_local.exceptions import PandaStackLocalError
from pandastack_local.templates import build as template_build
from pandastack_local.templates import pythonenv
from pandastack_local.templates.build import TemplateBuildError, parse_debs, parse_requirements

TEMPLATE_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


@dataclass(frozen=True)
class Template:
    name: str
    cpu: int = 2
    memory_mb: int = 2048
    disk_mb: int = 1024
    pids_max: int = 256
    nofile: int = 1024
    rootfs: Path | None = None
    # A host Python environment and code directories bound read-only (pythonenv.py).
    python_env: Path | None = None
    code_dirs: tuple[Path, ...] = ()
    requirements: tuple[str, ...] = ()
    debs: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict, hash=False)
    verify: tuple[str, ...] = ()
    # The built environment's directory, once built (see templates.build).
    built: Path | None = None

    @property
    def needs_build(self) -> bool:
        return bool(self.requirements or self.debs)

    def guest_args(self) -> list[str]:
        """bwrap arguments for the template's software (read-only binds, PATH, env)."""
        if self.built is not None:
            return template_build.guest_args(self.built, self.env, pythonenv.guest_path(self))
        return [arg for key, value in self.env.items() for arg in ("--setenv", key, value)]

    def to_json(self) -> dict[str, Any]:
        """The template as ``GET /v1/templates`` shows it (the real server's fields, plus disk)."""
        return {
            "name": self.name,
            "cpu": self.cpu,
            "memory_mb": self.memory_mb,
            "disk_mb": self.disk_mb,
            "size_bytes": self.disk_mb * 1024 * 1024,
            "meta": {"requirements": list(self.requirements), "debs": list(self.debs)},
        }


# The hosted code-interpreter's data stack (its Dockerfile's pins), importable by python3.
CODE_INTERPRETER_REQUIREMENTS = (
    "numpy==2.3.5",
    "pandas==2.2.3",
    "scipy==1.17.1",
    "scikit-learn==1.6.1",
    "matplotlib==3.10.8",
    "seaborn==0.13.2",
    "pyarrow==23.0.1",
    "openpyxl==3.1.5",
    "requests==2.32.5",
    "sqlalchemy==2.0.49",
    "orjson==3.11.7",
)
CODE_INTERPRETER_IMPORTS = (
    "numpy",
    "pandas",
    "scipy",
    "sklearn",
    "matplotlib.pyplot",
    "seaborn",
    "pyarrow",
    "openpyxl",
    "requests",
    "sqlalchemy",
    "orjson",
)
# Docker ENV is not injected into the hosted microVMs either; these two matter for jobs.
GUEST_ENV = {"MPLBACKEND": "Agg", "PYTHONUNBUFFERED": "1"}

BUILTIN_TEMPLATES = (
    Template(
        "code-interpreter",
        requirements=CODE_INTERPRETER_REQUIREMENTS,
        env=GUEST_ENV,
        verify=CODE_INTERPRETER_IMPORTS,
    ),
    Template("base", env=GUEST_ENV),
)


class TemplateError(PandaStackLocalError, ValueError):
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
    env = spec.get("env") or {}
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        raise TemplateError(f"{meta}: env must be an object of string to string")
    try:
        requirements = _list_file(path, spec, "requirements", parse_requirements)
        debs = _list_file(path, spec, "apt", parse_debs)
    except TemplateBuildError as exc:
        raise TemplateError(str(exc)) from None
    return Template(
        name=name,
        rootfs=rootfs.resolve() if rootfs.is_dir() else None,
        requirements=requirements,
        debs=debs,
        env={**GUEST_ENV, **env},
        **fields,
        **env_fields,
    )


def _list_file(directory: Path, spec: dict[str, Any], key: str, parse: Any) -> tuple[str, ...]:
    """``"requirements": "requirements.txt"`` (a file in DIR) or an inline list of lines."""
    value = spec.get(key)
    if value is None:
        return ()
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(parse(value, f"{directory / 'template.json'} {key}"))
    if not isinstance(value, str):
        raise TemplateError(f"{directory}/template.json: {key} must be a file name or a list of strings")
    source = (directory / value).resolve()
    try:
        text = source.read_text()
    except OSError as exc:
        raise TemplateError(
            f"{directory}/template.json: {key}: cannot read {source}: {exc.strerror}"
        ) from None
    return tuple(parse(text.splitlines(), str(source)))


def template_registry(template_dirs: tuple[str, ...] | list[str] = ()) -> dict[str, Template]:
    registry = {t.name: t for t in BUILTIN_TEMPLATES}
    for directory in template_dirs:
        template = load_template_dir(directory)
        registry[template.name] = template
    return registry
