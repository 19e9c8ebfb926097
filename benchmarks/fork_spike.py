"""The memory-fork spike's figures (issue 27, item 2; docs/local-server.md, "Memory fork under
bwrap"), measured again by ``benchmarks.warm``:

- ``memory_fork``: a parent with a live Python holding 100 MB forked into one child, N times:
  how long, and whether the child got the process (``memory_copied``, checked in the child);
- ``zygote_floor``: a server-side interpreter holding 100 MB forks, the copy joins a fresh
  memory cgroup and unshares every namespace, its pid 1 runs with the object (root only);
- ``criu``: whether the host's criu can start at all (``criu check``).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmarks.common import summary

MODEL_MB = 100
HOLD = (
    "import time\nmodel = bytearray({mb} << 20)\nmodel[::4096] = b'1' * len(model[::4096])\n"
    "open('/tmp/ready', 'w').write('1')\ntime.sleep(3600)\n"
)
# CLONE_NEWUSER | NEWPID | NEWNS | NEWNET | NEWIPC | NEWUTS | NEWCGROUP
FRESH_NAMESPACES = 0x10000000 | 0x20000000 | 0x00020000 | 0x40000000 | 0x08000000 | 0x04000000 | 0x02000000


def memory_fork(client: Any, http_get: Any, rounds: int) -> dict[str, Any]:
    """Fork a parent whose live process holds MODEL_MB, ``rounds`` times; children deleted."""
    parent = client.sandboxes.create()
    samples, copied = [], []
    try:
        parent.filesystem.write("/root/hold.py", HOLD.format(mb=MODEL_MB))
        parent.exec("nohup python3 /root/hold.py >/dev/null 2>&1 &")
        deadline = time.monotonic() + 30
        while parent.exec("test -f /tmp/ready && echo y").stdout.strip() != "y":
            assert time.monotonic() < deadline, "the model process did not start"
            time.sleep(0.1)
        for _ in range(rounds):
            started = time.perf_counter()
            (child,) = client.sandboxes.fork_tree(parent.id, 1)
            samples.append(time.perf_counter() - started)
            try:
                running = "hold.py" in child.exec("cat /proc/[0-9]*/cmdline").stdout
                flag = http_get(f"/v1/sandboxes/{child.id}")["memory_copied"]
                assert flag is running, f"memory_copied says {flag}, the child's processes say {running}"
                copied.append(flag)
            finally:
                child.kill()
    finally:
        parent.kill()
    return {"model_mb": MODEL_MB, "fork": summary(samples), "memory_copied": all(copied)}


def zygote_floor(rounds: int) -> dict[str, Any]:
    """Fork to running in fresh namespaces and a fresh memory cgroup (a root-only spike)."""
    base = Path("/sys/fs/cgroup/memory")
    if os.geteuid() != 0 or not base.is_dir():
        return {"skipped": "needs root and a cgroup v1 memory hierarchy"}
    libc = ctypes.CDLL(None, use_errno=True)
    model = bytearray(MODEL_MB << 20)
    model[::4096] = b"1" * len(model[::4096])
    samples = []
    for i in range(rounds):
        cgroup = base / f"pandastack-zygote-spike-{os.getpid()}-{i}"
        cgroup.mkdir()
        try:
            (cgroup / "memory.limit_in_bytes").write_text(str(512 << 20))
            read_end, write_end = os.pipe()
            started = time.perf_counter()
            pid = os.fork()
            if pid == 0:  # the copy: into the cgroup, fresh namespaces, then its pid 1 runs
                code = 1
                with contextlib.suppress(BaseException):
                    (cgroup / "cgroup.procs").write_text(str(os.getpid()))
                    if libc.unshare(FRESH_NAMESPACES) == 0:
                        init = os.fork()
                        if init == 0:
                            ok = len(model) == MODEL_MB << 20 and model[4096] == ord("1")
                            os.write(write_end, json.dumps({"pid": os.getpid(), "ok": ok}).encode())
                            os._exit(0)
                        os.waitpid(init, 0)
                        code = 0
                os._exit(code)
            os.close(write_end)
            report = json.loads(os.read(read_end, 4096) or b"{}")
            samples.append(time.perf_counter() - started)
            os.close(read_end)
            os.waitpid(pid, 0)
            if report != {"pid": 1, "ok": True}:  # (a host without user namespaces, say)
                return {"failed": f"the copy did not run in fresh namespaces: {report or 'no report'}"}
        finally:
            with contextlib.suppress(OSError):
                cgroup.rmdir()
    return {"model_mb": MODEL_MB, "fork_to_running": summary(samples)}


def criu() -> dict[str, Any]:
    """``criu check``'s verdict on this host (its last error line when it cannot start)."""
    binary = shutil.which("criu") or next((p for p in ("/usr/sbin/criu",) if os.path.exists(p)), None)
    if binary is None:
        return {"installed": False}
    version = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30).stdout
    check = subprocess.run([binary, "check"], capture_output=True, text=True, timeout=60)
    errors = [line for line in (check.stdout + check.stderr).splitlines() if "Error" in line]
    return {
        "installed": True,
        "version": version.split("Version:")[-1].strip().splitlines()[0] if version else "",
        "check_ok": check.returncode == 0,
        # (the first errors are its iptables probes, which do not stop it)
        "first_error": next((e for e in errors if "exited, status" not in e), errors[0] if errors else ""),
        "kernel": os.uname().release,
    }
