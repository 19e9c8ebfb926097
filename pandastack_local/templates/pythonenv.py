"""Templates that carry a Python environment and code: the engine's own workload runs inside.

A template directory's ``template.json`` may name a host virtualenv (``python_env``,
e.g. the Prefect or Airflow worker's own) and directories of code (``code_dirs``, e.g.
the flow's project directory or the DAG bundle). Each is bound **read-only at the same
path** inside the sandbox, so absolute paths that the engine already wrote down (a
deployment's ``set_working_directory`` pull step, a venv's script shebangs and
``pyvenv.cfg``) resolve unchanged, and ``PYTHON_ENV/bin`` comes first on the sandbox's
``PATH``, so ``python`` and ``prefect`` are the environment's. A venv whose base
interpreter lives outside ``/usr`` also gets that interpreter's prefix bound read-only.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol


class Template(Protocol):
    """What this module reads of a template (``registry.Template``, which builds on this module)."""

    @property
    def name(self) -> str: ...
    @property
    def python_env(self) -> Path | None: ...
    @property
    def code_dirs(self) -> tuple[Path, ...]: ...


DEFAULT_GUEST_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"
# Paths the sandbox builds itself or that would expose the host: never bound from a template.
_RESERVED = (Path("/proc"), Path("/dev"), Path("/sys"), Path("/etc"), Path("/.pandastack"))
_USR = Path("/usr")  # already bound read-only in every sandbox


def _check_dir(where: Path, field: str, value: Any) -> Path:
    if not isinstance(value, str) or not value.startswith("/"):
        raise ValueError(f"{where}: {field} must be an absolute path string, got {value!r}")
    path = Path(value).resolve()
    if not path.is_dir():
        raise ValueError(f"{where}: {field} {value!r} is not a directory on this host")
    if path == Path("/") or any(path == r or r in path.parents for r in _RESERVED):
        raise ValueError(f"{where}: {field} {value!r} may not be / or under /proc, /dev, /sys, /etc")
    return path


def parse(where: Path, spec: dict[str, Any]) -> dict[str, Any]:
    """The ``python_env`` and ``code_dirs`` fields of a template.json, checked."""
    fields: dict[str, Any] = {}
    if spec.get("python_env") is not None:
        env = _check_dir(where, "python_env", spec["python_env"])
        if not (env / "bin" / "python").exists():
            raise ValueError(
                f"{where}: python_env {spec['python_env']!r} has no bin/python: "
                "point it at a virtualenv (python -m venv DIR) or an installation prefix"
            )
        fields["python_env"] = env
    code = spec.get("code_dirs", [])
    if isinstance(code, str):
        code = [code]
    if not isinstance(code, list):
        raise ValueError(f"{where}: code_dirs must be a list of absolute directory paths")
    fields["code_dirs"] = tuple(_check_dir(where, "code_dirs", c) for c in code)
    return fields


def _base_prefix(env: Path) -> Path | None:
    """The base interpreter's prefix from ``pyvenv.cfg`` (``home = PREFIX/bin``), if outside /usr."""
    cfg = env / "pyvenv.cfg"
    if not cfg.is_file():
        return None
    for line in cfg.read_text(errors="replace").splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() == "home":
            prefix = Path(value.strip()).resolve().parent
            return None if prefix == Path("/") else prefix
    return None


def bind_args(template: Template) -> list[str]:
    """bwrap arguments binding the template's environment and code read-only at their paths."""
    paths: list[Path] = []
    if template.python_env is not None:
        base = _base_prefix(template.python_env)
        if base is not None and base.is_dir():
            paths.append(base)
        paths.append(template.python_env)
    paths.extend(template.code_dirs)
    args: list[str] = []
    for path in paths:
        if path != _USR and _USR not in path.parents:
            args += ["--ro-bind", str(path), str(path)]
    return args


def guest_path(template: Template) -> str:
    """The sandbox's PATH: the environment's bin first, when the template has one."""
    if template.python_env is None:
        return DEFAULT_GUEST_PATH
    return f"{template.python_env / 'bin'}:{DEFAULT_GUEST_PATH}"


def check_outside(templates: Iterable[Template], private: Path) -> None:
    """Refuse a template that would bind the server's state dir (agent sockets) or a parent of it."""
    for template in templates:
        for path in [template.python_env, *template.code_dirs]:
            if path is not None and (path == private or path in private.parents or private in path.parents):
                raise ValueError(
                    f"template {template.name!r}: {path} overlaps the server's "
                    f"state dir {private}: bind a directory outside it"
                )
