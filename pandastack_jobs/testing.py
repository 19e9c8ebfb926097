"""An in-memory PandaStack for unit tests: the real SDK client with its wire faked.

:class:`FakeClient` *is* a ``pandastack.Client``; only its one HTTP method,
``Client._request``, is replaced by an in-memory server. Everything the core
touches is therefore the SDK's own code: ``client.sandboxes`` (create, get,
list, delete, fork), ``Sandbox.exec``, the exec stream (the SDK's ``exec_stream`` and the
core's :mod:`.execstream`, which raise ``ExecInterrupted`` on a stream with no exit event), ``filesystem``
(read, write, listdir, stat, with ``FileInfo`` parsing) and ``set_ttl``, and
the SDK's own error mapping (a 5xx naming a timeout becomes ``SandboxTimeout``).
A fake of the SDK's objects would drift from the SDK; a fake of its wire, as
docs/local-server.md and the local server's ``GET /openapi.json`` describe it,
cannot.

What a job does is scripted per command (:meth:`FakeClient.script`): its exit
code, output, result and files; it can run in the background (detached jobs),
block until released, hit its timeout, or lose its stream. Failures are
injected as the SDK's real exception classes (:meth:`FakeClient.fail`). A fresh job's
one exec (:func:`.guest.job_script`) is played as the guest's shell would: its ``printf``
writes land in the sandbox's files before the job runs, and on exit 0 a regular result file
comes back on stdout as the trailer (decoded as the server decodes a stream).
Nothing here opens a socket, starts a process or needs root.

    client = FakeClient()
    client.script("python3 run.py", result={"rows": 3}, stdout="done\\n")
    outcome = run_job(client, JobSpec(command="python3 run.py"))
    assert outcome.result == {"rows": 3} and client.live() == []

Differences from the real server, on purpose: no latency (the SDK's 200 ms
repeat of a 404 GET is skipped), no TTL expiry (:meth:`FakeClient.expire`
deletes a sandbox as the TTL would), and a capacity refusal is reported to
``on_create_retry`` once and then raised, as if the retry budget ran out.
"""

from __future__ import annotations

import json
import shlex
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pandastack
import requests
from pandastack import CreateRetryEvent

from . import guest
from .connection import ErrorAnswer, record_answer
from .exceptions import PandaStackJobsError

FAKE_URL = "http://pandastack.fake.invalid"
FAKE_KEY = "pds_fake0000000000000000000000000000"
DEFAULT_TEMPLATES = ("code-interpreter", "base")
DEFAULT_FAKE_TTL = 300

# The operations :meth:`FakeClient.fail` can break, and what ``match`` is matched against.
OPERATIONS = {
    "create": "template",
    "list": "",
    "get": "sandbox id",
    "delete": "sandbox id",
    "fork": "parent id",
    "set_ttl": "sandbox id",
    "exec": "command line",
    "exec_stream": "command line",
    "read": "path",
    "write": "path",
    "stat": "path",
    "listdir": "path",
    "me": "",
    "template": "template name",
}


class _NotGiven:
    def __repr__(self) -> str:
        return "NOT_GIVEN"


NOT_GIVEN: Any = _NotGiven()


@dataclass
class Script:
    """What a matching command does in the fake sandbox (see :meth:`FakeClient.script`)."""

    exit_code: int = 0
    stdout: str | list[str] = ""
    stderr: str | list[str] = ""
    result: Any = NOT_GIVEN
    """JSON written to the job's ``$JOB_RESULT`` (default: nothing written)."""
    raw_result: bytes | None = None
    """Bytes written to ``$JOB_RESULT`` as they are (invalid JSON, NaN, ...)."""
    files: Mapping[str, bytes | str] = field(default_factory=dict)
    """More files the job writes (absolute guest paths)."""
    runs_for: int = 0
    """A detached job: how many polls of its exit marker still find it running."""
    hangs: bool = False
    """The job outlives its timeout: the guest clock kills it (exit 124 at the deadline)."""
    wait: threading.Event | None = None
    """Block the exec until this event is set (or the sandbox is deleted under it)."""
    stream_ends: str | None = None
    """``"eof"``: the exec stream ends with no exit event; ``"drop"``: the connection drops."""
    action: Callable[[FakeSandbox, ExecCall], Script | None] | None = None
    """Called first with the sandbox and the call; may return another :class:`Script` to use."""


@dataclass(frozen=True)
class ExecCall:
    """One exec the fake received: the whole guest line and what the core wrapped in it."""

    sandbox_id: str
    line: str
    command: str
    """The job's own command (the innermost ``sh -c``), or the line itself."""
    env: Mapping[str, str]
    timeout: float | None
    """The guest-side clock (``timeout ... SECONDS``) the core put around it, if any."""
    timeout_seconds: int | None
    """What the server was asked for."""
    stream: bool
    detached: bool


@dataclass
class FakeSandbox:
    """One sandbox of the fake server: its files, metadata, TTL and state."""

    id: str
    template: str
    metadata: dict[str, str]
    ttl_seconds: int | None
    status: str = "running"
    files: dict[str, bytes] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)
    """Type letters of paths that are not regular files (``p`` FIFO, ``c`` device, ``d``)."""
    created_at: float = field(default_factory=time.time)
    background: list[tuple[Script, ExecCall, list[int]]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "template": self.template,
            "cpu": 2,
            "memory_mb": 2048,
            "status": self.status,
            "guest_ip": None,
            "boot_ms": 0,
            "boot_mode": "cold",
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.created_at)),
            "metadata": {k: v for k, v in self.metadata.items() if not k.startswith("secret.")},
            "from_snapshot": None,
            "persistent": False,
        }


class _Http(PandaStackJobsError):
    """An HTTP error answer of the fake server, turned into the SDK's exception by status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _sdk_error(status: int, message: str) -> pandastack.PandastackError:
    """The exception the SDK's ``_api_error`` makes of an answer with this status."""
    if status == 401:
        return pandastack.AuthError(message)
    if status == 404:
        return pandastack.NotFoundError(message)
    if 400 <= status < 500:
        return pandastack.BadRequestError(message)
    return pandastack.ServerError(message)


class _RawResponse:
    """The parts of ``requests.Response`` the SDK reads from a raw answer."""

    def __init__(self, content: bytes = b"", lines: Iterator[str] | None = None) -> None:
        self.content = content
        self.status_code = 200
        self._lines = lines

    def iter_lines(self, decode_unicode: bool = False) -> Iterator[str]:
        return self._lines if self._lines is not None else iter(())

    def iter_content(self, chunk_size: int = 1) -> Iterator[bytes]:
        """The lines as the wire's bytes (the core reads the exec stream this way)."""
        for line in self.iter_lines():
            yield f"{line}\n".encode()

    def close(self) -> None:
        return None


@dataclass
class _Failure:
    op: str
    error: BaseException
    match: Callable[[str], bool]
    times: int | None


def _matcher(match: str | Callable[[str], bool] | None) -> Callable[[str], bool]:
    if match is None:
        return lambda _text: True
    if callable(match):
        return match
    return lambda text: match in text


def _tokens(line: str) -> list[str] | None:
    try:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        return list(lexer)
    except ValueError:
        return None


def _unwrap(line: str) -> tuple[str, dict[str, str], float | None]:
    """The job's command, env and guest timeout inside a line the core built (:mod:`.guest`)."""
    tokens = _tokens(line)
    if tokens is None:
        return line, {}, None
    env: dict[str, str] = {}
    timeout: float | None = None
    if "timeout" in tokens:
        i = tokens.index("timeout")
        j = i - 1 - (i > 0 and tokens[i - 1] == "exec")  # NAME=value [exec] timeout ...
        while j >= 0 and "=" in tokens[j] and tokens[j].partition("=")[0].isidentifier():
            j -= 1  # the shell's prefix assignments: NAME=value timeout ...
        for assign in tokens[j + 1 : i]:
            if assign == "exec":
                continue
            name, _, value = assign.partition("=")
            env[name] = value
        i += 1
        while i < len(tokens) and tokens[i].startswith("-"):
            i += 2
        try:
            timeout = float(tokens[i])
        except (IndexError, ValueError):
            timeout = None
    for i in range(len(tokens) - 2, -1, -1):
        if tokens[i] == "sh" and tokens[i + 1] == "-c" and i + 2 < len(tokens):
            inner = tokens[i + 2]
            if "sh -c" in inner and "timeout" in inner:
                command, inner_env, inner_timeout = _unwrap(inner)
                return command, {**env, **inner_env}, inner_timeout or timeout
            return inner, env, timeout
    return line, env, timeout


@dataclass(frozen=True)
class _Trailer:
    """The result trailer a job line asks for (:class:`.guest.ResultTrailer`)."""

    nonce: str
    path: str
    count: int


def _folded(line: str) -> tuple[dict[str, str], _Trailer | None]:
    """The files a folded job line writes (``printf %s TEXT > PATH``) and its result trailer."""
    tokens = _tokens(line) or []
    writes: dict[str, str] = {}
    trailer: _Trailer | None = None
    for i, word in enumerate(tokens):
        if word == "printf" and tokens[i + 1 : i + 2] == ["%s"] and tokens[i + 3 : i + 4] == [">"]:
            writes[tokens[i + 4]] = tokens[i + 2]
        elif word == "dd" and trailer is None:
            args = dict(a.partition("=")[::2] for a in tokens[i + 1 : i + 6] if "=" in a)
            nonce = next((t for t in tokens[:i][::-1] if t.isalnum()), None)
            if nonce is not None and "if" in args and "count" in args:  # else a plain dd, not a trailer
                trailer = _Trailer(nonce, args["if"], int(args["count"]))
    return writes, trailer


class FakeClient(pandastack.Client):
    """A ``pandastack.Client`` whose server is in memory (see the module docstring).

    ``templates``: the template names that exist; ``max_sandboxes``: refuse creates past
    this many live sandboxes with the capacity 503 (``Retry-After: 5``).
    """

    def __init__(
        self,
        *,
        api_key: str | None = FAKE_KEY,
        templates: tuple[str, ...] = DEFAULT_TEMPLATES,
        max_sandboxes: int | None = None,
        max_create_retry_seconds: float = 0,
        on_create_retry: Callable[[CreateRetryEvent], None] | None = None,
    ) -> None:
        super().__init__(
            api_url=FAKE_URL,
            api_key=api_key or "",
            timeout=5.0,
            max_create_retry_seconds=max_create_retry_seconds,
            on_create_retry=on_create_retry,
        )
        self.api_key = api_key
        self.session = None  # type: ignore[assignment]  # nothing here may reach the network
        self.template_names = tuple(templates)
        """The template names that exist (``templates`` stays the SDK's templates API)."""
        self.max_sandboxes = max_sandboxes
        self.sandbox_state: dict[str, FakeSandbox] = {}
        self.deleted: list[str] = []
        self.execs: list[ExecCall] = []
        self.requests: list[tuple[str, str, str]] = []
        """Every request as (method, path, ``?path=``), in order."""
        self._scripts: list[tuple[Callable[[str], bool], Script]] = []
        self._failures: list[_Failure] = []
        self._lock = threading.RLock()

    # -- scripting ---------------------------------------------------------------------------

    def script(
        self, match: str | Callable[[str], bool], script: Script | None = None, **fields: Any
    ) -> Script:
        """What a command does: the last script whose ``match`` (a substring of the job's own
        command, or a predicate on it) fits is used; an unmatched command exits 0 silently.

        Give a :class:`Script` or its fields (``exit_code=3, stderr="bad input"``).
        """
        chosen = script or Script(**fields)
        with self._lock:
            self._scripts.append((_matcher(match), chosen))
        return chosen

    def fail(
        self,
        op: str,
        error: BaseException,
        *,
        match: str | Callable[[str], bool] | None = None,
        times: int | None = 1,
    ) -> None:
        """Make the next ``times`` (None: every) ``op`` whose target fits ``match`` raise ``error``.

        ``error`` must be what the SDK raises: a ``pandastack.PandastackError`` (the server's
        answer, mapped by status) or a ``requests.RequestException`` (the connection). It is
        raised where the SDK sends the request, so the SDK's own wrapping applies.
        """
        if op not in OPERATIONS:
            raise ValueError(f"op: {op!r} is not one of {', '.join(OPERATIONS)}")
        if not isinstance(error, (pandastack.PandastackError, requests.RequestException)):
            raise TypeError(
                f"error: {type(error).__name__} is not an SDK error; use a pandastack exception "
                "(pandastack.ServerError(...)) or a requests.RequestException"
            )
        with self._lock:
            self._failures.append(_Failure(op, error, _matcher(match), times))

    def heal(self) -> None:
        """Forget every failure :meth:`fail` set up (the server is back)."""
        with self._lock:
            self._failures.clear()

    def refuse_capacity(self, *, times: int = 1, retry_after: float | None = 5.0) -> None:
        """The next ``times`` creates are refused as the hosted scheduler refuses them (503
        ``no compute capacity available``); ``on_create_retry`` sees ``retry_after`` first when
        the client has a create-retry budget."""
        error = pandastack.ServerError("no compute capacity available")
        error.fake_retry_after = retry_after  # type: ignore[attr-defined]
        error.fake_status = 503  # type: ignore[attr-defined]
        # On the wire the scheduler's 503 always says Retry-After: 5; ``retry_after=None`` is a
        # refusal whose wait the SDK's retry event did not see (no budget).
        error.fake_wire_retry_after = 5.0 if retry_after is None else retry_after  # type: ignore[attr-defined]
        self.fail("create", error, times=times)

    # -- looking at the server ----------------------------------------------------------------

    def live(self) -> list[str]:
        """Ids of the sandboxes that exist (not deleted)."""
        with self._lock:
            return list(self.sandbox_state)

    def sandbox(self, sandbox_id: str) -> FakeSandbox:
        """The server-side state of a live sandbox (KeyError if deleted)."""
        return self.sandbox_state[sandbox_id]

    def add_sandbox(
        self,
        *,
        metadata: Mapping[str, str] | None = None,
        template: str = "code-interpreter",
        ttl_seconds: int | None = DEFAULT_FAKE_TTL,
    ) -> FakeSandbox:
        """A sandbox made by someone else (an earlier attempt, another deployment)."""
        with self._lock:
            sb = FakeSandbox(str(uuid.uuid4()), template, dict(metadata or {}), ttl_seconds)
            self.sandbox_state[sb.id] = sb
            return sb

    def lose(self, sandbox_id: str) -> None:
        """The sandbox's processes die (its host went away): status ``failed``, execs refused."""
        with self._lock:
            self.sandbox_state[sandbox_id].status = "failed"

    def expire(self, sandbox_id: str) -> None:
        """Delete a sandbox as its TTL or an operator would, behind the client's back."""
        with self._lock:
            self.sandbox_state.pop(sandbox_id, None)
            self.deleted.append(sandbox_id)

    def finish_background(self, sandbox_id: str) -> None:
        """Let every detached job of the sandbox end now (its exit marker is written)."""
        with self._lock:
            for _script, _call, polls in self.sandbox_state[sandbox_id].background:
                polls[0] = 0

    # -- the wire -----------------------------------------------------------------------------

    def _request(  # type: ignore[override]
        self,
        method: str,
        path: str,
        *,
        json: dict[str, Any] | None = None,
        params: Mapping[str, Any] | None = None,
        data: Any = None,
        files: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        stream: bool = False,
        raw_response: bool = False,
        no_retry: bool = False,
        timeout: float | None = None,
        retry_on_capacity: bool = False,
        cancel: Any = None,
    ) -> Any:
        """Answer one SDK request from memory, raising what the SDK raises for an error answer."""
        if cancel is not None and cancel.is_set():
            raise pandastack.CreateCancelled("create cancelled before it was sent")
        if not self.api_key:
            raise pandastack.AuthError("PANDASTACK_API_KEY is required")
        self.requests.append((method, path, str((params or {}).get("path", ""))))
        parts = path.strip("/").split("/")
        body = json or {}
        record_answer(None)  # as ConnectionConfig's clients record each answer's status
        try:
            return self._route(method, parts, body, dict(params or {}), data, stream)
        except _Http as exc:
            record_answer(ErrorAnswer(exc.status))
            raise _sdk_error(exc.status, str(exc)) from None

    def _route(
        self,
        method: str,
        parts: list[str],
        body: dict[str, Any],
        params: dict[str, Any],
        data: Any,
        stream: bool,
    ) -> Any:
        if parts == ["sandboxes"] and method == "POST":
            return self._create(body)
        if parts == ["sandboxes"] and method == "GET":
            self._inject("list", "")
            with self._lock:
                return [sb.to_json() for sb in self.sandbox_state.values()]
        if parts == ["me"] and method == "GET":
            self._inject("me", "")
            return {"user_id": "fake", "auth_method": "api_key"}
        if len(parts) == 2 and parts[0] == "templates" and method == "GET":
            self._inject("template", parts[1])
            if parts[1] not in self.template_names:
                raise _Http(404, "not found")
            return {"name": parts[1], "cpu": 1, "memory_mb": 512, "size_bytes": 0, "meta": {}}
        if len(parts) < 2 or parts[0] != "sandboxes":
            raise _Http(404, "not found")
        sid, rest = parts[1], parts[2:]
        if not rest and method == "GET":
            self._inject("get", sid)
            return self._get(sid).to_json()
        if not rest and method == "DELETE":
            self._inject("delete", sid)
            with self._lock:
                self._get(sid).status = "deleted"
                del self.sandbox_state[sid]
                self.deleted.append(sid)
            return None
        if rest == ["fork"] and method == "POST":
            return self._fork(sid)
        if rest == ["lifecycle"] and method == "PATCH":
            self._inject("set_ttl", sid)
            sb = self._get(sid)
            ttl = body.get("ttl_seconds")
            if ttl is not None:
                if isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 0:
                    raise _Http(400, "ttl_seconds must not be negative")
                sb.ttl_seconds = ttl or None
            return {"ttl_seconds": sb.ttl_seconds or 0, "persistent": False, "idle_seconds": 0}
        if rest in (["exec"], ["exec", "stream"]) and method == "POST":
            return self._exec(sid, body, stream=rest == ["exec", "stream"])
        if rest[0] == "fs":
            return self._fs(method, sid, rest[1:], params, data)
        raise _Http(404, "not found")

    def _inject(self, op: str, target: str) -> None:
        with self._lock:
            for failure in self._failures:
                if failure.op == op and failure.match(target):
                    if failure.times is not None:
                        failure.times -= 1
                        if failure.times <= 0:
                            self._failures.remove(failure)
                    error = failure.error
                    break
            else:
                return
        retry_after = getattr(error, "fake_retry_after", None)
        status = getattr(error, "fake_status", None)
        if status is not None:
            record_answer(ErrorAnswer(status, getattr(error, "fake_wire_retry_after", retry_after)))
        if op == "create" and self.on_create_retry is not None and self.max_create_retry_seconds > 0:
            self.on_create_retry(
                CreateRetryEvent(
                    method="POST",
                    path="/sandboxes",
                    attempt=1,
                    status_code=503,
                    error=str(error),
                    delay_seconds=retry_after or 1.0,
                    elapsed_seconds=0.0,
                    retry_after_seconds=retry_after,
                )
            )
        raise error

    def _get(self, sandbox_id: str, *, running: bool = False) -> FakeSandbox:
        """The sandbox, or the server's 404; ``running``: the 500 of a sandbox whose processes died."""
        with self._lock:
            found = self.sandbox_state.get(sandbox_id)
        if found is None:
            raise _Http(404, "not found")
        if running and found.status != "running":
            raise _Http(500, "sandbox is not running (its processes have exited)")
        return found

    def _create(self, body: dict[str, Any]) -> dict[str, Any]:
        template = body.get("template", "code-interpreter")
        self._inject("create", str(template))
        metadata = body.get("metadata") or {}
        if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            raise _Http(400, "metadata must be a map of string to string")
        ttl = body.get("ttl_seconds")
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 0):
            raise _Http(400, "ttl_seconds must not be negative")
        if template not in self.template_names:
            raise _Http(
                500,
                f'template "{template}" is not on this host and could not be pulled: '
                f"available templates: {', '.join(self.template_names)}",
            )
        with self._lock:
            if self.max_sandboxes is not None and len(self.sandbox_state) >= self.max_sandboxes:
                raise _Http(503, "no compute capacity available")
            sb = FakeSandbox(str(uuid.uuid4()), template, dict(metadata), ttl or DEFAULT_FAKE_TTL)
            self.sandbox_state[sb.id] = sb
            return sb.to_json()

    def _fork(self, parent_id: str) -> dict[str, Any]:
        self._inject("fork", parent_id)
        parent = self._get(parent_id)
        if parent.status != "running":
            raise _Http(500, "parent sandbox not found or not running")
        with self._lock:
            # As on the server: the SDK's metadata is ignored, the child names its parent, a cold
            # fork copies the disk (not the processes) and gets no TTL of its own.
            child = FakeSandbox(
                str(uuid.uuid4()),
                parent.template,
                {"forked_from": parent.id},
                None,
                files=dict(parent.files),
                kinds=dict(parent.kinds),
            )
            self.sandbox_state[child.id] = child
        return {
            "parent_id": parent.id,
            "snapshot_id": f"snap-{uuid.uuid4()}",
            "children": [child.id],
            "at": "1970-01-01T00:00:00Z",
        }

    # -- filesystem ---------------------------------------------------------------------------

    def _fs(self, method: str, sid: str, rest: list[str], params: dict[str, Any], data: Any) -> Any:
        path = str(params.get("path") or ("/" if rest == ["dir"] else ""))
        op = {("GET", ()): "read", ("PUT", ()): "write", ("GET", ("dir",)): "listdir"}.get(
            (method, tuple(rest)), "stat" if rest == ["stat"] else ""
        )
        if not op:
            raise _Http(404, "not found")
        self._inject(op, path)
        sb = self._get(sid, running=True)
        if not path:
            raise _Http(400, "path required: give ?path=/absolute/path")
        if not path.startswith("/") or ".." in path.split("/"):
            raise _Http(400, f"path must be absolute (start with /) without '..': got {path!r}")
        with self._lock:
            if op == "write":
                content = bytes(data or b"")
                sb.files[path] = content
                sb.kinds.pop(path, None)
                return {"path": path, "bytes": len(content)}
            if op == "read":
                if path in sb.kinds:
                    raise _Http(400, f"{path} is not a regular file")
                if path not in sb.files:
                    raise _Http(500, f"open {path}: no such file or directory")
                return _RawResponse(sb.files[path])
            if op == "stat":
                return self._stat(sb, path)
            prefix = path.rstrip("/") + "/"
            names = {p[len(prefix) :].split("/")[0] for p in [*sb.files, *sb.kinds] if p.startswith(prefix)}
            return {"path": path, "entries": [self._stat(sb, prefix + n) for n in sorted(names)]}

    def _stat(self, sb: FakeSandbox, path: str) -> dict[str, Any]:
        name = path.rstrip("/").rsplit("/", 1)[-1]
        if path in sb.files:
            return {"name": name, "is_dir": False, "size": len(sb.files[path]), "mode": "f", "mtime": 0}
        if path in sb.kinds:
            kind = sb.kinds[path]
            return {"name": name, "is_dir": kind == "d", "size": 0, "mode": kind, "mtime": 0}
        prefix = path.rstrip("/") + "/"
        if path == "/" or any(p.startswith(prefix) for p in sb.files):
            return {"name": name, "is_dir": True, "size": 0, "mode": "d", "mtime": 0}
        if path == guest.DETACHED_EXIT:
            self._poll_background(sb)
            if path in sb.files:
                return self._stat(sb, path)
        raise _Http(404, "file does not exist")

    # -- exec ---------------------------------------------------------------------------------

    def _exec(self, sid: str, body: dict[str, Any], *, stream: bool) -> Any:
        line = body.get("cmd")
        self._inject("exec_stream" if stream else "exec", str(line))
        if not isinstance(line, str) or not line:
            raise _Http(400, "cmd required")
        sb = self._get(sid, running=True)
        command, env, clock = _unwrap(line)
        detached = guest.DETACHED_EXIT in line and line.rstrip().endswith("&")
        writes, trailer = _folded(line) if not detached else ({}, None)
        with self._lock:
            for path, text in writes.items():  # the exec line's own printf writes, before the job
                sb.files[path] = text.encode()
                sb.kinds.pop(path, None)
        call = ExecCall(sid, line, command, env, clock, body.get("timeout_seconds"), stream, detached)
        with self._lock:
            self.execs.append(call)
            script = next((s for m, s in reversed(self._scripts) if m(command)), Script())
        if script.action is not None:
            script = script.action(sb, call) or script
        if detached:
            with self._lock:
                sb.background.append((script, call, [script.runs_for]))
            return {"stdout": "", "stderr": "", "exit_code": 0} if not stream else self._sse([], [], 0)
        exit_code = self._run(sb, script, call)
        if exit_code is None:  # deleted under the exec: the stream is cut
            return self._sse(_chunks(script.stdout), [], None) if stream else self._cut()
        out, err = _chunks(script.stdout), _chunks(script.stderr)
        if exit_code == 0 and trailer is not None:
            out += self._trailer(sb, trailer)
        if not stream:
            return {"stdout": "".join(out), "stderr": "".join(err), "exit_code": exit_code}
        if script.stream_ends == "eof":
            return self._sse(out, err, None)
        if script.stream_ends == "drop":
            return self._sse(out, err, None, drop=True)
        return self._sse(out, err, exit_code)

    def _trailer(self, sb: FakeSandbox, trailer: _Trailer) -> list[str]:
        """What the guest's trailer prints: a regular result file's first bytes between the marks,
        decoded as the server decodes a stream (bad UTF-8 replaced); nothing once it is gone or dead."""
        with self._lock:
            gone = sb.id not in self.sandbox_state or sb.status != "running"
            if gone or trailer.path in sb.kinds or trailer.path not in sb.files:
                return []
            data = sb.files[trailer.path][: trailer.count]
        mark = f"{guest.RESULT_MARK}{trailer.nonce}"
        return [f"{mark} f\n", data.decode("utf-8", "replace"), f"{mark} e0\n"]

    @staticmethod
    def _cut() -> Any:
        raise _Http(502, "agent unreachable")

    def _run(self, sb: FakeSandbox, script: Script, call: ExecCall) -> int | None:
        """Apply a foreground script's effects; the exit code, or None if the sandbox went away."""
        if script.wait is not None:
            while not script.wait.wait(0.005):
                if sb.id not in self.sandbox_state:
                    return None
        if script.hangs:
            time.sleep(call.timeout or 0)
            return guest.TIMEOUT_EXIT_CODE
        self._write_effects(sb, script, call)
        return script.exit_code

    def _write_effects(self, sb: FakeSandbox, script: Script, call: ExecCall) -> None:
        with self._lock:
            result_path = call.env.get("JOB_RESULT")
            if result_path and script.raw_result is not None:
                sb.files[result_path] = script.raw_result
            elif result_path and script.result is not NOT_GIVEN:
                sb.files[result_path] = json.dumps(script.result).encode()
            for path, content in script.files.items():
                sb.files[path] = content.encode() if isinstance(content, str) else bytes(content)

    def _poll_background(self, sb: FakeSandbox) -> None:
        """One poll of a detached job's exit marker: a job whose time is up writes its end."""
        with self._lock:
            for script, call, polls in list(sb.background):
                if polls[0] > 0:
                    polls[0] -= 1
                    continue
                sb.background.remove((script, call, polls))
                if script.hangs:
                    continue  # the guest clock never fires in the fake: the poller's deadline does
                self._write_effects(sb, script, call)
                sb.files[guest.DETACHED_STDOUT] = "".join(_chunks(script.stdout)).encode()
                sb.files[guest.DETACHED_STDERR] = "".join(_chunks(script.stderr)).encode()
                sb.files[guest.DETACHED_EXIT] = f"{script.exit_code}\n".encode()

    @staticmethod
    def _sse(out: list[str], err: list[str], exit_code: int | None, *, drop: bool = False) -> _RawResponse:
        def lines() -> Iterator[str]:
            for event, chunks in (("stdout", out), ("stderr", err)):
                for chunk in chunks:
                    yield f"event: {event}"
                    yield "data: " + json.dumps({"chunk": chunk})
                    yield ""
            if drop:
                raise requests.exceptions.ChunkedEncodingError("Connection broken: IncompleteRead")
            if exit_code is not None:
                yield "event: exit"
                yield "data: " + json.dumps({"exit_code": exit_code})
                yield ""

        return _RawResponse(lines=lines())


def _chunks(text: str | list[str]) -> list[str]:
    if isinstance(text, str):
        return [text] if text else []
    return list(text)
