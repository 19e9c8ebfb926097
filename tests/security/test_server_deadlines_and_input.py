"""Issue 23, the server's side: every wait has a deadline, and client- or guest-controlled input
is a JSON 4xx naming the field, never a 500 (crossings 11-17 and the "bad input" list).

Each test attacks through the API (raw HTTP where the status and body matter, code run in the
sandbox where the job is the attacker) on a private server with a fast TTL scan, so a sandbox
whose TTL passes is reaped within a fraction of a second. Every test here was written first and
seen failing on the code before its fix (the commit that made it pass says how).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from pandastack_local import LocalServer, agent_client
from pandastack_local.testing.procs import descendants
from tests.security.conftest import SMALL
from tests.support.listener import Listener
from tests.support.server import GVISOR, fail_on_leftovers, write_template

# The agent's silence deadline (agent_client.AGENT_SILENCE_SECONDS; 10 s before it existed).
AGENT_SILENCE_SECONDS: float = getattr(agent_client, "AGENT_SILENCE_SECONDS", 10.0)
# How long past the agent's silence deadline a request to a stopped agent may take to end.
SLACK_SECONDS = 8.0
# A request to a sandbox already known to be lost (or gone) answers within this.
FAST_SECONDS = 3.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    base = tmp_path_factory.mktemp("deadline-templates")
    small = str(write_template(base / "small", **SMALL))
    with LocalServer(template_dirs=[small], pool_size=0, ttl_scan_interval=0.2) as s:
        yield s


@pytest.fixture
def http(server: LocalServer) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {server.api_key}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as client:
        yield client
    fail_on_leftovers(server)


@pytest.fixture
def make_sandbox(http: httpx.Client) -> Iterator[Callable[..., str]]:
    made: list[str] = []

    def make(ttl: int = 300, **body: Any) -> str:
        r = http.post("/v1/sandboxes", json={"template": "small", "ttl_seconds": ttl, **body})
        assert r.status_code == 201, r.text
        made.append(r.json()["id"])
        return str(r.json()["id"])

    yield make
    for sid in made:
        http.delete(f"/v1/sandboxes/{sid}")


def json_error(r: httpx.Response) -> str:
    """The JSON error envelope's message (failing if the answer is not one)."""
    assert r.headers.get("content-type", "").startswith("application/json"), (r.status_code, r.text[:300])
    body = r.json()
    assert isinstance(body, dict) and isinstance(body.get("error"), str), body
    return str(body["error"])


def run(http: httpx.Client, sid: str, cmd: str, timeout: int = 30) -> dict[str, Any]:
    r = http.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": cmd, "timeout_seconds": timeout})
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()
    return result


def wait_gone(http: httpx.Client, sid: str, within: float) -> float:
    """Seconds until GET of the sandbox is a 404 (it was reaped), failing after ``within``."""
    started = time.monotonic()
    while http.get(f"/v1/sandboxes/{sid}").status_code != 404:
        assert time.monotonic() - started < within, f"sandbox {sid} still there after {within:.0f}s"
        time.sleep(0.2)
    return time.monotonic() - started


def _describe(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "gone"
    return f"{stat[stat.rfind(')') + 2 :].split()[0]} {cmdline[:200]}"


def host_processes(server: LocalServer) -> set[int]:
    assert server.pid is not None
    return set(descendants(server.pid))


def stop_agent(server: LocalServer, before: set[int], delay: float) -> str:
    """Stop the sandbox's agent ``delay`` s from now; returns what the job must run for it.

    Under gVisor a job can stop its own agent (``kill -STOP $PPID``: the sentry delivers it to its
    init), the issue's crossing. Under bwrap it cannot: the agent is the sandbox's PID 1, whose
    SIGSTOP from inside the kernel drops (test_kernel_resources.py). There the test stops it from
    the host instead, standing in for an agent that hangs; the server's deadlines are the same."""
    if GVISOR:
        return f"(sleep {delay}; kill -STOP $PPID) >/dev/null 2>&1 &"
    agents = [
        pid
        for pid in host_processes(server) - before
        # the agent itself, not bwrap's outer process (whose argv names it too)
        if _cmdline(pid).split(b"\0")[:1] == [b"/usr/bin/python3"]
        and b"/.pandastack/agent.py" in _cmdline(pid)
    ]
    assert len(agents) == 1, agents
    timer = threading.Timer(delay, os.kill, (agents[0], signal.SIGSTOP))
    timer.daemon = True
    timer.start()
    return "true"


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def open_context(http: httpx.Client, sid: str) -> str:
    r = http.post(f"/v1/sandboxes/{sid}/repl/sessions", json={"language": "python"})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def run_code(http: httpx.Client, sid: str, cid: str, code: str, **kw: Any) -> httpx.Response:
    return http.post(f"/v1/sandboxes/{sid}/repl/sessions/{cid}/run", json={"code": code, **kw})


def later_requests_fail_fast(http: httpx.Client, sid: str) -> None:
    """Every kind of request to a lost sandbox ends at once with a JSON error."""
    requests: list[tuple[str, str, dict[str, Any]]] = [
        ("POST", "/exec", {"json": {"cmd": "true"}}),
        ("GET", "/fs/stat", {"params": {"path": "/etc/hostname"}}),
        ("GET", "/fs", {"params": {"path": "/etc/hostname"}}),
        ("PUT", "/fs", {"params": {"path": "/work/x"}, "content": b"x"}),
        ("GET", "/fs/dir", {"params": {"path": "/"}}),
        ("POST", "/repl/sessions", {"json": {}}),
        ("GET", "/repl/sessions", {}),
        ("POST", "/fork", {"json": {}}),
    ]
    for method, suffix, kw in requests:
        started = time.monotonic()
        r = http.request(method, f"/v1/sandboxes/{sid}{suffix}", timeout=30, **kw)
        took = time.monotonic() - started
        assert r.status_code >= 400 and json_error(r), (method, suffix, r.status_code, r.text)
        assert took < FAST_SECONDS, f"{method} {suffix} on a lost sandbox took {took:.1f}s"


# ---- crossing 11: a job that stops its own agent -------------------------------------------------


def test_an_exec_that_stops_its_agent_ends_with_a_clear_error_and_the_sandbox_is_reaped(
    server: LocalServer, http: httpx.Client, make_sandbox: Callable[..., str]
) -> None:
    before = host_processes(server)
    sid = make_sandbox(ttl=300)  # no TTL in the way: the silence deadline alone ends it
    mine = host_processes(server) - before
    stop = stop_agent(server, before, 0.5)
    started = time.monotonic()
    try:
        r = http.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": f"{stop}\nsleep 600"}, timeout=45)
    except httpx.ReadTimeout:
        pytest.fail("the exec to a stopped agent never answered (no deadline)")
    took = time.monotonic() - started
    assert took < AGENT_SILENCE_SECONDS + SLACK_SECONDS, f"took {took:.1f}s"
    assert r.status_code == 500 and "not answering" in json_error(r), r.text
    assert http.get(f"/v1/sandboxes/{sid}").json()["status"] == "failed"
    later_requests_fail_fast(http, sid)
    left = {pid: _describe(pid) for pid in mine}
    left = {pid: what for pid, what in left.items() if what != "gone" and not what.startswith("Z ")}
    assert not left, f"the lost sandbox's host processes are still there: {left}"
    assert http.get(f"/v1/sandboxes/{sid}").json()["status"] == "failed"  # kept, to say why, until deleted


def test_an_agent_stopped_between_requests_ends_the_next_one_and_the_ttl_still_fires(
    server: LocalServer, http: httpx.Client, make_sandbox: Callable[..., str]
) -> None:
    before = host_processes(server)
    sid = make_sandbox(ttl=3)
    run(http, sid, stop_agent(server, before, 0.5))
    time.sleep(1.5)
    started = time.monotonic()
    try:
        r = http.get(f"/v1/sandboxes/{sid}/fs/stat", params={"path": "/etc/hostname"}, timeout=45)
    except httpx.ReadTimeout:
        pytest.fail("fs/stat to a stopped agent never answered (no deadline)")
    took = time.monotonic() - started
    assert took < AGENT_SILENCE_SECONDS + SLACK_SECONDS, f"took {took:.1f}s"
    # Lost (silent past the deadline) or reaped by its 3 s TTL while the request waited: either
    # way a JSON 500 that says why.
    message = json_error(r)
    assert r.status_code == 500 and ("not answering" in message or "TTL" in message), r.text
    later_requests_fail_fast(http, sid)
    wait_gone(http, sid, within=15)


def test_a_code_context_run_to_a_stopped_agent_ends_quickly(
    server: LocalServer, http: httpx.Client, make_sandbox: Callable[..., str]
) -> None:
    before = host_processes(server)
    sid = make_sandbox()
    cid = open_context(http, sid)
    run(http, sid, stop_agent(server, before, 1))
    started = time.monotonic()
    try:
        r = http.post(
            f"/v1/sandboxes/{sid}/repl/sessions/{cid}/run",
            json={"code": "import time\ntime.sleep(60)", "timeout_ms": 120_000},
            timeout=45,
        )
    except httpx.ReadTimeout:
        pytest.fail("a code-context run to a stopped agent never answered (no deadline)")
    took = time.monotonic() - started
    assert took < AGENT_SILENCE_SECONDS + SLACK_SECONDS, f"took {took:.1f}s"
    assert r.status_code == 500 and "not answering" in json_error(r), r.text
    later_requests_fail_fast(http, sid)


def test_idle_seconds_counts_while_a_request_waits_on_a_silent_agent(
    server: LocalServer, http: httpx.Client, make_sandbox: Callable[..., str]
) -> None:
    """The issue's observation: ``idle_seconds`` stayed 0 long past a 3 s TTL while a request to
    the stopped agent was in flight. A request counts as activity only while the agent answers."""
    before = host_processes(server)
    sid = make_sandbox(ttl=300)
    done = threading.Event()
    stop = stop_agent(server, before, 0.5)

    def stuck_exec() -> None:
        with contextlib.suppress(httpx.HTTPError):
            http.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": f"{stop}\nsleep 600"}, timeout=45)
        done.set()

    threading.Thread(target=stuck_exec, daemon=True).start()
    time.sleep(AGENT_SILENCE_SECONDS / 2 + 2)
    r = http.get(f"/v1/sandboxes/{sid}/lifecycle")
    assert r.status_code == 200 and r.json()["idle_seconds"] >= 2, r.text
    assert done.wait(AGENT_SILENCE_SECONDS + SLACK_SECONDS), "the stuck exec never ended"


def test_a_live_long_exec_keeps_its_sandbox_and_reports_it_busy(
    http: httpx.Client, make_sandbox: Callable[..., str]
) -> None:
    """The other side of the deadline: an agent that answers (a quiet command running longer than
    the silence deadline and the TTL) is neither lost nor reaped."""
    sid = make_sandbox(ttl=3)
    started = time.monotonic()
    quiet = int(AGENT_SILENCE_SECONDS + 3)
    result = run(http, sid, f"sleep {quiet}; echo done", timeout=quiet + 30)
    assert result["exit_code"] == 0 and result["stdout"] == "done\n"
    assert time.monotonic() - started >= quiet
    assert http.get(f"/v1/sandboxes/{sid}").json()["status"] == "running"


# ---- crossing 12: an abandoned code-context run --------------------------------------------------


def _abandon(http: httpx.Client, sid: str, cid: str) -> None:
    with pytest.raises(httpx.ReadTimeout):
        http.post(
            f"/v1/sandboxes/{sid}/repl/sessions/{cid}/run",
            json={"code": "import time\ntime.sleep(120)", "timeout_ms": 120_000},
            timeout=1,
        )


def test_an_abandoned_code_context_run_does_not_dodge_the_ttl(
    http: httpx.Client, make_sandbox: Callable[..., str]
) -> None:
    sid = make_sandbox(ttl=3)
    cid = open_context(http, sid)
    _abandon(http, sid, cid)
    took = wait_gone(http, sid, within=15)
    assert took < 12, f"reaped {took:.1f}s after the client left"


def test_an_abandoned_code_context_run_is_interrupted_and_the_context_goes_on(
    http: httpx.Client, make_sandbox: Callable[..., str]
) -> None:
    sid = make_sandbox()
    cid = open_context(http, sid)
    assert run_code(http, sid, cid, "x = 41").status_code == 200
    _abandon(http, sid, cid)
    started = time.monotonic()
    r = http.post(f"/v1/sandboxes/{sid}/repl/sessions/{cid}/run", json={"code": "x + 1"}, timeout=20)
    assert r.status_code == 200 and r.json()["stdout"] == "42\n", r.text
    assert time.monotonic() - started < 10


# ---- crossing 13: a lone surrogate ---------------------------------------------------------------

SURROGATE_BODIES = {
    "metadata value": b'{"template": "small", "metadata": {"k": "x\\ud800"}}',
    "metadata key": b'{"template": "small", "metadata": {"x\\udfff": "v"}}',
    "persistent metadata": b'{"template": "small", "persistent": true, "metadata": {"k": "\\ud800"}}',
}


@pytest.mark.parametrize("body", SURROGATE_BODIES.values(), ids=list(SURROGATE_BODIES))
def test_a_lone_surrogate_in_metadata_is_a_400_and_the_list_never_breaks(
    http: httpx.Client, body: bytes
) -> None:
    count = len(http.get("/v1/sandboxes").json())
    r = http.post("/v1/sandboxes", content=body, headers={"Content-Type": "application/json"})
    if r.status_code == 201:  # today: the sandbox exists, so delete it before failing
        http.delete(f"/v1/sandboxes/{r.json()['id']}")
    assert r.status_code == 400 and "metadata" in json_error(r), (r.status_code, r.text)
    listed = http.get("/v1/sandboxes")
    assert listed.status_code == 200 and len(listed.json()) == count


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/exec", b'{"cmd": "echo x\\ud800"}'),
        ("/exec/stream", b'{"cmd": "echo x\\ud800"}'),
        ("/repl", b'{"language": "python", "code": "print(1) # \\udc80"}'),
    ],
    ids=["exec", "exec-stream", "one-shot-repl"],
)
def test_a_lone_surrogate_in_a_command_is_a_400_naming_the_field(
    http: httpx.Client, make_sandbox: Callable[..., str], route: str, body: bytes
) -> None:
    sid = make_sandbox()
    r = http.post(f"/v1/sandboxes/{sid}{route}", content=body, headers={"Content-Type": "application/json"})
    field = "code" if route == "/repl" else "cmd"
    assert r.status_code == 400 and field in json_error(r), (r.status_code, r.text)
    assert http.get(f"/v1/sandboxes/{sid}/logs").status_code == 200
    assert http.get("/v1/sandboxes").status_code == 200


def test_a_lone_surrogate_in_code_context_code_is_a_400(
    http: httpx.Client, make_sandbox: Callable[..., str]
) -> None:
    sid = make_sandbox()
    cid = open_context(http, sid)
    r = http.post(
        f"/v1/sandboxes/{sid}/repl/sessions/{cid}/run",
        content=b'{"code": "s = \\"\\ud800\\""}',
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 400 and "code" in json_error(r), (r.status_code, r.text)
    assert run_code(http, sid, cid, "6 * 7").json()["stdout"] == "42\n"


# ---- crossing 14: the delete-root guard acts on the resolved path --------------------------------

ROOT_ALIASES = [
    "/proc/self/root/",
    "/proc/self/cwd/",
    "/proc/1/root/",
    "/proc/self/root/.",
    "/proc/self/root//",
]


@pytest.mark.parametrize("path", ROOT_ALIASES)
def test_a_path_that_resolves_to_the_root_is_refused_as_the_root(
    http: httpx.Client, make_sandbox: Callable[..., str], path: str
) -> None:
    sid = make_sandbox()
    r = http.delete(f"/v1/sandboxes/{sid}/fs", params={"path": path})
    assert r.status_code == 400 and "root" in json_error(r), (r.status_code, r.text)
    for kept in ("/etc/passwd", "/etc/hosts", "/etc/group"):
        assert http.get(f"/v1/sandboxes/{sid}/fs/stat", params={"path": kept}).status_code == 200, kept


# ---- bad input: what the OS refuses is a 4xx naming the path and the reason -----------------------

# The host's /usr is read-only, and under gVisor it is not even the sandbox root's (the sentry's
# uids are mapped: issue 23, crossing 6), so the permission check refuses first there.
USR_REFUSED = "Permission denied" if GVISOR else "Read-only file system"
# (method, path, what the job prepares first, the reason the answer must name)
OS_REFUSALS = {
    "write-read-only-fs": ("PUT", "/usr/bin/pandastack-x", "", USR_REFUSED),
    "write-under-a-file": ("PUT", "/etc/passwd/sub/x", "", "Not a directory"),
    "write-parent-is-a-file": ("PUT", "/work/f/x", "touch /work/f", "File exists"),
    "read-proc-self-mem": ("GET", "/proc/self/mem", "", "Input/output error"),
    "delete-usr-bin": ("DELETE", "/usr/bin", "", USR_REFUSED),
    "delete-proc": ("DELETE", "/proc", "", ""),
    "delete-proc-pid-file": ("DELETE", "/proc/1/environ", "", ""),
    "dir-of-a-file": ("GET-DIR", "/etc/passwd", "", "Not a directory"),
    "write-proc-sys": ("PUT", "/proc/sys/kernel/hostname", "", ""),
}


@pytest.mark.parametrize("case", OS_REFUSALS.values(), ids=list(OS_REFUSALS))
def test_an_os_refusal_is_a_4xx_naming_the_path_and_the_reason(
    http: httpx.Client, make_sandbox: Callable[..., str], case: tuple[str, str, str, str]
) -> None:
    method, path, prepare, reason = case
    sid = make_sandbox()
    if prepare:
        run(http, sid, prepare)
    url = f"/v1/sandboxes/{sid}/fs"
    if method == "PUT":
        r = http.put(url, params={"path": path}, content=b"data")
    elif method == "GET":
        r = http.get(url, params={"path": path})
    elif method == "GET-DIR":
        r = http.get(url + "/dir", params={"path": path})
    else:
        r = http.delete(url, params={"path": path})
    message = json_error(r)
    assert 400 <= r.status_code < 500, (r.status_code, message)
    assert path in message and reason in message, message
    assert http.get(f"/v1/sandboxes/{sid}/fs/stat", params={"path": "/etc/passwd"}).status_code == 200


def test_a_file_name_that_is_not_utf8_is_listed_by_the_documented_rule(
    http: httpx.Client, make_sandbox: Callable[..., str]
) -> None:
    sid = make_sandbox()
    run(http, sid, "mkdir -p /work/d && touch /work/d/ok \"$(printf '/work/d/bad\\377name')\"")
    r = http.get(f"/v1/sandboxes/{sid}/fs/dir", params={"path": "/work/d"})
    assert r.status_code == 200, r.text
    names = [e["name"] for e in r.json()["entries"]]
    assert names == ["bad\ufffdname", "ok"], (
        names
    )  # invalid bytes become U+FFFD, as the real server's Go JSON


def test_a_directory_whose_listing_passes_one_frame_is_listed(
    http: httpx.Client, make_sandbox: Callable[..., str]
) -> None:
    """Found beyond the issue's list: 20,000 names (about 2 MB of listing) were one JSON frame
    over the protocol's 1 MiB, a 500 ``oversized frame`` after a 3 s wait."""
    sid = make_sandbox()
    make = "import os\nfor i in range(20000): open('/work/many/f%06d-%s' % (i, 'x' * 40), 'w').close()"
    run(http, sid, f'mkdir -p /work/many && python3 -c "{make}"')
    r = http.get(f"/v1/sandboxes/{sid}/fs/dir", params={"path": "/work/many"})
    assert r.status_code == 200, r.text[:300]
    names = [e["name"] for e in r.json()["entries"]]
    assert len(names) == 20000 and names[0].startswith("f000000-") and names == sorted(names)


@pytest.mark.parametrize("route", ["/fork", "/fork-tree"])
def test_fork_with_count_zero_is_a_400_naming_count(
    http: httpx.Client, make_sandbox: Callable[..., str], route: str
) -> None:
    sid = make_sandbox()
    count = len(http.get("/v1/sandboxes").json())
    r = http.post(f"/v1/sandboxes/{sid}{route}", json={"count": 0})
    if r.status_code == 201:  # today: a child was made
        children = r.json()["children"]
        for child in children:
            http.delete(f"/v1/sandboxes/{child if isinstance(child, str) else child['id']}")
    assert r.status_code == 400 and "count" in json_error(r), (r.status_code, r.text)
    assert len(http.get("/v1/sandboxes").json()) == count


# ---- crossing 15: code contexts cannot read or forge each other ----------------------------------

READ_OTHER = """
import json, os, re
pid, secret = {pid}, {secret!r}
out = {{}}
try:
    with open(f"/proc/{{pid}}/maps") as f:
        maps = f.read()
    found = False
    with open(f"/proc/{{pid}}/mem", "rb", buffering=0) as mem:
        for line in maps.splitlines():
            m = re.match(r"([0-9a-f]+)-([0-9a-f]+) rw", line)
            if not m:
                continue
            start, end = int(m.group(1), 16), int(m.group(2), 16)
            try:
                mem.seek(start)
                if secret.encode() in mem.read(min(end - start, 64 << 20)):
                    found = True
                    break
            except OSError:
                continue
    out["mem"] = "read: secret found" if found else "read: secret not found"
except OSError as exc:
    out["mem"] = f"refused: {{exc.__class__.__name__}}"
try:
    out["environ"] = "read" if open(f"/proc/{{pid}}/environ", "rb").read() is not None else ""
except OSError as exc:
    out["environ"] = f"refused: {{exc.__class__.__name__}}"
out["fds"] = []  # the numbers may be listed; opening one (the context's channel) must be refused
for fd in range(3, 64):
    try:
        r = os.open(f"/proc/{{pid}}/fd/{{fd}}", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        continue
    os.close(r)
    out["fds"].append(fd)
print(json.dumps(out))
"""

FORGE_OTHER = """
import json, os
pid = {pid}
forged = []
fake = json.dumps({{"stdout": "FORGED BY CONTEXT A", "stderr": "", "exit": 0, "results": []}}) + "\\n"
for fd in range(3, 64):
    path = f"/proc/{{pid}}/fd/{{fd}}"
    try:
        target = os.readlink(path)
    except OSError:
        target = ""
    try:
        w = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        continue
    try:
        os.write(w, fake.encode())
        forged.append(f"{{fd}} {{target}}")
    except OSError:
        pass
    finally:
        os.close(w)
print(json.dumps(forged))
"""


def _context_pid(http: httpx.Client, sid: str, cid: str) -> int:
    r = run_code(http, sid, cid, "import os\nos.getpid()")
    assert r.status_code == 200, r.text
    return int(r.json()["stdout"])


@pytest.fixture
def two_contexts(http: httpx.Client, make_sandbox: Callable[..., str]) -> tuple[str, str, str]:
    """A fresh sandbox with two code contexts: (sandbox id, victim, attacker)."""
    sid = make_sandbox()
    return sid, open_context(http, sid), open_context(http, sid)


def attack(
    http: httpx.Client, contexts: tuple[str, str, str], script: str, secret: str = "", **run: Any
) -> Any:
    """``script`` (given the victim's ``{pid}`` and ``{secret}``) run in the attacker context: the
    JSON it prints."""
    sid, victim, attacker = contexts
    pid = _context_pid(http, sid, victim)
    r = run_code(http, sid, attacker, script.format(pid=pid, secret=secret), **run)
    assert r.status_code == 200, r.text
    return json.loads(r.json()["stdout"])


def test_a_code_context_cannot_read_another_contexts_memory(
    http: httpx.Client, two_contexts: tuple[str, str, str]
) -> None:
    sid, victim, _ = two_contexts
    secret = "S3CR3T-" + os.urandom(8).hex()
    assert run_code(http, sid, victim, f"secret = {secret!r}").status_code == 200
    report = attack(http, two_contexts, READ_OTHER, secret=secret, timeout_ms=60_000)
    assert "secret found" not in report["mem"], report
    assert str(report["mem"]).startswith("refused") or "not found" in report["mem"], report
    assert report["fds"] == [], report
    if not GVISOR:  # gVisor does not apply dumpability to environ (the template's env: no secret)
        assert str(report["environ"]).startswith("refused"), report


def test_a_code_context_cannot_forge_another_contexts_reply(
    http: httpx.Client, two_contexts: tuple[str, str, str]
) -> None:
    sid, victim, _ = two_contexts
    forged = attack(http, two_contexts, FORGE_OTHER)
    answer = run_code(http, sid, victim, "6 * 7")
    assert answer.status_code == 200 and answer.json()["stdout"] == "42\n", (forged, answer.text)
    assert "FORGED" not in answer.text
    assert forged == [], f"context A opened context B's descriptors: {forged}"


def test_a_reply_line_without_the_runs_token_is_never_taken_as_the_reply(
    http: httpx.Client, make_sandbox: Callable[..., str]
) -> None:
    """Code in a context writes a fake reply into the context's own channel to the agent: the
    agent takes only the line carrying the run's token, so the real answer comes back."""
    sid = make_sandbox()
    cid = open_context(http, sid)
    code = (
        "import os, stat, fcntl, json\n"
        "fake = json.dumps({'stdout': 'FORGED', 'stderr': '', 'exit': 0, 'results': []}) + '\\n'\n"
        "for fd in range(3, 64):\n"
        "    try:\n"
        "        st = os.fstat(fd)\n"
        "    except OSError:\n"
        "        continue\n"
        "    mode = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE\n"
        "    if stat.S_ISSOCK(st.st_mode) or (stat.S_ISFIFO(st.st_mode) and mode == os.O_WRONLY):\n"
        "        os.write(fd, fake.encode())\n"
        "6 * 7"
    )
    answer = run_code(http, sid, cid, code)
    assert answer.status_code == 200 and answer.json()["stdout"] == "42\n", answer.text
    assert run_code(http, sid, cid, "6 * 8").json()["stdout"] == "48\n"


def _landlock_abi() -> int:
    import ctypes

    return int(ctypes.CDLL(None, use_errno=True).syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1)))


SIGNAL_OTHERS = """
import json, os
agent = int(open(f"/proc/{{os.getppid()}}/stat").read().rsplit(")", 1)[1].split()[1])
out = {{}}
for name, pid in (("agent", agent), ("supervisor", os.getppid()), ("other context", {pid})):
    try:
        os.kill(pid, 0)
        out[name] = "allowed"
    except OSError as exc:
        out[name] = exc.strerror
print(json.dumps(out))
"""


@pytest.mark.skipif(
    GVISOR, reason="gVisor has no Landlock: docs/local-server.md says contexts can signal there"
)
@pytest.mark.skipif(not GVISOR and _landlock_abi() < 6, reason="Landlock signal scoping needs Linux 6.12+")
def test_a_code_context_cannot_signal_the_agent_its_supervisor_or_another_context(
    http: httpx.Client, two_contexts: tuple[str, str, str]
) -> None:
    """So code in a context cannot stop the agent (crossing 11 from a context) or kill its
    supervisor (which would let what it started escape close) or another context."""
    report = attack(http, two_contexts, SIGNAL_OTHERS)
    assert report == dict.fromkeys(("agent", "supervisor", "other context"), "Operation not permitted"), (
        report
    )


# ---- crossing 16: close() kills everything the context started ----------------------------------


def sleepers(http: httpx.Client, sid: str, settle: float = 0) -> list[str]:
    """The marker processes (``sleep 100N``) in the sandbox, waiting up to ``settle`` s for none."""
    deadline = time.monotonic() + settle
    while True:
        out = run(http, sid, "ps -eo args= | grep '^sleep 100' || true")["stdout"]
        left = [line for line in out.split("\n") if line]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.2)


# Four marker sleeps that leave the context's process group: setsid, a double fork, a new session.
ESCAPED_SLEEPERS = """
import subprocess, os, time
subprocess.Popen(['setsid', 'sleep', '1001'])
os.system("setsid sh -c 'sleep 1002 & sleep 1003' >/dev/null 2>&1 &")
subprocess.Popen(['sh', '-c', 'sleep 1004 &'], start_new_session=True).wait()
time.sleep(0.5)
"""


@pytest.fixture
def context(http: httpx.Client, make_sandbox: Callable[..., str]) -> tuple[str, str]:
    """A fresh sandbox with one code context open: (sandbox id, context id)."""
    sid = make_sandbox()
    return sid, open_context(http, sid)


def test_closing_a_code_context_kills_what_it_started_even_after_setsid(
    http: httpx.Client, context: tuple[str, str]
) -> None:
    sid, cid = context
    assert run_code(http, sid, cid, ESCAPED_SLEEPERS).status_code == 200
    before = sleepers(http, sid)
    assert len(before) == 4, before
    assert http.delete(f"/v1/sandboxes/{sid}/repl/sessions/{cid}").status_code == 204
    left = sleepers(http, sid, settle=5)
    assert not left, f"processes the closed context started are still running: {left}"


def test_a_context_whose_python_dies_leaves_nothing_behind(
    http: httpx.Client, context: tuple[str, str]
) -> None:
    sid, cid = context
    code = (
        "import os, subprocess, time\n"
        "subprocess.Popen(['setsid', 'sleep', '1005'])\n"
        "time.sleep(0.5)\n"  # the sleep is running, in a session of its own
        "os._exit(3)"
    )
    r = run_code(http, sid, cid, code)
    assert r.status_code == 500 and "exited (code 3)" in json_error(r), r.text
    left = sleepers(http, sid, settle=5)
    assert not left, left


# ---- crossing 17: the egress relay's cap ---------------------------------------------------------

EGRESS_CAP = 64  # docs/local-server.md: "at most 64 relayed connections per sandbox are open at once"

FLOOD = """
import json, socket, sys, time
port, n = int(sys.argv[1]), int(sys.argv[2])
socks, refused = [], 0
for _ in range(n):
    s = socket.socket()
    s.settimeout(5)
    try:
        s.connect(("127.0.0.1", port))
        socks.append(s)
    except OSError:
        refused += 1
time.sleep(2)
closed, opened = 0, 0
for s in socks:
    s.settimeout(0.05)
    try:
        data = s.recv(1)
        closed += data == b""
        opened += data != b""
    except socket.timeout:
        opened += 1
    except OSError:
        closed += 1
print(json.dumps({"connected": len(socks), "refused": refused, "closed": closed, "open": opened}))
"""


class HoldServer(Listener):
    """A host TCP listener that accepts and holds every connection, counting them."""

    def __init__(self) -> None:
        self.conns: list[socket.socket] = []
        self.peak = 0
        super().__init__(backlog=512)

    def handle(self, conn: socket.socket) -> None:
        self.conns.append(conn)
        self.peak = max(self.peak, len(self.conns))

    def close(self) -> None:
        super().close()
        for conn in self.conns:
            conn.close()


@pytest.mark.skipif(GVISOR, reason="gVisor sandboxes have no network: the egress relay is bwrap's")
def test_the_egress_relay_never_holds_more_than_its_documented_cap() -> None:
    hold = HoldServer()
    try:
        with LocalServer(allow_egress=[f"127.0.0.1:{hold.port}"], pool_size=0, isolation="bwrap") as server:
            client = server.client()
            sb = client.sandboxes.create(template="base")
            try:
                sb.filesystem.write("/tmp/flood.py", FLOOD)
                started = time.monotonic()
                result = sb.exec(f"python3 /tmp/flood.py {hold.port} 101", timeout_seconds=60)
                assert result.exit_code == 0, result.stderr
                report = json.loads(result.stdout.strip().splitlines()[-1])
                assert time.monotonic() - started < 30, "extra connections were not refused promptly"
            finally:
                sb.kill()
    finally:
        hold.close()
    assert hold.peak <= EGRESS_CAP, f"{hold.peak} relayed connections at once, cap {EGRESS_CAP}: {report}"
    assert report["open"] <= EGRESS_CAP and report["open"] + report["closed"] + report["refused"] == 101, (
        report
    )
