"""Warm starts: a pool of standby sandboxes whose interpreter has already imported the engine.

Under the default bwrap backend a fork copies only the disk, so a warm parent cannot hand its
memory to a child. Instead each *standby* is a fresh sandbox in which a provider-owned runner
(``guest_scripts/warm_runner.py``) has imported :attr:`WarmStart.modules` (the engine's, never
tenant code) and blocks in ``accept()`` on a unix socket. A standby is handed to exactly one job
and deleted with it, so every try still gets a sandbox no other try touched. The job's command
is :meth:`Standby.command`: ``warm_attach.py`` passes the cold argv, env, cwd and fds 0-2 to the
runner, whose fork runs the job; with no runner it execs the cold argv itself. The lifecycle of
the job is :class:`~.lifecycle.JobRun`'s (``run_job(..., standby=...)``); this module only makes,
keeps and hands out standbys.

TTL on this API is an idle timeout, so a waiting standby gets a short one (``idle_ttl``) that the
pool refreshes, and the job's own TTL when it is taken. Standbys carry the metadata
``{"pandastack.standby": <key>}`` so sweeps can tell them from tries.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shlex
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from types import MappingProxyType
from typing import Any

import pandastack
from pandastack import Sandbox

from . import guest
from .execstream import exec_stream
from .failures import StepError
from .lifecycle import JobHandle, JobRun, OutputTail
from .outcome import FailureKind
from .reaper import delete_sandbox
from .redact import Redactor
from .spec import WORKDIR, JobSpec

logger = logging.getLogger(__name__)

WARM_DIR = f"{WORKDIR}/.warm"
RUNNER_PATH = f"{WARM_DIR}/warm_runner.py"
ATTACH_PATH = f"{WARM_DIR}/warm_attach.py"
SOCKET_PATH = f"{WARM_DIR}/runner.sock"
STATE_PATH = f"{WARM_DIR}/state"
PID_PATH = f"{WARM_DIR}/runner.pid"
LOG_PATH = f"{WARM_DIR}/runner.log"
STANDBY_LABEL = "pandastack.standby"
# The runner's ready/failed state is a small JSON document; anything larger is not ours.
MAX_STATE_BYTES = 8192
DEFAULT_READY_TIMEOUT = 120.0
DEFAULT_RUNNER_IDLE = 3600
LAUNCH_TIMEOUT = 30  # the exec that starts the runner in the background returns at once
CHECK_TIMEOUT = 15
MAX_BACKOFF_SECONDS = 60.0
# A refill starts this long after the last take (debounced): making a standby costs an engine
# import (about a second of CPU), which would otherwise compete with the try just handed out.
DEFAULT_REFILL_DELAY = 2.0


def guest_script(name: str) -> bytes:
    """The bytes of a guest script shipped as package data (``warm_runner.py``, ``warm_attach.py``)."""
    return resources.files("pandastack_jobs").joinpath("guest_scripts", name).read_bytes()


def _freeze(value: Mapping[str, Any] | None, name: str) -> Mapping[str, Any]:
    out = dict(value or {})
    for k, v in out.items():
        if not isinstance(k, str) or not isinstance(v, (str, bytes)):
            raise TypeError(f"WarmStart.{name}: keys must be str and values str/bytes, got {k!r}")
    return MappingProxyType(out)


@dataclass(frozen=True)
class WarmStart:
    """What a standby is warmed with: the template, the interpreter and the modules it imports.

    ``env`` is the environment the modules are imported under (the runner's); a job may use a
    standby only when the adapter's key matches, and the runner itself refuses (runs the job
    cold) when a ``PYTHON*`` variable of the job differs from the runner's. ``files`` (guest path
    -> content) are written before the runner starts, e.g. a module it imports.
    ``optional_modules`` are imported after ``modules`` when the environment has them (modules
    every job imports later, which not every engine version has): one missing is skipped, never a
    failed standby.
    """

    template: str
    python: str = "python3"
    modules: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict, hash=False)
    files: Mapping[str, str | bytes] = field(default_factory=dict, hash=False)
    optional_modules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "modules", tuple(self.modules))
        object.__setattr__(self, "optional_modules", tuple(self.optional_modules))
        object.__setattr__(self, "env", _freeze(self.env, "env"))
        object.__setattr__(self, "files", _freeze(self.files, "files"))
        for name in (*self.modules, *self.optional_modules):
            if not isinstance(name, str) or not name or name.startswith("-"):
                raise ValueError(f"WarmStart.modules: {name!r} is not a module name")

    def key(self) -> str:
        """A stable short hash of every field and of the guest scripts (the metadata label)."""
        digest = hashlib.sha256()
        files = {
            path: hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()
            for path, data in sorted(self.files.items())
        }
        doc = {
            "template": self.template,
            "python": self.python,
            "modules": list(self.modules),
            "optional_modules": list(self.optional_modules),
            "env": dict(sorted(self.env.items())),
            "files": files,
            "runner": hashlib.sha256(guest_script("warm_runner.py")).hexdigest(),
            "attach": hashlib.sha256(guest_script("warm_attach.py")).hexdigest(),
        }
        digest.update(json.dumps(doc, sort_keys=True).encode())
        return digest.hexdigest()[:16]


@dataclass(frozen=True)
class Standby:
    """A ready standby sandbox, handed to exactly one job (``run_job(..., standby=...)``)."""

    sandbox_id: str
    warm: WarmStart

    def command(self, argv: Sequence[str]) -> str:
        """The shell line that runs ``argv`` (the cold argv, ``python3 -m MODULE ...``) in this
        standby's warm interpreter; cold in the same sandbox if the runner is gone."""
        if not argv:
            raise ValueError("argv: give the job's cold argv, e.g. ['python3', '-m', 'mod']")
        return shlex.join([self.warm.python, "-I", "-S", ATTACH_PATH, *argv])


def launch_command(warm: WarmStart, idle_seconds: int) -> str:
    """The exec line that starts the runner in the background, detached as a detached job is.

    If the runner dies before it says ready (no interpreter, say), the shell writes the state.
    """
    optional = [arg for name in warm.optional_modules for arg in ("--optional", name)]
    argv = [warm.python, RUNNER_PATH, "--idle", str(idle_seconds), *warm.modules, *optional]
    fail = shlex.quote(json.dumps({"ready": False, "error": "runner exited %s"}))
    inner = (
        f"{shlex.join(argv)}; rc=$?; [ -e {STATE_PATH} ] || "
        f"{{ printf {fail} $rc > {STATE_PATH}.tmp && mv {STATE_PATH}.tmp {STATE_PATH}; }}"
    )
    assigns = guest.env_assignments(warm.env)
    return guest.background_command(
        inner, directory=WARM_DIR, env_prefix=assigns, stdout=LOG_PATH, stderr=LOG_PATH
    )


CHECK_COMMAND = f'[ -S {SOCKET_PATH} ] && kill -0 "$(cat {PID_PATH})" 2>/dev/null'


class StandbyPool:
    """Keeps ``size`` READY standbys of one :class:`WarmStart`; ``take()`` hands one out.

    ``start()`` runs a background thread that fills the pool (``fill_concurrency`` creates at a
    time, backing off after failures), refreshes the idle TTL of waiting standbys and replaces any
    that died. ``take()`` never blocks on the server: None when none is ready (the caller goes
    cold). ``close()`` stops filling and deletes every untaken standby.
    """

    def __init__(
        self,
        client_factory: Callable[[], pandastack.Client],
        warm: WarmStart,
        *,
        size: int,
        metadata: Mapping[str, str] | None = None,
        idle_ttl: int = 120,
        fill_concurrency: int = 1,
        redactor: Redactor | None = None,
        ready_timeout: float = DEFAULT_READY_TIMEOUT,
        runner_idle_seconds: int = DEFAULT_RUNNER_IDLE,
        refresh_seconds: float | None = None,
        refill_delay: float = DEFAULT_REFILL_DELAY,
    ) -> None:
        if size < 0 or fill_concurrency < 1 or idle_ttl < 10 or refill_delay < 0:
            raise ValueError(
                "StandbyPool: size >= 0, fill_concurrency >= 1, idle_ttl >= 10 seconds, refill_delay >= 0"
            )
        self.client_factory = client_factory
        self.warm = warm
        self.size = size
        self.metadata = dict(metadata or {})
        self.idle_ttl = idle_ttl
        self.fill_concurrency = fill_concurrency
        self.redactor = redactor or Redactor()
        self.ready_timeout = ready_timeout
        self.runner_idle_seconds = runner_idle_seconds
        self.refresh_seconds = refresh_seconds if refresh_seconds is not None else max(1.0, idle_ttl / 4)
        """How often a waiting standby is checked (its idle TTL refreshed): well inside ``idle_ttl``."""
        self.refill_delay = refill_delay
        """Seconds after the last take before refilling (each take restarts it): the try just
        handed out gets the CPU that a standby's engine import would otherwise take from it."""
        self.key = warm.key()
        self.failures = 0
        """Consecutive failed fills (reset by a success): the back-off's exponent."""
        self.last_error: str | None = None
        self._lock = threading.Condition()
        self._ready: deque[tuple[str, float]] = deque()  # (sandbox id, last refresh, monotonic)
        self._filling: dict[int, JobHandle] = {}
        self._fillers: list[threading.Thread] = []
        self._thread: threading.Thread | None = None
        self._closed = False
        self._client: pandastack.Client | None = None
        self._next_fill = 0.0
        self._refill_at = 0.0  # monotonic: no fill starts before (set by take, debounced)

    # -- the API ---------------------------------------------------------------------------------

    def start(self) -> StandbyPool:
        """Start the background thread that keeps the pool full (idempotent)."""
        with self._lock:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._maintain, name="standby-pool", daemon=True)
                self._thread.start()
        return self

    def take(self) -> Standby | None:
        """A ready standby, removed from the pool; None when none is ready.

        The refill starts ``refill_delay`` seconds after the last take."""
        with self._lock:
            if self._closed or not self._ready:
                return None
            sandbox_id, _ = self._ready.popleft()
            self._refill_at = time.monotonic() + self.refill_delay
            self._lock.notify_all()
        return Standby(sandbox_id, self.warm)

    @property
    def ready(self) -> int:
        """How many standbys are ready to take now."""
        with self._lock:
            return len(self._ready)

    def waiting(self) -> list[str]:
        """The sandbox ids of the ready standbys, oldest first (for logs and sweeps)."""
        with self._lock:
            return [sid for sid, _ in self._ready]

    def close(self, timeout: float = 30.0) -> None:
        """Stop filling, cancel fills under way and delete every untaken standby (idempotent)."""
        with self._lock:
            self._closed = True
            ready = [sid for sid, _ in self._ready]
            self._ready.clear()
            filling = list(self._filling.values())
            self._lock.notify_all()
        for handle in filling:
            handle.cancel()
        deadline = time.monotonic() + timeout
        for thread in [self._thread, *self._fillers]:
            if thread is not None and thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
        if ready:
            client = self._client or self.client_factory()
            for sandbox_id in ready:
                delete_sandbox(client, sandbox_id)

    def __enter__(self) -> StandbyPool:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- making one standby ----------------------------------------------------------------------

    def standby_spec(self) -> JobSpec:
        """The spec a standby is made with: the runner, the attach and the warm files, the idle TTL."""
        files: dict[str, str | bytes] = {
            RUNNER_PATH: guest_script("warm_runner.py"),
            ATTACH_PATH: guest_script("warm_attach.py"),
            **self.warm.files,
        }
        return JobSpec(
            command=launch_command(self.warm, self.runner_idle_seconds),
            files=files,
            template=self.warm.template,
            result_path=None,
            timeout=float(min(LAUNCH_TIMEOUT, self.idle_ttl)),
            ttl=self.idle_ttl,
            metadata={**self.metadata, STANDBY_LABEL: self.key},
        )

    def make_standby(self, client: pandastack.Client, handle: JobHandle | None = None) -> str:
        """Create one standby and wait until its runner is ready; its sandbox id.

        Raises :class:`StepError` naming why (the sandbox is deleted then)."""
        spec = self.standby_spec()
        run = JobRun(client, spec, handle=handle, redactor=self.redactor, keep_on_success=True)

        def launch(sb: Sandbox) -> tuple[int, float]:
            started = time.monotonic()
            err = OutputTail(2048)
            code = exec_stream(
                sb, spec.command, on_stderr=err.add, on_stdout=err.add, timeout_seconds=LAUNCH_TIMEOUT
            )
            if code != 0:
                raise StepError(FailureKind.EXIT_CODE, f"runner launch exited {code}: {err.text()[-500:]}")
            self._await_ready(sb, run)
            return 0, time.monotonic() - started

        outcome = run.run(execute=launch, collect=False)
        if not outcome.ok:
            raise StepError(outcome.kind or FailureKind.SERVER_ERROR, outcome.reason)
        assert outcome.sandbox_id is not None
        return outcome.sandbox_id

    def _await_ready(self, sb: Sandbox, run: JobRun) -> dict[str, Any]:
        """Stat the runner's state file until it appears (bounded: a deadline, growing gaps)."""
        deadline = time.monotonic() + self.ready_timeout
        gap = 0.01
        while True:
            if run.handle.cancelled:
                raise StepError(FailureKind.CANCELLED, "the pool closed while the standby started")
            try:
                sb.filesystem.stat(STATE_PATH)
            except pandastack.NotFoundError as exc:
                if "file does not exist" not in str(exc).lower():
                    raise
            else:
                raw = run._read_capped(sb, STATE_PATH, MAX_STATE_BYTES, "runner state")
                try:
                    state = json.loads(raw.decode("utf-8"))
                except (UnicodeDecodeError, ValueError):
                    state = {"ready": False, "error": "unreadable runner state"}
                if not isinstance(state, dict) or state.get("ready") is not True:
                    error = state.get("error") if isinstance(state, dict) else None
                    raise StepError(FailureKind.EXIT_CODE, f"warm runner did not start: {error}")
                return state
            if time.monotonic() + gap > deadline:
                raise StepError(FailureKind.TIMEOUT, f"warm runner not ready after {self.ready_timeout:g}s")
            time.sleep(gap)
            gap = min(gap * 2, 0.2)

    def check(self, client: pandastack.Client, sandbox_id: str) -> bool | None:
        """Refresh a waiting standby's idle TTL and see that its runner lives.

        True: alive; False: dead or gone (to replace); None: the server could not be asked."""
        sb = Sandbox.from_dict({"id": sandbox_id}, client=client)
        try:
            code = exec_stream(sb, CHECK_COMMAND, timeout_seconds=CHECK_TIMEOUT)
        except pandastack.NotFoundError:
            return False
        except (pandastack.PandastackError, OSError) as exc:
            logger.warning("could not check standby %s: %s", sandbox_id, self.redactor(str(exc)))
            return None
        return code == 0

    # -- the background thread -------------------------------------------------------------------

    def _maintain(self) -> None:
        self._client = self.client_factory()
        period = self.refresh_seconds
        while True:
            with self._lock:
                if self._closed:
                    return
                self._start_fills()
                now = time.monotonic()
                due = [sid for sid, at in self._ready if now - at >= period]
                if not due:
                    wake = min((period - (now - at) for _, at in self._ready), default=period)
                    if len(self._ready) + len(self._filling) < self.size:
                        wake = min(wake, max(self._next_fill, self._refill_at) - now)
                    self._lock.wait(timeout=max(0.05, wake))
                    continue
            for sandbox_id in due:
                try:
                    self._refresh(sandbox_id)
                except Exception as exc:  # noqa: BLE001 - the pool's thread must outlive any one check
                    logger.warning("standby %s check failed: %s", sandbox_id, self.redactor(str(exc)))
                    with self._lock:  # checked (if not well): not due again at once
                        self._ready = deque(
                            (s, time.monotonic() if s == sandbox_id else at) for s, at in self._ready
                        )

    def _refresh(self, sandbox_id: str) -> None:
        assert self._client is not None
        alive = self.check(self._client, sandbox_id)
        with self._lock:
            entry = next((e for e in self._ready if e[0] == sandbox_id), None)
            if entry is None:
                return  # taken meanwhile: the job owns it now
            self._ready.remove(entry)
            if alive is not False:
                self._ready.append((sandbox_id, time.monotonic()))
                return
        logger.info("standby %s died; replacing it", sandbox_id)
        delete_sandbox(self._client, sandbox_id)

    def _start_fills(self) -> None:
        """Under the lock: start fills until ready + filling reaches size (back-off and the
        refill delay permitting)."""
        self._fillers = [t for t in self._fillers if t.is_alive()]
        while (
            len(self._ready) + len(self._filling) < self.size
            and len(self._filling) < self.fill_concurrency
            and time.monotonic() >= max(self._next_fill, self._refill_at)
        ):
            handle = JobHandle()
            thread = threading.Thread(target=self._fill, args=(handle,), name="standby-fill", daemon=True)
            self._filling[id(handle)] = handle
            self._fillers.append(thread)
            thread.start()

    def _fill(self, handle: JobHandle) -> None:
        sandbox_id: str | None = None
        error: str | None
        try:
            sandbox_id = self.make_standby(self.client_factory(), handle)
        except StepError as exc:
            error = self.redactor(exc.reason)
        except Exception as exc:  # noqa: BLE001 - a fill must never kill the pool's thread
            error = self.redactor(f"{type(exc).__name__}: {exc}")
        else:
            error = None
        stale: str | None = None
        with self._lock:
            self._filling.pop(id(handle), None)
            if sandbox_id is not None and not self._closed:
                self._ready.append((sandbox_id, time.monotonic()))
                self.failures = 0
            elif sandbox_id is not None:
                stale = sandbox_id
            if error is not None and not self._closed:
                self.failures += 1
                self.last_error = error
                backoff = min(MAX_BACKOFF_SECONDS, 0.5 * 2 ** min(self.failures, 10))
                self._next_fill = time.monotonic() + backoff
                logger.warning("standby start failed (%d in a row): %s", self.failures, error)
            self._lock.notify_all()
        if stale is not None:
            delete_sandbox(self.client_factory(), stale)
