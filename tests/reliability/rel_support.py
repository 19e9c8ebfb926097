"""Shared pieces of the reliability suite: the hostile template, the hostile jobs, the well-behaved
sibling, and host-side probes (what is left of a sandbox; the orchestrator's memory and fds).

Engine-neutral: imported by the core, Airflow and Prefect files alike.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pandastack_jobs import FailureClass, FailureKind, JobOutcome
from tests.support.procs import pids_matching, starttime

REPO = Path(__file__).resolve().parents[2]
TENANTS = REPO / "jobs" / "tenants"

# The orchestrator's own secret: set in the test process (and so in the server's environment).
CANARY_NAME = "PS_RELIABILITY_ORCHESTRATOR_SECRET"
CANARY_VALUE = "orchestrator-canary-7d41e0b2"
# A token-shaped string a job prints: the Redactor must mask it everywhere.
FAKE_TOKEN = "pds_" + "feedfacecafebeef" * 2

TEMPLATE = "hostile"
TEMPLATE_SPEC = {"name": TEMPLATE, "cpu": 1, "memory_mb": 256, "pids_max": 64, "disk_mb": 128, "nofile": 128}
TEMPLATE_FILE = "/opt/app/hello.txt"
TEMPLATE_FILE_TEXT = "pristine template file\n"


def write_hostile_template(base: Path) -> Path:
    """``base/hostile``: 1 CPU, 256 MB, 64 pids, 128 MB disk, 128 open files, one template file."""
    directory = base / TEMPLATE
    (directory / "rootfs" / "opt" / "app").mkdir(parents=True, exist_ok=True)
    (directory / "template.json").write_text(json.dumps(TEMPLATE_SPEC))
    (directory / "rootfs" / "opt" / "app" / "hello.txt").write_text(TEMPLATE_FILE_TEXT)
    return base


# -- the well-behaved sibling --------------------------------------------------------------------

SIBLING_JOB = f"""
import json, os, time
rows = json.load(open(os.environ["JOB_INPUT"]))["rows"]
time.sleep(0.5)  # overlap with the hostile neighbour
print("sibling done; token {FAKE_TOKEN}")
json.dump(
    {{"n": len(rows), "sum_sq": sum(r * r for r in rows), "hello": open("{TEMPLATE_FILE}").read()}},
    open(os.environ["JOB_RESULT"], "w"),
)
"""


def sibling_rows(i: int) -> list[int]:
    return list(range(i, i + 50))


def sibling_expected(i: int) -> dict[str, Any]:
    rows = sibling_rows(i)
    return {"n": len(rows), "sum_sq": sum(r * r for r in rows), "hello": TEMPLATE_FILE_TEXT}


# -- the hostile jobs ----------------------------------------------------------------------------

DECOMPRESSION_BOMB = """
import zlib
bomb = open("bomb.z", "rb").read()          # 64 KiB that inflates to 64 MiB
print("bomb is", len(bomb), "bytes", flush=True)
inflated = []
for i in range(100):                         # 6.4 GiB if nothing stops it
    inflated.append(zlib.decompress(bomb))
print("inflated everything: no wall", flush=True)
"""

THREADS = """
import threading, time
started = 0
stop = threading.Event()
try:
    for i in range(5000):
        threading.Thread(target=stop.wait, daemon=True).start()
        started += 1
finally:
    print("threads started:", started, flush=True)
"""

HOT_LOOP = "while True:\n    pass\n"

EXP_REGEX = """
import re
print("matching", flush=True)
re.match(r"(a+)+$", "a" * 64 + "b")
print("regex finished: no wall", flush=True)
"""


def _fill(path: str) -> str:
    return f"""
import os
chunk = b"x" * (1 << 20)
written = 0
try:
    with open("{path}", "wb") as f:
        for i in range(4 * 1024):            # 4 GiB if nothing stops it
            f.write(chunk)
            written += 1
        f.flush()
        os.fsync(f.fileno())
finally:
    print("MiB written:", written, flush=True)
"""


FILES_UNTIL_LIMIT = """
import os
fds = []
try:
    while True:
        fds.append(os.open("/dev/null", os.O_RDONLY))
finally:
    print("files opened:", len(fds), flush=True)
"""

SOCKETS_UNTIL_LIMIT = """
import socket
socks = []
try:
    while True:
        socks.append(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
        if len(socks) % 2:
            socks.extend(socket.socketpair())
finally:
    print("sockets opened:", len(socks), flush=True)
"""

RESULT_BOMB = """
import os
with open(os.environ["JOB_RESULT"], "w") as f:   # 24 MiB of JSON aimed at the orchestrator
    f.write("[" + ",".join(["1" * 1000] * 24 * 1024) + "]")
"""

KILL_EVERYTHING = """
import os, signal
print("killing every process I can see", flush=True)
os.kill(-1, signal.SIGKILL)
"""


@dataclass(frozen=True)
class Hostile:
    """One hostile case: what it tries, the outcome and class the project documents for it."""

    name: str
    tries: str
    code: str
    kind: FailureKind
    guarantee: str
    timeout: float = 30.0
    files: dict[str, bytes] = field(default_factory=dict)
    # A line the job prints before the wall stops it; its number must stay under ``wall``.
    counter: str | None = None
    wall: int | None = None
    stderr_has: str | None = None

    @property
    def failure_class(self) -> FailureClass:
        if self.kind in (
            FailureKind.PERMANENT_EXIT_CODE,
            FailureKind.RESULT_MISSING,
            FailureKind.RESULT_INVALID,
            FailureKind.RESULT_TOO_LARGE,
        ):
            return FailureClass.DEAD_LETTER
        return FailureClass.REDELIVER


def decompression_bomb_file() -> bytes:
    import zlib

    return zlib.compress(b"\0" * (64 << 20), 9)


HOSTILE_CASES = [
    Hostile(
        "memory_hog",
        "allocate 64 MiB blocks forever (past the template's 256 MB)",
        (TENANTS / "evil_memory_hog.py").read_text(),
        FailureKind.EXIT_CODE,
        "OOM-killed inside its own cgroup: exit 137, redeliver",
    ),
    Hostile(
        "decompression_bomb",
        "inflate a 64 KiB zlib bomb 100 times in memory (6.4 GiB)",
        DECOMPRESSION_BOMB,
        FailureKind.EXIT_CODE,
        "OOM-killed inside its own cgroup: exit 137, redeliver",
    ),
    Hostile(
        "fork_bomb",
        "fork forever, ignoring EAGAIN",
        (TENANTS / "evil_fork_bomb.py").read_text(),
        FailureKind.TIMEOUT,
        "pids.max (64) stops it; the guest clock kills the whole group: timeout, redeliver",
        timeout=4,
    ),
    Hostile(
        "threads",
        "start 5,000 threads",
        THREADS,
        FailureKind.EXIT_CODE,
        "pids.max (64) stops it at < 64 threads: the job fails, redeliver",
        counter="threads started:",
        wall=64,
        stderr_has="can't start new thread",
    ),
    Hostile(
        "hot_loop",
        "spin a CPU hot loop past its timeout",
        HOT_LOOP,
        FailureKind.TIMEOUT,
        "killed at its timeout (guest clock): timeout, redeliver; CPU quota 1 core",
        timeout=3,
    ),
    Hostile(
        "exponential_regex",
        "match (a+)+$ against 64 a's and a b (catastrophic backtracking)",
        EXP_REGEX,
        FailureKind.TIMEOUT,
        "killed at its timeout: timeout, redeliver",
        timeout=3,
    ),
    Hostile(
        "fill_tmp",
        "write a 4 GiB file to /tmp",
        _fill("/tmp/fill.bin"),
        FailureKind.EXIT_CODE,
        "the 128 MB tmpfs cap stops it (ENOSPC): the job fails, redeliver",
        counter="MiB written:",
        wall=129,
        stderr_has="No space left on device",
    ),
    Hostile(
        "fill_work",
        "write a 4 GiB file to /work",
        _fill("/work/fill.bin"),
        FailureKind.EXIT_CODE,
        "the 128 MB tmpfs cap stops it (ENOSPC): the job fails, redeliver",
        counter="MiB written:",
        wall=129,
        stderr_has="No space left on device",
    ),
    Hostile(
        "open_files",
        "open files until something stops it",
        FILES_UNTIL_LIMIT,
        FailureKind.EXIT_CODE,
        "RLIMIT_NOFILE (128) stops it (EMFILE): the job fails, redeliver",
        counter="files opened:",
        wall=128,
        stderr_has="Too many open files",
    ),
    Hostile(
        "open_sockets",
        "open TCP sockets and socket pairs until something stops it",
        SOCKETS_UNTIL_LIMIT,
        FailureKind.EXIT_CODE,
        "RLIMIT_NOFILE (128) stops it (EMFILE): the job fails, redeliver",
        counter="sockets opened:",
        wall=128,
        stderr_has="Too many open files",
    ),
    Hostile(
        "result_bomb",
        "exit 0 with a 24 MiB result.json (past the 16 MiB cap)",
        RESULT_BOMB,
        FailureKind.RESULT_TOO_LARGE,
        "the size is checked before reading: result_too_large, dead-letter; the orchestrator never loads it",
    ),
    Hostile(
        "kill_everything",
        "kill(-1, SIGKILL): every process it can see",
        KILL_EVERYTHING,
        FailureKind.SANDBOX_LOST,
        "only its own sandbox's processes die: the sandbox is lost, redeliver; host untouched",
    ),
]
HOSTILE = {case.name: case for case in HOSTILE_CASES}


def hostile_files(case: Hostile) -> dict[str, bytes | str]:
    files: dict[str, bytes | str] = {"job.py": case.code}
    if case.name == "decompression_bomb":
        files["bomb.z"] = decompression_bomb_file()
    return files


def counted(text: str, prefix: str) -> int | None:
    for line in text.splitlines():
        if line.startswith(prefix):
            return int(line.split(prefix, 1)[1].split()[0])
    return None


# -- the escape probe ----------------------------------------------------------------------------

ESCAPE_PROBE = """
import json, os, signal, socket

cfg = json.load(open(os.environ["JOB_INPUT"]))
markers = cfg["markers"]
seen = {}
# Everything this job can see of anyone's environment.
env_text = "\\n".join(f"{k}={v}" for k, v in os.environ.items())
for pid in (p for p in os.listdir("/proc") if p.isdigit()):
    try:
        env_text += "\\n" + open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace")
    except OSError:
        pass
seen["env_text"] = env_text
seen["env_markers"] = [m for m in markers if m in env_text]
pids = [p for p in os.listdir("/proc") if p.isdigit()]
seen["pid_count"] = len(pids)
cmdlines = []
for pid in pids:
    try:
        cmdlines.append(open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\\0", b" ").decode())
    except OSError:
        pass
seen["host_cmdlines"] = [c for c in cmdlines if any(w in c for w in cfg["host_words"])]
seen["host_env"] = [w for w in cfg["host_words"] + cfg["host_env_words"] if w in env_text]
readable = []
for path in cfg["read_paths"]:
    try:
        if os.path.isdir(path):
            os.listdir(path)
        else:
            open(path, "rb").read(1)
        readable.append(path)
    except OSError:
        pass
seen["readable"] = readable
found = []
for top in ("/", "/proc/1/root"):
    for root, dirs, files in os.walk(top):
        dirs[:] = [d for d in dirs if os.path.join(root, d) not in ("/proc", "/sys", "/usr", "/dev")]
        found += [os.path.join(root, f) for f in files if cfg["sibling_token"] in f]
for pid in pids:
    try:
        found += [f for f in os.listdir(f"/proc/{pid}/root/work") if cfg["sibling_token"] in f]
    except OSError:
        pass
seen["sibling_files"] = found
connected = []
for host, port in cfg["tcp"]:
    s = socket.socket()
    s.settimeout(1.0)
    try:
        s.connect((host, port))
        connected.append(f"{host}:{port}")
    except OSError:
        pass
    finally:
        s.close()
try:
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    u.settimeout(1.0)
    query = bytes.fromhex("12340100000100000000000000000100" "01")
    u.sendto(query, ("8.8.8.8", 53))
    u.recvfrom(512)
    connected.append("udp:8.8.8.8:53")
except OSError:
    pass
seen["connected"] = connected
written = []
for path in cfg["write_paths"]:
    try:
        with open(path, "w") as f:
            f.write("escaped")
        written.append(path)
    except OSError:
        pass
seen["written_inside"] = written
killed = []
for pid in cfg["kill_pids"]:
    try:
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)
    except OSError:
        pass
seen["killed"] = killed
json.dump(seen, open(os.environ["JOB_RESULT"], "w"))
"""

SIBLING_WITH_SECRET = """
import json, os, sys, time
token = sys.argv[1]
for d in ("/work", "/tmp", "/root"):
    open(f"{d}/secret-{token}", "w").write("sibling secret")
print("secret written", flush=True)
time.sleep(float(sys.argv[2]))
json.dump({"sibling": "ok"}, open(os.environ["JOB_RESULT"], "w"))
"""


class FakeListener:
    """A TCP listener on all interfaces standing in for an orchestrator API (Airflow, Prefect).

    ``accepted()`` says whether anything connected: a sandbox that reached it is a breach.
    """

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("0.0.0.0", 0))
        self.sock.listen(16)
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]

    def accepted(self) -> int:
        n = 0
        while True:
            try:
                conn, _ = self.sock.accept()
            except BlockingIOError:
                return n
            conn.close()
            n += 1

    def close(self) -> None:
        self.sock.close()


def host_ip() -> str | None:
    """A non-loopback address of this host, if it has one."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("10.255.255.255", 1))  # no packet is sent: this only picks a route
        ip = s.getsockname()[0]
        if not ip.startswith("127."):
            return str(ip)
    return None


# -- the host side -------------------------------------------------------------------------------


@dataclass
class SandboxTrace:
    """What the host saw of one sandbox while it lived: its bwrap process and identity."""

    sandbox_id: str
    bwrap_pid: int | None = None
    bwrap_start: str | None = None


class HostProbe:
    """Looks at the host for anything a sandbox of ``server`` left behind."""

    def __init__(self, server: Any) -> None:
        self.server = server
        instance = hashlib.sha256(str(Path(server.state_dir).resolve()).encode()).hexdigest()[:12]
        self.base_name = f"pandastack-local-{instance}"
        self.cgroup_bases = self._cgroup_bases()
        self.lock = threading.Lock()

    def _cgroup_bases(self) -> list[Path]:
        bases = []
        try:
            lines = Path(f"/proc/{self.server.pid}/cgroup").read_text().splitlines()
        except OSError:
            return []
        for line in lines:
            _, ctrls, path = line.split(":", 2)
            names = ctrls.split(",") if ctrls else [""]
            for name in names:
                root = Path("/sys/fs/cgroup") / name.removeprefix("name=") if name else Path("/sys/fs/cgroup")
                candidate = Path(str(root) + path.rstrip("/")) / self.base_name
                if candidate.is_dir():
                    bases.append(candidate)
        return sorted(set(bases))

    def trace(self, sandbox_id: str) -> SandboxTrace:
        """Record the sandbox's bwrap process (call while it is alive, e.g. from ``on_created``)."""
        trace = SandboxTrace(sandbox_id)
        record = Path(self.server.state_dir) / "sandboxes" / sandbox_id / "record.json"
        with contextlib.suppress(OSError, ValueError, KeyError):
            trace.bwrap_pid = int(json.loads(record.read_text())["pid"])
            trace.bwrap_start = starttime(trace.bwrap_pid)
        return trace

    def alive(self, trace: SandboxTrace) -> bool:
        return trace.bwrap_pid is not None and starttime(trace.bwrap_pid) == trace.bwrap_start

    def leftovers(self, trace: SandboxTrace, markers: tuple[str, ...] = ()) -> list[str]:
        """Everything of the sandbox still on the host: processes, cgroups, its dir, mounts."""
        sid = trace.sandbox_id
        problems = []
        if self.alive(trace):
            problems.append(f"bwrap process {trace.bwrap_pid} still running")
        if (Path(self.server.state_dir) / "sandboxes" / sid).exists():
            problems.append("host dir still exists")
        for base in self.cgroup_bases:
            if (base / sid).exists():
                problems.append(f"cgroup {base / sid} still exists")
        if pids_matching(sid):
            problems.append(f"host processes naming it: {pids_matching(sid)}")
        for marker in markers:
            if pids_matching(marker):
                problems.append(f"host processes matching {marker!r}: {pids_matching(marker)}")
        with open("/proc/self/mountinfo") as f:
            if sid in f.read():
                problems.append("a mount names it")
        return problems

    def wait_clean(
        self, trace: SandboxTrace, markers: tuple[str, ...] = (), timeout: float = 15
    ) -> list[str]:
        deadline = time.monotonic() + timeout
        while True:
            problems = self.leftovers(trace, markers)
            if not problems or time.monotonic() > deadline:
                return problems
            time.sleep(0.1)


class Recorder:
    """``on_created`` for the core: remembers a trace of every sandbox a job made."""

    def __init__(self, host: HostProbe) -> None:
        self.host = host
        self.traces: list[SandboxTrace] = []
        self.lock = threading.Lock()

    def __call__(self, sandbox_id: str) -> None:
        trace = self.host.trace(sandbox_id)
        with self.lock:
            self.traces.append(trace)


def secret_free(text: str, *secrets: str) -> list[str]:
    """The secrets that appear in ``text`` (empty when clean)."""
    return [s for s in secrets if s and s in text]


def outcome_text(outcome: JobOutcome) -> str:
    return json.dumps(
        {
            **outcome.summary(),
            "stdout": outcome.stdout_tail,
            "stderr": outcome.stderr_tail,
            "result": outcome.result,
        },
        default=str,
    )


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
