"""Kernel resources a sandbox can allocate (issue 23): each is charged to the sandbox or denied.

Crossings 7, 8, 9, 10, 18 and 19 of the hostile-tenant review, attacked through the real SDK.
The floods run in a sandbox of a small template (128 MB) that tries to queue eight times its
memory limit in socket buffers, bounded in bytes and seconds; the test watches the host's
MemAvailable meanwhile, and deletes the sandbox after (everything it queued is freed with it).
Where a backend answers differently (gVisor's sentry implements the sockets itself, in memory
charged to the sandbox's cgroup), each backend's outcome is asserted.
"""

from __future__ import annotations

import contextlib
import errno
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandastack
import pytest

from pandastack_local import LocalServer
from tests.security.conftest import private_server
from tests.support.server import GVISOR, fail_on_leftovers

FLOOD_TEMPLATE = {"name": "flood", "cpu": 1, "memory_mb": 128, "disk_mb": 32, "pids_max": 64, "nofile": 256}
MIB = 1024 * 1024
# What the host may lose beyond the sandbox's memory limit while it floods (the server's own
# bookkeeping, page cache churn, and at most one guard interval of an uncharged flood).
SLACK_MB = 64
# Every flood tries to queue eight times the limit, spread over this many processes (each has
# RLIMIT_NOFILE 256 of its own), within this many seconds; it then holds what it got for a while.
FLOOD_TARGET = 8 * FLOOD_TEMPLATE["memory_mb"] * MIB
FLOOD_WORKERS = 12
FLOOD_SECONDS = 8.0
FLOOD_HOLD_SECONDS = 3.0
DENIED_FAMILY = {errno.EAFNOSUPPORT, errno.EPERM}

FLOOD = r"""
import errno, json, os, socket, struct, sys, time
kind, target, workers = sys.argv[1], int(sys.argv[2]), int(sys.argv[5])
seconds, hold = float(sys.argv[3]), float(sys.argv[4])
CHUNK = 60000
RTM_GETLINK, NLM_F_REQUEST_ACK = 18, 0x5

def fill(sock, data, cap):
    sent = 0
    while sent < cap:
        try:
            sent += sock.send(data)
        except (BlockingIOError, InterruptedError):
            break
        except OSError:
            break
    return sent

def one(kind, cap, held):
    # One more socket (pair) of the kind, made to queue up to cap bytes; returns bytes queued.
    if kind == "netlink_usersock":
        r = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 2)
        w = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 2)
        held += [r, w]
        r.bind((0, 0)); w.bind((0, 0)); w.setblocking(False)
        w.connect((r.getsockname()[0], 0))
        return fill(w, b"n" * CHUNK, cap)
    if kind == "netlink_route":
        # Requests the kernel refuses, each echoed whole in its error ack, never read.
        s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)
        held.append(s)
        s.bind((0, 0)); s.setblocking(False)
        body = bytes(16) + b"g" * (CHUNK - 32)
        sent = 0
        for seq in range(8):
            try:
                header = struct.pack("=IHHII", 16 + len(body), RTM_GETLINK, NLM_F_REQUEST_ACK, seq, 0)
                sent += s.send(header + body)
            except OSError:
                break
        return sent
    if kind == "tcp":
        if not held:
            listener = socket.socket(); listener.bind(("127.0.0.1", 0)); listener.listen(512)
            held.append(listener)
        c = socket.create_connection(held[0].getsockname()); s, _ = held[0].accept()
        held += [c, s]
        c.setblocking(False)
        return fill(c, b"t" * CHUNK, cap)
    if kind == "udp":
        r = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        w = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        held += [r, w]
        r.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 24); r.bind(("127.0.0.1", 0))
        w.setblocking(False); w.connect(r.getsockname())
        return fill(w, b"u" * CHUNK, min(cap, 8 << 20))
    if kind == "unix":
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        held += [a, b]
        a.setblocking(False); b.setblocking(False)
        return fill(a, b"x" * CHUNK, cap) + fill(b, b"y" * CHUNK, cap)
    raise SystemExit("unknown flood " + kind)

def worker(i, budget, deadline):
    held, queued, error, made = [], 0, "", 0
    while queued < budget and time.monotonic() < deadline:
        try:
            queued += one(kind, budget - queued, held)
            made += 1
        except OSError as exc:
            error = errno.errorcode.get(exc.errno, str(exc))
            break
    with open("/work/flood-%d.json" % i, "w") as f:
        json.dump({"queued": queued, "made": made, "error": error}, f)
    time.sleep(max(0.0, deadline + hold - time.monotonic()))  # hold it all while the host is measured
    os._exit(0)

start = time.monotonic()
pids = []
for i in range(workers):
    pid = os.fork()
    if pid == 0:
        worker(i, target // workers, start + seconds)
    pids.append(pid)
killed = 0
for pid in pids:
    _, status = os.waitpid(pid, 0)
    killed += os.WIFSIGNALED(status)
reports = []
for i in range(workers):
    try:
        with open("/work/flood-%d.json" % i) as f:
            reports.append(json.load(f))
    except (OSError, ValueError):
        pass
print(json.dumps({
    "queued": sum(r["queued"] for r in reports), "made": sum(r["made"] for r in reports),
    "errors": sorted({r["error"] for r in reports if r["error"]}), "killed": killed,
}))
"""


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemAvailable in /proc/meminfo")


V1_MEMORY = Path("/sys/fs/cgroup/memory")


def _anon_bytes(cgroup: Path) -> int:
    """Memory charged to a v1 memory cgroup and its children that the kernel cannot just drop
    (anonymous and tmpfs pages; not page cache, which MemAvailable counts as available)."""
    try:
        stat = dict(line.split() for line in (cgroup / "memory.stat").read_text().splitlines())
    except (OSError, ValueError):  # the sandbox is gone, and its cgroup with it
        return 0
    return int(stat.get("total_rss", 0)) + int(stat.get("total_shmem", 0))


class HostMemory:
    """What the host has left, as far as one sandbox can change it: MemAvailable, plus what every
    other cgroup took meanwhile. Another test suite on the same host moves MemAvailable by
    hundreds of MiB; on cgroup v1 the root memory cgroup says how much of that went to someone
    else, so the sandbox's own memory and what no cgroup charges are what move ``free()``.
    (Elsewhere it is MemAvailable alone.)"""

    def __init__(self, sandbox_id: str) -> None:
        own = list(V1_MEMORY.rglob(sandbox_id)) if (V1_MEMORY / "memory.stat").exists() else []
        self.own = own[0] if own else None

    def free(self) -> int:
        if self.own is None:
            return _mem_available()
        return _mem_available() + _anon_bytes(V1_MEMORY) - _anon_bytes(self.own)

    def quiet(self, seconds: float = 2.0) -> tuple[int, int]:
        """(median of ``free()``, how far it moved) over ``seconds`` with the sandbox idle."""
        samples = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            samples.append(self.free())
            time.sleep(0.02)
        samples.sort()
        return samples[len(samples) // 2], samples[-1] - samples[0]


@pytest.fixture(scope="module")
def flood_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    with private_server(tmp_path_factory, **FLOOD_TEMPLATE) as server:
        yield server


@dataclass
class Flooded:
    report: dict[str, Any] | None  # None: the sandbox died (gVisor: the sentry's OOM kill)
    meter: HostMemory
    baseline: int  # HostMemory.free() before, the sandbox idle
    noise: int  # how far it moved meanwhile, by itself
    drop: int  # the most it fell below the baseline while the flood ran


def _flood(sb: Any, kind: str) -> Flooded:
    """Run flood ``kind`` in ``sb`` while watching what the host has left."""
    sb.filesystem.write("/work/flood.py", FLOOD)
    meter = HostMemory(sb.id)
    baseline, noise = meter.quiet()
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["exec"] = sb.exec(
                f"python3 /work/flood.py {kind} {FLOOD_TARGET} {FLOOD_SECONDS} {FLOOD_HOLD_SECONDS} "
                f"{FLOOD_WORKERS}",
                timeout_seconds=int(FLOOD_SECONDS + FLOOD_HOLD_SECONDS + 30),
            )
        except pandastack.PandastackError as exc:  # gVisor: the sentry may be OOM-killed
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    lowest = baseline
    while thread.is_alive():
        lowest = min(lowest, meter.free())
        time.sleep(0.01)
    thread.join()
    report: dict[str, Any] | None = None
    if "exec" in result:
        out = result["exec"]
        lines = out.stdout.strip().splitlines()
        if out.exit_code == 0 and lines:
            report = json.loads(lines[-1])
        else:  # the flood itself was killed (the socket guard, or the OOM killer)
            report = {"exit_code": out.exit_code, "stderr": out.stderr[-500:]}
    return Flooded(report, meter, baseline, noise, baseline - lowest)


def _allowed(flooded: Flooded) -> int:
    return (FLOOD_TEMPLATE["memory_mb"] + SLACK_MB) * MIB + flooded.noise


def _unfreed(sb: Any, flooded: Flooded) -> int:
    """Delete the sandbox and wait (up to 15 s) until the host has back what it queued: the bytes
    still missing then (0: all back)."""
    sb.kill()
    floor = flooded.baseline - SLACK_MB * MIB - flooded.noise
    deadline = time.monotonic() + 15
    while (left := flooded.meter.free()) < floor and time.monotonic() < deadline:
        time.sleep(0.2)
    return max(0, flooded.baseline - left) if left < floor else 0


def flood_within_limit(server: LocalServer, kind: str) -> Flooded:
    """Flood ``kind`` in a fresh sandbox and assert the host lost at most its limit plus slack,
    and got it all back once the sandbox was deleted. A flood past the bound runs again, up to
    three runs: a neighbour's burst of memory (other suites beside this one) lands in one run, a
    leak in every one. A flood refused before it queued a byte (its report says so) cost the host
    nothing of its own: only its refusal is asserted, by the caller (measuring the host then
    measures the neighbours alone)."""
    client = server.client()
    try:
        for attempt in (1, 2, 3):
            sb = client.sandboxes.create(template="flood")
            try:
                flooded = _flood(sb, kind)
                if (
                    flooded.report is not None
                    and flooded.report.get("queued") == 0
                    and not flooded.report.get("made")
                ):
                    return flooded
                within = flooded.drop <= _allowed(flooded)
                # Without a memory cgroup of its own (a non-root server on cgroup v1) the meter is
                # MemAvailable alone: a neighbour's burst after the delete lands here too, once.
                unfreed = _unfreed(sb, flooded) if within else 0
                if (within and not unfreed) or attempt == 3:
                    assert within, (
                        f"{kind}: the host lost {flooded.drop // MIB} MiB while a "
                        f"{FLOOD_TEMPLATE['memory_mb']} MB sandbox flooded (at most "
                        f"{_allowed(flooded) // MIB} MiB allowed: its limit, {SLACK_MB} MiB and the "
                        f"{flooded.noise // MIB} MiB the host moved by itself just before): {flooded.report}"
                    )
                    assert not unfreed, f"{unfreed // MIB} MiB not freed with the sandbox"
                    return flooded
            finally:
                with contextlib.suppress(pandastack.NotFoundError):
                    sb.kill()
    finally:
        fail_on_leftovers(server)
    raise AssertionError("unreachable")


# ---- crossing 7: netlink families other than routing -------------------------------------------
NETLINK_PROBE = r"""
import ctypes, json, socket
libc = ctypes.CDLL(None, use_errno=True)
SYS_SOCKET, AF_NETLINK, SOCK_RAW = 41, 16, 3
PROTOCOLS = {"usersock": 2, "sock_diag": 4, "nflog": 5, "xfrm": 6, "selinux": 7, "iscsi": 8, "audit": 9,
             "fib_lookup": 10, "connector": 11, "netfilter": 12, "ip6_fw": 13, "dnrtmsg": 14,
             "kobject_uevent": 15, "generic": 16, "scsitransport": 18, "ecryptfs": 19, "rdma": 20,
             "crypto": 21, "smc": 22}
# The kernel reads both arguments as 32-bit ints: garbage in the upper half must not slip past.
TRIES = [(name, AF_NETLINK, proto) for name, proto in PROTOCOLS.items()]
TRIES += [("usersock_upper_bits", AF_NETLINK, (1 << 32) | 2),
          ("usersock_domain_upper_bits", (1 << 32) | AF_NETLINK, 2)]
out = {}
for name, domain, proto in TRIES:
    fd = libc.syscall(*(ctypes.c_long(a) for a in (SYS_SOCKET, domain, SOCK_RAW, proto)))
    out[name] = 0 if fd >= 0 else ctypes.get_errno()
    if fd >= 0:
        libc.close(fd)
try:
    out["route_names"] = [n for _, n in socket.if_nameindex()]
except OSError as exc:
    out["route_names"] = exc.errno
print(json.dumps(out))
"""


def test_netlink_families_other_than_routing_are_denied(sandbox, run_script) -> None:
    report = run_script(sandbox, NETLINK_PROBE)
    # Routing works (getifaddrs, if_nameindex, ip): the sandbox's own loopback.
    assert report.pop("route_names") == ["lo"], report
    if GVISOR:
        # The sentry implements routing and uevent netlink itself (in the sandbox's memory);
        # every other protocol is refused there. Nothing reaches the host kernel either way.
        allowed = {name for name, e in report.items() if e == 0}
        assert allowed <= {"kobject_uevent"}, report
        return
    allowed = {name: e for name, e in report.items() if e not in DENIED_FAMILY}
    assert not allowed, f"netlink protocols a job may open (want EAFNOSUPPORT/EPERM): {allowed}"


@pytest.mark.parametrize("kind", ["netlink_usersock", "netlink_route"])
def test_netlink_floods_cost_the_host_at_most_the_memory_limit(flood_server, kind) -> None:
    report = flood_within_limit(flood_server, kind).report
    if kind == "netlink_usersock" and report is not None:
        # Refused at socket(): seccomp under bwrap, the sentry (which has no such protocol) under gVisor.
        assert report.get("errors") == ["EPROTONOSUPPORT" if GVISOR else "EAFNOSUPPORT"], report
        assert report["queued"] == 0, report


# ---- crossing 8 (and the same review for unix sockets): TCP and UDP buffers ----------------------
@pytest.mark.parametrize("kind", ["tcp", "udp", "unix"])
def test_socket_buffer_floods_cost_the_host_at_most_the_memory_limit(flood_server, kind) -> None:
    if "memory" not in flood_server.active_limits():
        # Netlink has the socket guard whatever the cgroups; these are bounded by a memory cgroup.
        pytest.skip("no memory cgroup (a non-root server on cgroup v1): no memory wall, see docs")
    flood_within_limit(flood_server, kind)


# ---- crossing 9: vsock and the other families a job has no business with ------------------------
FAMILY_PROBE = r"""
import ctypes, json, socket
libc = ctypes.CDLL(None, use_errno=True)
SYS_SOCKET, SYS_SOCKETPAIR = 41, 53

def raw_socket(domain, type_, proto=0):
    fd = libc.syscall(*(ctypes.c_long(a) for a in (SYS_SOCKET, domain, type_, proto)))
    if fd >= 0:
        libc.close(fd)
        return 0
    return ctypes.get_errno()

out = {}
for name, domain, type_ in (("vsock", 40, 1), ("packet", 17, 3), ("packet_dgram", 17, 2), ("alg", 38, 5),
                            ("key", 15, 3), ("appletalk", 5, 2), ("x25", 9, 5), ("ax25", 3, 2),
                            ("rds", 21, 5), ("llc", 26, 2), ("can", 29, 3), ("tipc", 30, 5),
                            ("bluetooth", 31, 3), ("xdp", 44, 3), ("mctp", 45, 2), ("qipcrtr", 42, 2),
                            ("unspec", 0, 1), ("past_max", 200, 1),
                            ("vsock_upper_bits", (1 << 32) | 40, 1), ("vsock_negative", -(1 << 32) + 40, 1)):
    out[name] = raw_socket(domain, type_)
pair = (ctypes.c_int * 2)()
r = libc.syscall(ctypes.c_long(SYS_SOCKETPAIR), ctypes.c_long(30), ctypes.c_long(5), ctypes.c_long(0), pair)
out["socketpair_tipc"] = 0 if r == 0 else ctypes.get_errno()
# What a job needs keeps working.
kept = {}
for name, fam, typ in (("unix", socket.AF_UNIX, socket.SOCK_STREAM),
                       ("inet", socket.AF_INET, socket.SOCK_STREAM),
                       ("inet6", socket.AF_INET6, socket.SOCK_DGRAM),
                       ("netlink_route", socket.AF_NETLINK, socket.SOCK_RAW)):
    try:
        socket.socket(fam, typ).close()
        kept[name] = 0
    except OSError as exc:
        kept[name] = exc.errno
a, b = socket.socketpair()
a.sendall(b"ok")
kept["socketpair_unix"] = 0 if b.recv(2) == b"ok" else -1
print(json.dumps({"denied": out, "kept": kept}))
"""


def test_vsock_and_other_unneeded_socket_families_are_denied(sandbox, run_script) -> None:
    report = run_script(sandbox, FAMILY_PROBE)
    assert report["kept"] == {"unix": 0, "inet": 0, "inet6": 0, "netlink_route": 0, "socketpair_unix": 0}, (
        report
    )
    opened = {name: e for name, e in report["denied"].items() if e == 0}
    assert not opened, f"socket families a job could open: {opened}"
    if not GVISOR:
        # The filter's own answer (a family the host kernel lacks would say the same).
        wrong = {n: e for n, e in report["denied"].items() if e not in DENIED_FAMILY}
        assert not wrong, f"not refused with EAFNOSUPPORT or EPERM: {wrong}"


# ---- crossing 10: host information -------------------------------------------------------------
def test_host_paths_kernel_command_line_and_boot_id_are_not_shown(security_server, sandbox) -> None:
    host_cmdline = Path("/proc/cmdline").read_text().strip()
    host_boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    state_dir = str(security_server.state_dir.resolve())
    mountinfo = sandbox.exec("cat /proc/self/mountinfo /proc/self/mounts").stdout
    assert state_dir not in mountinfo, mountinfo
    assert "pandastack-exposed" not in mountinfo and "pandastack-local" not in mountinfo, mountinfo
    init = sandbox.exec(
        "tr '\\0' ' ' </proc/1/cmdline; echo; readlink /proc/1/exe; cat /proc/1/environ"
    ).stdout
    assert "bwrap" not in init and "pandastack-exposed" not in init and state_dir not in init, init
    cmdline = sandbox.exec("cat /proc/cmdline").stdout.strip()
    assert cmdline != host_cmdline and (not host_cmdline or host_cmdline not in cmdline), cmdline
    boot_id = sandbox.exec("cat /proc/sys/kernel/random/boot_id").stdout.strip()
    assert len(boot_id) == 36 and boot_id != host_boot_id, boot_id
    if GVISOR:
        # The sentry's own id; sandboxes restored from one boot image share it (not the host's).
        return
    # Each sandbox is a boot of its own: a neighbour cannot tell it shares a host by the id.
    other = security_server.client().sandboxes.create(template="small")
    try:
        assert other.exec("cat /proc/sys/kernel/random/boot_id").stdout.strip() != boot_id
    finally:
        other.kill()


# ---- crossing 18: the agent is the sandbox's init ----------------------------------------------
ZOMBIES = (
    "for p in /proc/[0-9]*; do s=$(cut -d' ' -f3 $p/stat 2>/dev/null); [ \"$s\" = Z ] && echo $p; done; true"
)


def test_a_timed_out_command_is_not_left_a_zombie(sandbox) -> None:
    for _ in range(2):
        with pytest.raises(pandastack.SandboxTimeout):
            sandbox.exec("sleep 60 & sleep 60 & (sleep 60 &); sleep 60", timeout_seconds=1)
    # Orphans of a job that exited normally are reaped too.
    assert sandbox.exec("(sleep 0.2 &) ; (sh -c 'sleep 0.1 & exit 0' &); echo started").exit_code == 0
    deadline = time.monotonic() + 5
    while (zombies := sandbox.exec(ZOMBIES).stdout.split()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not zombies, f"zombies left in the sandbox: {zombies}"


def test_reaping_orphans_never_steals_an_exit_status(sandbox, security_server) -> None:
    # Execs at once, each leaving orphans behind as it exits with its own status: the agent
    # reaps the orphans, and every exec still reports exactly its own exit code. (Four at a
    # time: each holds five processes, and the small template has 64, the agent's threads included.
    # Without a pids cgroup (a non-root server on v1) the 64 is RLIMIT_NPROC, which counts every
    # task of the server's one uid, its other sandboxes' and its own threads too: one at a time.)
    codes: dict[int, int] = {}
    errors: dict[int, str] = {}
    at_once = 4 if "pids" in security_server.active_limits() else 1

    def one(i: int) -> None:
        try:
            result = sandbox.exec(f"(sleep 0.05 &); (true &); exit {i % 7 + 1}")
        except Exception as exc:
            errors[i] = repr(exc)
            return
        codes[i] = result.exit_code
        if result.stderr:
            errors[i] = result.stderr

    for round_ in range(24 // at_once):
        threads = [threading.Thread(target=one, args=(round_ * at_once + i,)) for i in range(at_once)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert codes == {i: i % 7 + 1 for i in range(24)}, (codes, errors)


AGENT_PID = (
    "for p in /proc/[0-9]*; do tr '\\0' ' ' <$p/cmdline 2>/dev/null "
    "| grep -qE '^/usr/bin/python3 -I -S /.pandastack/agent.pyc? ' && echo ${p#/proc/}; done"
)


def test_signals_from_inside_do_not_stop_the_agent(sandbox) -> None:
    # The agent is the sandbox's init: the kernel drops the signals a job sends it that it has
    # no handler for, so a job cannot stop, interrupt or kill it.
    agent = sandbox.exec(AGENT_PID).stdout.strip()
    assert agent.isdigit(), agent
    state = sandbox.exec(
        f"kill -STOP {agent}; sleep 0.2; cut -d' ' -f3 /proc/{agent}/stat; kill -CONT {agent}"
    )
    if GVISOR:
        # The sentry delivers SIGSTOP to its init (Linux drops it): a stopped agent is the server's
        # deadline to handle (issue 23, crossing 11), not this wall's.
        assert state.stdout.strip() == "T", state
        assert sandbox.exec("echo alive", timeout_seconds=10).stdout == "alive\n"
        return
    assert state.stdout.strip() != "T", f"a job stopped the agent (pid {agent})"
    sandbox.exec(f"for s in INT TERM HUP USR1 QUIT KILL; do kill -$s {agent}; done; sleep 0.2; true")
    assert sandbox.exec("echo alive", timeout_seconds=10).stdout == "alive\n"


# ---- crossing 19: the sandbox's init holds nothing a job can take ------------------------------
INIT_PROBE = r"""
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
SYS_PIDFD_OPEN, SYS_PIDFD_GETFD, SYS_PERSONALITY = 434, 438, 135
out = {"taken": {}}
pidfd = libc.syscall(SYS_PIDFD_OPEN, 1, 0)
out["pidfd_open"] = 0 if pidfd >= 0 else ctypes.get_errno()
if pidfd >= 0:
    for target in range(64):
        fd = libc.syscall(SYS_PIDFD_GETFD, pidfd, target, 0)
        if fd >= 0:
            out["taken"][target] = os.readlink("/proc/self/fd/%d" % fd)
out["readable_links"] = {}
for name in os.listdir("/proc/1/fd"):
    try:
        out["readable_links"][name] = os.readlink("/proc/1/fd/" + name)
    except OSError:
        pass
def personality(value):
    r = libc.syscall(ctypes.c_long(SYS_PERSONALITY), ctypes.c_long(value))
    return r if r >= 0 else -ctypes.get_errno()
out["query"] = personality(0xFFFFFFFF)
out["query_sign_extended"] = personality(-1)
out["read_implies_exec"] = personality(0x0400000)
out["almost_query"] = personality(0xFFFFFFFE)
out["now"] = personality(0xFFFFFFFF)
print(json.dumps(out))
"""


def test_the_sandbox_init_gives_no_descriptor_away(sandbox, run_script) -> None:
    report = run_script(sandbox, INIT_PROBE)
    assert report["taken"] == {}, f"pidfd_getfd took the sandbox init's descriptors: {report}"
    if GVISOR:
        # pidfd_open is not implemented by the sentry (ENOSYS); its /proc shows the agent's
        # links to its own root (the agent holds nothing of the host: its socket is the sentry's).
        # personality(0xffffffff) is not a query there (EINVAL).
        assert report["pidfd_open"] == errno.ENOSYS, report
        return
    assert report["readable_links"] == {}, f"the sandbox init's descriptors can be read: {report}"
    # personality(0xffffffff) only asks: answered with the current persona (PER_LINUX, 0).
    assert report["query"] == 0 and report["query_sign_extended"] == 0, report
    # Setting a persona that weakens memory protection stays refused, however it is spelled.
    assert report["read_implies_exec"] == -errno.EPERM, report
    assert report["almost_query"] == -errno.EPERM, report
    assert report["now"] == 0, report
