"""LocalServer: run pandastack-local as a real subprocess on a free loopback port.

A separate process (not a thread) so that crash and restart tests are real: a
SIGKILLed server takes its sandboxes with it (bwrap --die-with-parent) and the
next start on the same state dir reaps what was left.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from pandastack_local.config import API_KEY_ENV, generate_api_key
from pandastack_local.templates.build import default_cache_dir

START_TIMEOUT_SECONDS = 30.0
# Modes ``_grant_access`` changed, shared by every LocalServer of this process: {path: [old mode, users]}.
_GRANTED: dict[Path, list[int]] = {}
SERVER_USER_ENV = "PANDASTACK_LOCAL_SERVER_USER"
# The default isolation backend of LocalServer (the test suites' one switch): bwrap or gvisor.
ISOLATION_ENV = "PANDASTACK_LOCAL_ISOLATION"
RUNSC_ENV = "PANDASTACK_LOCAL_RUNSC"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _primary_group(user: str) -> int:
    import pwd

    return pwd.getpwnam(user).pw_gid


class LocalServer:
    """Context manager around a ``pandastack-local serve`` subprocess."""

    def __init__(
        self,
        api_key: str | None = None,
        max_sandboxes: int | None = None,
        ttl_scan_interval: float | None = None,
        template_dirs: tuple[str, ...] | list[str] = (),
        state_dir: str | os.PathLike[str] | None = None,
        memory_budget_mb: int | None = None,
        admission: str | None = None,
        pool_size: int | None = None,
        allow_egress: tuple[str, ...] | list[str] = (),
        user: str | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        isolation: str | None = None,
        runsc: str | None = None,
        extra_args: tuple[str, ...] | list[str] = (),
    ) -> None:
        """``user``: run the server as this unprivileged host user (the caller must be root; the
        test harness's non-root leg). Default: ``$PANDASTACK_LOCAL_SERVER_USER``, else the caller.
        ``isolation``: "bwrap" or "gvisor" (default ``$PANDASTACK_LOCAL_ISOLATION``, else bwrap);
        ``runsc``: gVisor's runsc (default ``$PANDASTACK_LOCAL_RUNSC``, else runsc on PATH)."""
        self.isolation = isolation or os.environ.get(ISOLATION_ENV) or "bwrap"
        self.runsc = runsc or os.environ.get(RUNSC_ENV) or None
        self.api_key = api_key or generate_api_key()
        self.max_sandboxes = max_sandboxes
        self.ttl_scan_interval = ttl_scan_interval
        self.template_dirs = tuple(str(d) for d in template_dirs)
        self.memory_budget_mb = memory_budget_mb
        self.admission = admission
        self.pool_size = pool_size
        self._granted: list[Path] = []
        self.user = user or os.environ.get(SERVER_USER_ENV) or None
        self.allow_egress = tuple(allow_egress)
        self.extra_args = tuple(extra_args)  # more `serve` flags (e.g. --metrics-without-key)
        # Built templates: the caller's cache, also for a server run as another user (it only reads).
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self._own_state_dir = state_dir is None
        self.state_dir = Path(state_dir) if state_dir else Path(tempfile.mkdtemp(prefix="pandastack-local-"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.state_dir / "server.log"
        self._proc: subprocess.Popen[bytes] | None = None

    # ---- process control -------------------------------------------------------
    def _argv(self) -> list[str]:
        argv = [sys.executable, "-m", "pandastack_local", "serve", "--host", "127.0.0.1"]
        argv += ["--port", str(self.port), "--state-dir", str(self.state_dir)]
        if self.max_sandboxes is not None:
            argv += ["--max-sandboxes", str(self.max_sandboxes)]
        if self.ttl_scan_interval is not None:
            argv += ["--ttl-scan-interval", str(self.ttl_scan_interval)]
        if self.memory_budget_mb is not None:
            argv += ["--memory-budget-mb", str(self.memory_budget_mb)]
        if self.admission is not None:
            argv += ["--admission", self.admission]
        if self.pool_size is not None:
            argv += ["--pool-size", str(self.pool_size)]
        argv += ["--cache-dir", str(self.cache_dir), "--isolation", self.isolation]
        if self.runsc:
            argv += ["--runsc", self.runsc]
        for directory in self.template_dirs:
            argv += ["--template-dir", directory]
        for endpoint in self.allow_egress:
            argv += ["--allow-egress", endpoint]
        return argv + list(self.extra_args)

    def start(self) -> LocalServer:
        if self._proc is not None and self._proc.poll() is None:
            return self
        self.state_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env[API_KEY_ENV] = self.api_key  # not on the command line, where `ps` would show it
        as_user: dict[str, Any] = {}
        if self.user:
            as_user = {"user": self.user, "group": _primary_group(self.user), "extra_groups": []}
            self._grant_access()
            env["HOME"] = str(self.state_dir)
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                self._argv(),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                **as_user,
            )
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"pandastack-local exited with {self._proc.returncode}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/healthz", timeout=1) as resp:  # noqa: S310
                    if resp.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(
            f"pandastack-local did not become healthy in {START_TIMEOUT_SECONDS}s:\n{self.log_tail()}"
        )

    def _grant_access(self) -> None:
        """Let ``self.user`` reach what it needs: own the state dir; traverse (o+x, never list) the
        parents of the state dir, the template dirs, the interpreter (venv and base) and this package;
        read the template dirs. Every mode changed here is put back by ``close()`` (once the last
        server of this process that needed it is closed), so a test run leaves the host's
        directories (``/root`` for a pyenv interpreter) as it found them."""
        import pwd

        entry = pwd.getpwnam(str(self.user))
        # Iteratively, links not followed, and not into what the user owns already (a restart:
        # the server's own files, whatever its sandboxes left there).
        todo = [self.state_dir]
        while todo:
            path = todo.pop()
            st = path.lstat()
            if st.st_uid == entry.pw_uid and path != self.state_dir:
                continue
            os.chown(path, entry.pw_uid, entry.pw_gid, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                todo.extend(path.iterdir())
        here = Path(__file__).resolve().parent
        interpreter = [Path(sys.prefix), Path(sys.base_prefix), Path(sys.executable).resolve()]
        for path in [self.state_dir, *map(Path, self.template_dirs), *interpreter, here, self.cache_dir]:
            for parent in path.resolve().parents:
                self._add_mode(parent, 0o001)
        for directory in self.template_dirs:
            for path in [Path(directory), *Path(directory).rglob("*")]:
                if not path.is_symlink():
                    self._add_mode(path, 0o005 if path.is_dir() else 0o004)

    def _add_mode(self, path: Path, bits: int) -> None:
        """chmod ``path`` to add ``bits``, remembering the old mode for ``_restore_modes``."""
        if path in _GRANTED:
            _GRANTED[path][1] += 1
        else:
            mode = stat.S_IMODE(path.stat().st_mode)
            if mode & bits == bits:
                return
            path.chmod(mode | bits)
            _GRANTED[path] = [mode, 1]
        self._granted.append(path)

    def _restore_modes(self) -> None:
        for path in reversed(self._granted):
            grant = _GRANTED.get(path)
            if grant is None:
                continue
            grant[1] -= 1
            if grant[1] == 0:
                del _GRANTED[path]
                with contextlib.suppress(OSError):
                    path.chmod(grant[0])
        self._granted.clear()

    def stop(self, graceful: bool = True) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            if graceful:
                proc.send_signal(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=15)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if proc.returncode != 0:
            self._reap()

    def kill(self) -> None:
        """SIGKILL the server, as a crash would (its sandboxes die with it)."""
        self.stop(graceful=False)

    def restart(self) -> None:
        """Crash (SIGKILL) and start again on the same port, key and state dir."""
        proc = self._proc
        self._proc = None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        self.start()

    def _reap(self) -> None:
        """After an unclean exit nobody else will remove the leftover cgroups: do it here."""
        with contextlib.suppress(Exception):
            import hashlib

            from pandastack_local.isolation.cgroups import Cgroups
            from pandastack_local.isolation.process import reap_leftovers

            instance = hashlib.sha256(str(self.state_dir.resolve()).encode()).hexdigest()[:12]
            cgroups = Cgroups.detect(instance)
            reap_leftovers(self.state_dir / "sandboxes", cgroups)
            for base in set(cgroups.bases.values()):
                with contextlib.suppress(OSError):
                    base.rmdir()

    def close(self) -> None:
        self.stop()
        self._restore_modes()
        if self._own_state_dir:
            shutil.rmtree(self.state_dir, ignore_errors=True)

    # ---- accessors -------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def env(self) -> dict[str, str]:
        return {"PANDASTACK_API": self.url, "PANDASTACK_API_KEY": self.api_key}

    def client(self, **kwargs: Any) -> Any:
        import pandastack

        kwargs.setdefault("api_url", self.url)
        kwargs.setdefault("api_key", self.api_key)
        return pandastack.Client(**kwargs)

    def delete_leftovers(self) -> list[str]:
        """Delete every sandbox the server still holds; return their ids (a test's leak check)."""
        client = self.client()
        leftovers = [sb.id for sb in client.sandboxes.list()]
        for sandbox_id in leftovers:
            client.sandboxes.delete(sandbox_id)
        return leftovers

    def wait_for_teardown(self, timeout: float = 30.0) -> None:
        """Wait until every deleted sandbox is removed from the host (DELETE answers once the
        sandbox is stopped; its cgroups and host dir go in the background: docs/local-server.md)."""
        deadline = time.monotonic() + timeout
        while True:
            with urllib.request.urlopen(f"{self.url}/healthz", timeout=5) as resp:  # noqa: S310
                if not json.loads(resp.read(65536)).get("tearing_down"):
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"deleted sandboxes were still being removed after {timeout}s")
            time.sleep(0.01)

    def uid(self) -> int | None:
        """The host uid the server process runs as (None when it is not running)."""
        if self._proc is None:
            return None
        try:
            return os.stat(f"/proc/{self._proc.pid}").st_uid
        except OSError:
            return None

    def active_limits(self) -> set[str]:
        """The cgroup limits the server logged as active at start-up (empty: none)."""
        for line in self.log_tail(400).splitlines():
            if "active limits:" in line:
                names = line.split("active limits:", 1)[1].split(";")[0]
                return {n.strip() for n in names.split(",") if n.strip() and n.strip() != "none"}
        return set()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LocalServer(url={self.url!r}, pid={self.pid})"
