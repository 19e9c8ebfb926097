"""Build a template's software environment once, cache it, and bind it read-only into sandboxes.

A template with requirements (``code-interpreter``'s data stack, or a user's
requirements file and Debian package list) gets one environment per content:
a virtualenv on the guest's ``/usr/bin/python3`` filled by pip (the machine's own
pip configuration decides where packages come from), plus the files of any Debian
packages. It is built under the cache dir (``~/.cache/pandastack-local/templates``
by default, so a restarted server or another server on the same machine reuses
it), under a file lock (two servers never build the same thing twice), into a
temporary directory renamed into place when complete. Every sandbox of the
template sees it read-only at ``/opt/pandastack/env``: nothing is installed per
sandbox.

The environment is built at a host path and used at the guest path, so the few
places that record their own location are rewritten once after the build: script
shebangs, bytecode file names (compiled with the guest prefix) and matplotlib's
font cache (built ahead so no sandbox pays for it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from pandastack_local.exceptions import PandaStackLocalError

GUEST_PYTHON = "/usr/bin/python3"
GUEST_ENV_DIR = "/opt/pandastack/env"
GUEST_DEB_ROOT = "/opt/pandastack/root"
GUEST_MPL_CACHE = "/root/.cache/matplotlib"
BASE_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"
BUILD_FORMAT = 1
MARKER = "built.json"
ERROR_TAIL_LINES = 12
# Build steps running now (a stopping server ends them: nothing outlives it).
_RUNNING: set[subprocess.Popen[str]] = set()
# Each build step runs under this guard, the leader of a process group of its own: the step and
# whatever it starts (pip's build hooks, ``compileall -j 0``'s workers) are in that group. The
# guard asks the kernel for SIGTERM when its parent thread (the server's build thread) dies, however
# the server stops (SIGKILL included), and then kills the whole group; a server that closes kills
# the group itself. Before, the server killed only the step, and its children lived on, orphaned.
_GUARD = """
import ctypes, os, signal, sys
def kill_group(*_):
    os.killpg(0, signal.SIGKILL)
def kill_the_others():
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if os.getpgid(int(entry)) == os.getpid():
                    os.kill(int(entry), signal.SIGKILL)
            except OSError:
                pass
signal.signal(signal.SIGTERM, kill_group)
ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):  # the server died before the line above
    kill_group()
pid = os.fork()
if pid == 0:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        os.execvp(sys.argv[2], sys.argv[2:])
    finally:
        os._exit(127)
status = os.waitpid(pid, 0)[1]
kill_the_others()  # what the step left running
sys.exit(os.waitstatus_to_exitcode(status) % 256)
"""

Progress = Callable[[str], None]


class TemplateBuildError(PandaStackLocalError, RuntimeError):
    """A template whose environment cannot be built: the message names the line or package."""


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pandastack-local"


# ---- requirements ---------------------------------------------------------------------------
_NAME_RE = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
_DEB_RE = re.compile(r"^[a-z0-9][a-z0-9+.-]+$")


def parse_requirements(lines: Iterable[str], source: str) -> tuple[str, ...]:
    """Validate requirement lines (PEP 508). Options (``-r``, ``--index-url``, ...) are refused:
    where packages come from is the machine's pip configuration, never the template's."""
    from packaging.requirements import InvalidRequirement, Requirement

    out: list[str] = []
    for number, raw in enumerate(lines, start=1):
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("-"):
            raise TemplateBuildError(
                f"{source} line {number}: {line!r}: pip options are not supported in a template "
                "(the machine's pip configuration decides the package index); list one package per line"
            )
        try:
            Requirement(line)
        except InvalidRequirement as exc:
            raise TemplateBuildError(f"{source} line {number}: {line!r}: {exc}") from None
        out.append(line)
    return tuple(out)


def parse_debs(lines: Iterable[str], source: str) -> tuple[str, ...]:
    out: list[str] = []
    for number, raw in enumerate(lines, start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if not _DEB_RE.match(line):
            raise TemplateBuildError(f"{source} line {number}: {line!r}: not a Debian package name")
        out.append(line)
    return tuple(out)


# ---- the built environment ------------------------------------------------------------------
def guest_python_version() -> str:
    out = subprocess.run(
        [GUEST_PYTHON, "-c", "import sys; print(sys.version)"], capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def env_key(requirements: tuple[str, ...], debs: tuple[str, ...], python_version: str) -> str:
    spec = {"format": BUILD_FORMAT, "python": python_version, "requirements": requirements, "debs": debs}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def env_dir(cache_dir: Path, name: str, key: str) -> Path:
    return Path(cache_dir) / "templates" / f"{name}-{key}"


def is_built(directory: Path) -> bool:
    return (directory / MARKER).is_file()


def guest_args(directory: Path, extra_env: dict[str, str], base_path: str = BASE_PATH) -> list[str]:
    """bwrap arguments that show a built environment to a sandbox (read-only) and put it first on PATH."""
    args = ["--ro-bind", str(directory / "venv"), GUEST_ENV_DIR]
    path = [f"{GUEST_ENV_DIR}/bin"]
    env = {"VIRTUAL_ENV": GUEST_ENV_DIR, **extra_env}
    if (directory / "root").is_dir():
        args += ["--ro-bind", str(directory / "root"), GUEST_DEB_ROOT]
        path.append(f"{GUEST_DEB_ROOT}/usr/bin")
        env["LD_LIBRARY_PATH"] = f"{GUEST_DEB_ROOT}/usr/lib/x86_64-linux-gnu:{GUEST_DEB_ROOT}/usr/lib"
    mpl = directory / "mplcache"
    if mpl.is_dir():
        for cache in sorted(mpl.glob("fontlist-*.json")):
            args += ["--ro-bind", str(cache), f"{GUEST_MPL_CACHE}/{cache.name}"]
    env["PATH"] = ":".join([*path, base_path])
    for key, value in env.items():
        args += ["--setenv", key, value]
    return args


# ---- building -------------------------------------------------------------------------------
def build(
    name: str,
    requirements: tuple[str, ...],
    debs: tuple[str, ...],
    cache_dir: Path,
    progress: Progress,
    verify: tuple[str, ...] = (),
) -> Path:
    """Build (or find) the environment and return its directory. Safe to call from many processes."""
    key = env_key(requirements, debs, guest_python_version())
    final = env_dir(cache_dir, name, key)
    if is_built(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f"{final.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress(f"template {name}: another process is building it, waiting")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if is_built(final):
            return final
        for stale in final.parent.glob(f"{final.name}.tmp-*"):  # a build killed midway; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
        tmp.mkdir()
        started = time.monotonic()
        try:
            _build_into(tmp, name, requirements, debs, progress, verify)
            (tmp / MARKER).write_text(
                json.dumps({"name": name, "key": key, "requirements": requirements, "debs": debs}, indent=1)
            )
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        progress(f"template {name}: built in {time.monotonic() - started:.0f}s ({final})")
        return final


def _build_into(
    tmp: Path,
    name: str,
    requirements: tuple[str, ...],
    debs: tuple[str, ...],
    progress: Progress,
    verify: tuple[str, ...],
) -> None:
    venv = tmp / "venv"
    progress(f"template {name}: creating the environment on {GUEST_PYTHON}")
    _run([GUEST_PYTHON, "-m", "venv", "--without-pip", str(venv)], name, progress)
    if debs:
        _install_debs(tmp, name, debs, progress)
    if requirements:
        (tmp / "requirements.txt").write_text("\n".join(requirements) + "\n")
        progress(f"template {name}: pip install {len(requirements)} requirement(s): {' '.join(requirements)}")
        pip = [
            sys.executable,
            "-m",
            "pip",
            "--disable-pip-version-check",
            "--python",
            str(venv / "bin/python"),
        ]
        _run(
            [*pip, "install", "--no-compile", "--progress-bar", "off", "-r", str(tmp / "requirements.txt")],
            name,
            progress,
            requirements,
        )
    _relocate(venv, progress, name)
    if verify:
        progress(f"template {name}: checking imports: {', '.join(verify)}")
        for module in verify:
            _run([str(venv / "bin/python"), "-c", f"import {module}"], name, progress, (module,))
    _font_cache(tmp, venv, name, progress)


def _run(
    argv: list[str], name: str, progress: Progress, suspects: tuple[str, ...] = (), cwd: Path | None = None
) -> None:
    """Run a build step, streaming its output as progress; on failure name the package that failed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    tail: list[str] = []
    with subprocess.Popen(
        _guarded(argv),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=cwd,
        start_new_session=True,
    ) as proc:
        assert proc.stdout is not None
        _RUNNING.add(proc)
        try:
            _stream(proc.stdout, name, progress, tail)
        finally:
            _RUNNING.discard(proc)
    if proc.returncode != 0:
        raise TemplateBuildError(_failure_message(name, argv, tail, suspects))


def _guarded(argv: list[str]) -> list[str]:
    """``argv`` run by the group's guard (``_GUARD``): it dies with this process, and so does the step."""
    return [sys.executable, "-I", "-c", _GUARD, str(os.getpid()), *argv]


def _kill(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL a build step's whole process group (the guard, the step and all it started)."""
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)


def _stream(out: Iterable[str], name: str, progress: Progress, tail: list[str]) -> None:
    for line in out:
        line = line.rstrip()
        if not line or "is ignored: it is neither a file nor a directory" in line:
            continue
        progress(f"template {name}: {line}")
        tail.append(line)
        del tail[:-ERROR_TAIL_LINES]


def _failure_message(name: str, argv: list[str], tail: list[str], suspects: tuple[str, ...]) -> str:
    text = "\n".join(tail)
    errors = [line for line in tail if line.startswith(("ERROR", "E:", "error", "ModuleNotFoundError"))]
    culprit = next((s for s in suspects if _mentions(text, s)), None)
    what = f"package {culprit!r} failed" if culprit else f"{Path(argv[0]).name} {' '.join(argv[1:3])} failed"
    detail = "; ".join(errors) if errors else (tail[-1] if tail else "no output")
    return f"template {name!r}: build failed: {what}: {detail}"


def _mentions(text: str, requirement: str) -> bool:
    match = _NAME_RE.match(requirement)
    if not match:
        return False
    names = {match.group(1).lower(), match.group(1).lower().replace("-", "_"), requirement.lower()}
    lowered = text.lower()
    return any(re.search(rf"(?<![\w.-]){re.escape(n)}(?![\w-])", lowered) for n in names)


def _install_debs(tmp: Path, name: str, debs: tuple[str, ...], progress: Progress) -> None:
    """Unpack Debian packages (downloaded with apt, not installed on the host) into the env's root."""
    download = tmp / "debs"
    download.mkdir()
    for package in debs:
        progress(f"template {name}: apt-get download {package}")
        _run(["apt-get", "download", "-q", package], name, progress, (package,), cwd=download)
    for deb in sorted(download.glob("*.deb")):
        _run(["dpkg-deb", "-x", str(deb), str(tmp / "root")], name, progress)
    shutil.rmtree(download)


def _relocate(venv: Path, progress: Progress, name: str) -> None:
    """Point the environment's self-references at the guest path, then byte-compile it there."""
    host = str(venv)
    for script in (venv / "bin").iterdir():
        if script.is_symlink() or not script.is_file():
            continue
        with contextlib.suppress(UnicodeDecodeError, OSError):
            text = script.read_text()
            if (text.startswith("#!") and host in text.split("\n", 1)[0]) or f"'''exec' {host}" in text:
                script.write_text(text.replace(host, GUEST_ENV_DIR))
    cfg = venv / "pyvenv.cfg"
    cfg.write_text(cfg.read_text().replace(host, GUEST_ENV_DIR))
    progress(f"template {name}: byte-compiling for {GUEST_ENV_DIR}")
    compile_to_guest = ["-m", "compileall", "-q", "-j", "0", "-s", host, "-p", GUEST_ENV_DIR]
    _run(
        [str(venv / "bin/python"), *compile_to_guest, str(venv / "lib")],
        name,
        progress,
    )


def _font_cache(tmp: Path, venv: Path, name: str, progress: Progress) -> None:
    probe = subprocess.run(
        _guarded([str(venv / "bin/python"), "-c", "import matplotlib"]),
        capture_output=True,
        start_new_session=True,
    )
    if probe.returncode != 0:
        return
    progress(f"template {name}: building matplotlib's font cache")
    cache = tmp / "mplcache"
    cache.mkdir()
    subprocess.run(
        _guarded([str(venv / "bin/python"), "-c", "import matplotlib.font_manager"]),
        env={"PATH": BASE_PATH, "MPLCONFIGDIR": str(cache), "HOME": str(tmp)},
        start_new_session=True,
        check=True,
        capture_output=True,
    )
    for fontlist in cache.glob("fontlist-*.json"):
        fontlist.write_text(fontlist.read_text().replace(str(venv), GUEST_ENV_DIR))


# ---- the server's side: build in the background, serve the other templates meanwhile --------
class TemplateNotReady(PandaStackLocalError, RuntimeError):
    """The template's environment is still being built."""


class Builds:
    """Background builds for a server: one per template needing one, started when first needed.

    A built template replaces its entry in ``templates`` (``built`` set); a failed one keeps
    its error, which every create of that template reports; the other templates are unaffected.
    """

    def __init__(self, templates: dict[str, Any], cache_dir: Path, log: Progress) -> None:
        self.templates = templates
        self.cache_dir = cache_dir
        self.log = log
        self.errors: dict[str, str] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}

    async def _build(self, name: str) -> None:
        template = self.templates[name]
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Path | None] = loop.create_future()

        def settle(path: Path | None, exc: BaseException | None) -> None:
            if not done.done():
                done.set_result(path) if exc is None else done.set_exception(exc)

        def work() -> None:  # a daemon thread: a stopping server does not wait for pip
            try:
                path = build(
                    name, template.requirements, template.debs, self.cache_dir, self.log, template.verify
                )
            except Exception as exc:  # noqa: BLE001  reported through the future
                loop.call_soon_threadsafe(settle, None, exc)
            else:
                loop.call_soon_threadsafe(settle, path, None)

        threading.Thread(target=work, name=f"build-{name}", daemon=True).start()
        try:
            built = await done
        except Exception as exc:  # noqa: BLE001  any failure makes this one template unavailable
            self.errors[name] = str(exc)
            self.log(f"template {name}: NOT available: {exc}")
            return
        self.templates[name] = dataclasses.replace(template, built=built)

    async def ready(self, name: str, wait: float | None) -> Any:
        """The template, built; waits up to ``wait`` seconds (None: for as long as the build takes).
        The first call starts the build (the warm pool's refill at server start, else a create)."""
        template = self.templates[name]
        if template.needs_build and template.built is None and name not in self.tasks:
            self.tasks[name] = asyncio.create_task(self._build(name))
        task = self.tasks.get(name)
        if task is not None and not task.done():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(task), wait)
            if not task.done():
                # Worded as a capacity refusal (503 + Retry-After): clients wait and resend.
                raise TemplateNotReady(
                    f"no compute capacity available: template {name!r} is still being built (server log; "
                    "`pandastack-local templates build` builds ahead of time)"
                )
        if name in self.errors:
            raise TemplateBuildError(self.errors[name])
        return self.templates[name]

    def state(self, name: str) -> str:
        if name in self.errors:
            return "failed"
        task = self.tasks.get(name)
        return "building" if task is not None and not task.done() else "ready"

    async def close(self) -> None:
        for task in self.tasks.values():
            task.cancel()
        for proc in list(_RUNNING):
            _kill(proc)
