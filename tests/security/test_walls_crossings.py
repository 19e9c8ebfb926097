"""The five crossings a hostile-tenant review found (issue 12): each one attacked through the real SDK.

Each test restores what it touched on the host, so a wall that fails cannot break the machine.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.server import GVISOR

DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
HOST_INFO_FILES = ("kpagecgroup", "kpageflags", "kpagecount", "keys", "key-users", "slabinfo")
KEY_SPEC_SESSION, KEY_SPEC_USER = -3, -4
KEYCTL_GET_KEYRING_ID, KEYCTL_DESCRIBE, KEYCTL_READ, KEYCTL_INVALIDATE = 0, 6, 11, 21
_libc = ctypes.CDLL(None, use_errno=True)
# x86_64 numbers: the suite runs on the host the server runs on.
SYS_ADD_KEY, SYS_KEYCTL = 248, 250


def _keyctl(*args: Any) -> int:
    res = int(_libc.syscall(SYS_KEYCTL, *args))
    if res < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return res


def _add_key(description: str, payload: bytes, ring: int) -> int:
    res = int(
        _libc.syscall(
            SYS_ADD_KEY, b"user", description.encode(), payload, ctypes.c_size_t(len(payload)), ring
        )
    )
    if res < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return res


def _ring_members(ring: int) -> list[int]:
    buf = ctypes.create_string_buffer(65536)
    try:
        n = _keyctl(KEYCTL_READ, ring, buf, ctypes.c_size_t(len(buf)))
    except OSError:
        return []
    return list((ctypes.c_int32 * (min(n, len(buf)) // 4)).from_buffer_copy(buf.raw[: n // 4 * 4]))


def _describe(key: int) -> str:
    buf = ctypes.create_string_buffer(4096)
    try:
        n = _keyctl(KEYCTL_DESCRIBE, key, buf, ctypes.c_size_t(len(buf)))
    except OSError:
        return ""
    return buf.raw[: max(n - 1, 0)].decode(errors="replace")


def _root_key_bytes() -> int:
    """Bytes of key payload charged to host root (``/proc/key-users``)."""
    for line in Path("/proc/key-users").read_text().splitlines():
        uid, _, rest = line.strip().partition(":")
        if uid == "0":
            return int(rest.split()[-1].split("/")[0])
    return 0


def _invalidate_keys_named(token: str) -> None:
    """Remove every key whose description holds ``token`` from this process's session and user rings."""
    for ring in (KEY_SPEC_SESSION, KEY_SPEC_USER):
        for key in _ring_members(ring):
            if token in _describe(key):
                try:
                    _keyctl(KEYCTL_INVALIDATE, key)
                except OSError:
                    pass


# ---- crossing 1: host device nodes -------------------------------------------------------------
DEVICE_ATTACK = r"""
import json, os, subprocess
out = {}
for name in %(devices)r:
    path = "/dev/" + name
    tries = {}
    for label, fn in (
        ("chmod", lambda: os.chmod(path, 0)),
        ("chown", lambda: os.chown(path, 1, 1)),
        ("utime_past", lambda: os.utime(path, (978307200, 978307200))),
        ("utime_now", lambda: os.utime(path, None)),
    ):
        try:
            fn()
            tries[label] = "changed"
        except OSError as exc:
            tries[label] = exc.strerror
    tries["touch"] = subprocess.run(["touch", path], capture_output=True).returncode
    out[name] = tries
print(json.dumps(out))
"""


def _device_state(name: str) -> tuple[int, int, int, int]:
    st = os.stat(f"/dev/{name}")
    return st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns


@pytest.fixture
def device_guard() -> Iterator[dict[str, tuple[int, int, int, int]]]:
    """Record the host's device nodes; put back mode, owner and times afterwards if anything changed."""
    saved = {name: _device_state(name) for name in DEVICES if Path(f"/dev/{name}").exists()}
    times = {name: (os.stat(f"/dev/{name}").st_atime_ns, saved[name][3]) for name in saved}
    yield saved
    for name, (mode, uid, gid, _mtime) in saved.items():
        path = f"/dev/{name}"
        if _device_state(name) != saved[name]:
            os.chown(path, uid, gid)
            os.chmod(path, mode & 0o7777)
            os.utime(path, ns=times[name])


def test_host_device_nodes_cannot_be_changed(security_client, sandbox, run_script, device_guard) -> None:
    report = run_script(sandbox, DEVICE_ATTACK % {"devices": tuple(device_guard)})
    after = {name: _device_state(name) for name in device_guard}
    assert after == device_guard, f"host device nodes changed by a sandbox: {report}"
    # A later sandbox still starts and uses /dev/null normally. (Under gVisor the attacked
    # sandbox's /dev is the sentry's own, not the host's: its root may chmod its own /dev/null,
    # which breaks that sandbox alone, so the check runs in a fresh one.)
    later = security_client.sandboxes.create(template="small") if GVISOR else sandbox
    try:
        assert later.exec("echo x > /dev/null && head -c 4 /dev/zero | wc -c").stdout.strip() == "4"
    finally:
        if later is not sandbox:
            later.kill()


# ---- crossing 3: kernel keyring ----------------------------------------------------------------
KEYRING_ATTACK = r"""
import ctypes, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
ADD_KEY, KEYCTL = 248, 250
key_id, ring_id, token = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
def call(nr, *args):
    r = libc.syscall(nr, *args)
    return r if r >= 0 else "errno %d" % ctypes.get_errno()
buf = ctypes.create_string_buffer(4096)
out = {
    "read_host_key": call(KEYCTL, 11, key_id, buf, ctypes.c_size_t(4096)),
    "host_key_payload": buf.raw[:64].rstrip(b"\0").decode(errors="replace"),
    "link_host_ring": call(KEYCTL, 8, ring_id, -3),
    "clear_host_ring": call(KEYCTL, 7, ring_id),
    "search_user_ring": call(KEYCTL, 10, -4, b"user", ("pandastack-wall-" + token).encode(), 0),
}
payload = b"q" * 32000
added = 0
for i in range(1200):
    r = call(ADD_KEY, b"user", ("pandastack-wall-%s-%d" % (token, i)).encode(), payload,
             ctypes.c_size_t(len(payload)), -3)
    if not isinstance(r, int):
        out["add_key_stopped"] = r
        break
    added += 1
out["added"] = added
print(json.dumps(out))
"""


@pytest.fixture
def planted_host_key() -> Iterator[tuple[int, int, str, bytes]]:
    """A secret key in a keyring of host root's user keyring; removed (with anything a sandbox
    planted under the same token) afterwards."""
    token = secrets.token_hex(6)
    secret = b"host-secret-" + token.encode()
    ring = int(
        _libc.syscall(
            SYS_ADD_KEY,
            b"keyring",
            f"pandastack-wall-ring-{token}".encode(),
            None,
            ctypes.c_size_t(0),
            KEY_SPEC_USER,
        )
    )
    assert ring > 0, os.strerror(ctypes.get_errno())
    key = _add_key(f"pandastack-wall-{token}", secret, ring)
    try:
        yield key, ring, token, secret
    finally:
        for member in (key, ring):
            try:
                _keyctl(KEYCTL_INVALIDATE, member)
            except OSError:
                pass
        _invalidate_keys_named(token)


def test_host_keyring_is_unreachable_and_quota_untouched(sandbox, run_script, planted_host_key) -> None:
    key, ring, token, secret = planted_host_key
    baseline = _root_key_bytes()
    report = run_script(sandbox, KEYRING_ATTACK, key, ring, token)
    assert secret.decode() not in report["host_key_payload"], report
    assert not isinstance(report["read_host_key"], int), report
    assert not isinstance(report["link_host_ring"], int), report
    assert not isinstance(report["clear_host_ring"], int), report
    assert not isinstance(report["search_user_ring"], int), report
    # The host's key is still there, and host root can still add keys (its quota is untouched).
    assert key in _ring_members(ring)
    probe = _add_key(f"pandastack-wall-probe-{token}", b"p" * 32000, ring)
    assert probe > 0
    _keyctl(KEYCTL_INVALIDATE, probe)
    # Nothing the sandbox planted is charged to host root once it is gone.
    sandbox.kill()
    deadline = time.monotonic() + 10
    while _root_key_bytes() > baseline + 64 * 1024 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _root_key_bytes() <= baseline + 64 * 1024, report


# ---- crossing 4: per-user kernel limits --------------------------------------------------------
INOTIFY_HOG = r"""
import ctypes, json, os, time
libc = ctypes.CDLL(None, use_errno=True)
fds = []
while len(fds) < 100000:
    fd = libc.inotify_init1(0)
    if fd < 0:
        err = ctypes.get_errno()
        break
    fds.append(fd)
if fds:  # room for the report's own descriptor (gVisor: RLIMIT_NOFILE is the only wall)
    os.close(fds.pop())
with open("/work/inotify.tmp", "w") as f:
    json.dump({"opened": len(fds), "errno": err}, f)
os.rename("/work/inotify.tmp", "/work/inotify.json")
time.sleep(120)
"""


def _host_inotify_ok() -> bool:
    fd = int(_libc.inotify_init1(0))
    if fd < 0:
        return False
    os.close(fd)
    return True


def test_per_user_limits_are_not_shared_with_the_host(
    security_client, security_server, sandbox, run_script
) -> None:
    assert _host_inotify_ok()
    sandbox.filesystem.write("/work/hog.py", INOTIFY_HOG)
    sandbox.exec("nohup python3 /work/hog.py >/dev/null 2>&1 &")
    deadline = time.monotonic() + 30
    while not sandbox.filesystem.exists("/work/inotify.json"):
        assert time.monotonic() < deadline, "the inotify hog did not report"
        time.sleep(0.1)
    report = sandbox.filesystem.read("/work/inotify.json").decode()
    assert '"opened": 0' not in report, report
    # The sandbox holds every instance its user may have: the host and a neighbour are unaffected.
    host_ok = _host_inotify_ok()
    neighbour = security_client.sandboxes.create(template="small")
    try:
        probe = "import ctypes; print(ctypes.CDLL(None).inotify_init1(0) >= 0)"
        neighbour_ok = neighbour.exec(f'python3 -c "{probe}"').stdout.strip() == "True"
    finally:
        neighbour.kill()
    sandbox.kill()  # releases the instances whatever the outcome
    assert host_ok, f"host root lost inotify to a sandbox ({report})"
    if security_server.uid() == 0:
        # Only a root server gives each sandbox its own uid; a non-root server's sandboxes share
        # its uid and so its per-user limits (docs/local-server.md, "which walls need root").
        assert neighbour_ok, f"a neighbour sandbox lost inotify to another ({report})"


# ---- crossing 5: host information files --------------------------------------------------------
@pytest.mark.parametrize("name", HOST_INFO_FILES)
def test_host_information_files_are_unreadable(sandbox, name) -> None:
    if not Path(f"/proc/{name}").exists():
        pytest.skip(f"/proc/{name} does not exist on this kernel")
    result = sandbox.exec(f"head -c 256 /proc/{name} 2>/dev/null | wc -c")
    # Readable means bytes came out: every one of these files has content on the host.
    assert result.stdout.strip() in ("", "0"), f"/proc/{name} is readable: {result}"


def test_host_keys_are_not_listed(sandbox, planted_host_key) -> None:
    _key, _ring, token, _secret = planted_host_key
    listing = sandbox.exec("cat /proc/keys /proc/key-users 2>&1").stdout
    assert token not in listing
