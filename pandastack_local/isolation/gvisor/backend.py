"""The gVisor backend: every sandbox is a ``runsc`` container with a user-space kernel.

Each sandbox gets an OCI bundle under its host dir: a shared empty skeleton as
its read-only root (gVisor overlays it in memory, so the root's writes are
charged to the sandbox's memory), the host's ``/usr`` read-only, the guest
files and template environments read-only, ``/tmp`` a tmpfs capped at the
template's disk, ``--network=none``. Its init is the same agent as bwrap's; the
agent binds its unix socket in a directory bound from the host
(``--host-uds=create``), so the server speaks the same frames over it.

``runsc run`` stays in the foreground as the server's child (its sandbox and
gofer are its children), inside the sandbox's cgroups (joined before exec, as
for bwrap; ``--ignore-cgroups`` keeps runsc from moving itself), with
``PDEATHSIG`` so a dead server takes it along. Delete is SIGKILL to that tree
plus the cgroup sweep, then the host dir (bundle, runsc state, socket, images).

Fork copies memory: the agent gives up its listener (a host socket in an image
makes it unrestorable), ``runsc checkpoint --leave-running`` writes the image,
the parent's agent listens again, and ``runsc restore`` starts each child from
the image with its own bundle and socket dir. No process is ever started by
``runsc exec`` (the agent owns every process), which is what a restore needs.
"Listen again" is a byte on the agent's stdin, a pipe only the server writes (a
restored sandbox's stdin is its own ``runsc restore``'s, with the byte already
in it): the server never touches a path in the socket dir for it.

The socket dir is the one host directory the guest can write, so the server
connects to no name in it. After each bind the agent writes a byte to its stdout
(a pipe the server reads on its event loop); the server then opens ``s/agent.sock``
O_PATH|O_NOFOLLOW from the dir it created, checks that it is a socket of the
sandbox's uid with no other name, and hard-links that inode as ``agent.sock`` in
the sandbox's own 0700 dir: the name every request connects to, which no guest
can replace (``link_agent_socket``).

Cold creates restore too, from a boot image: the first sandbox of a template boots
with ``runsc run`` and the server checkpoints one more, freshly booted and never
used, as that template's image (as PandaStack restores microVMs from a template
snapshot). Each later create restores it, so the agent's interpreter start is paid
once per template, not per sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Any

from pandastack_local.isolation import process
from pandastack_local.isolation.cgroups import Cgroups
from pandastack_local.templates import pythonenv
from pandastack_local.templates.registry import Template

MIN_RUNSC_DATE = "20240729"
INSTALL_HINT = (
    "install a working runsc with `make runsc` from the pandastack-workflows checkout (Debian 12: "
    "apt-get install -t bookworm-backports runsc), or pass --runsc PATH"
)
# The agent's socket dir inside the sandbox (bound read-write from the sandbox's host dir).
GUEST_SOCKET_DIR = "/.pandastack-sock"
# Global runsc flags, the same for run, checkpoint and restore.
RUNSC_FLAGS = (
    "--network=none",
    "--host-uds=create",
    "--overlay2=root:memory",
    "--ignore-cgroups",
    "--platform=systrap",
)
CHECKPOINT_TIMEOUT_SECONDS = 60.0
RESUME = b"g"  # the agent's go-ahead after a checkpoint, on its stdin
AGENT_SOCKET = "agent.sock"  # the agent's name in s/, and the server's link to it beside s/
# Host threads of one sandbox's runsc, sentry and gofer (Go runtimes) on top of its guest's.
SENTRY_PIDS = 256
# Top-level names of the skeleton root (mount points and the jobs' usual directories).
_SKELETON_DIRS = ("proc", "dev", "sys", "tmp", "var/tmp", "work", "root", "etc", "usr", "opt", "run")


class RunscUnavailable(RuntimeError):
    """No usable runsc: the message says how to get one."""


def check_runsc(runsc: str | None) -> tuple[str, str]:
    """(path, version) of a usable runsc, or RunscUnavailable naming the fix."""
    found = shutil.which(runsc or "runsc")
    if not found:
        where = f"{runsc!r} is not an executable" if runsc else "no runsc on PATH"
        raise RunscUnavailable(f"--isolation gvisor needs gVisor's runsc ({where}): {INSTALL_HINT}")
    try:
        out = subprocess.run([found, "--version"], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RunscUnavailable(f"{found} --version failed ({exc}): {INSTALL_HINT}") from None
    match = re.search(r"runsc version (\S+)", out.stdout)
    date = re.search(r"(\d{8})", match.group(1)) if match else None
    if match is None or date is None:
        raise RunscUnavailable(f"{found} does not look like gVisor's runsc: {INSTALL_HINT}")
    if date.group(1) < MIN_RUNSC_DATE:
        raise RunscUnavailable(
            f"runsc {match.group(1)} at {found} is older than 0.0~{MIN_RUNSC_DATE} (the 2022 build "
            f"breaks listing directories): {INSTALL_HINT}"
        )
    if os.geteuid() != 0:
        raise RunscUnavailable(
            "--isolation gvisor needs a root server: runsc sets up each sandbox's namespaces, "
            "chroot and cgroup limits as root (rootless runsc applies no cgroup limits). Run the "
            "server as root, or use --isolation bwrap, which runs unprivileged"
        )
    return found, match.group(1)


def _bind(source: str, destination: str, writable: bool = False) -> dict[str, Any]:
    return {
        "destination": destination,
        "type": "bind",
        "source": source,
        "options": ["rbind", "rw" if writable else "ro", "nosuid", "nodev"],
    }


def oci_mounts_and_env(args: list[str]) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """bwrap's ``--ro-bind SRC DEST`` and ``--setenv K V`` (the template's view) as OCI mounts + env."""
    mounts: list[dict[str, Any]] = []
    env: dict[str, str] = {}
    i = 0
    while i < len(args):
        if args[i] == "--ro-bind":
            mounts.append(_bind(args[i + 1], args[i + 2]))
            i += 3
        elif args[i] == "--setenv":
            env[args[i + 1]] = args[i + 2]
            i += 3
        else:
            raise ValueError(f"no OCI equivalent for bwrap argument {args[i]!r}")
    return mounts, env


def oci_config(
    template: Template, guest_dir: Path, rootfs: Path, sock_dir: Path, limits: dict[str, int]
) -> dict[str, Any]:
    """The sandbox's config.json: the agent as init, read-only system view, capped /tmp."""
    root_bytes, shm_bytes = process.disk_split(template.disk_mb * 1024 * 1024)
    mounts: list[dict[str, Any]] = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "mode=755"]},
        {"destination": "/dev/shm", "type": "tmpfs", "source": "shm", "options": [f"size={shm_bytes}"]},
        # gVisor's own (synthetic) sysfs, read-only; no host file behind it.
        {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "ro"]},
        # The jobs' scratch dirs, each a tmpfs capped at the disk size (the rest of the root is
        # gVisor's memory overlay, bounded by the sandbox's memory limit).
        *(
            {
                "destination": d,
                "type": "tmpfs",
                "source": "tmpfs",
                "options": [f"size={root_bytes}", f"mode={mode}"],
            }
            for d, mode in (("/tmp", "1777"), ("/work", "755"))
        ),
        _bind("/usr", "/usr"),
        _bind(str(guest_dir), "/.pandastack"),
        _bind(str(sock_dir), GUEST_SOCKET_DIR, writable=True),
    ]
    if (guest_dir / "alternatives").is_dir():
        mounts.append(_bind(str(guest_dir / "alternatives"), "/etc/alternatives"))
    if template.rootfs is not None:
        mounts.append(_bind(str(template.rootfs), "/.pandastack-rootfs"))
    binds, _ = oci_mounts_and_env(pythonenv.bind_args(template))
    software, template_env = oci_mounts_and_env(template.guest_args())
    env = {"PATH": pythonenv.guest_path(template), "HOME": "/root", "LANG": "C.UTF-8", **template_env}
    return {
        "ociVersion": "1.0.2",
        "process": {
            "args": [
                process.GUEST_PYTHON,
                "-I",
                "-S",
                "/.pandastack/agent.py",
                f"{GUEST_SOCKET_DIR}/{AGENT_SOCKET}",
                json.dumps(limits),
            ],
            "cwd": "/root",
            "user": {"uid": 0, "gid": 0},
            "env": [f"{k}={v}" for k, v in env.items()],
            # No capabilities, like bwrap's --cap-drop ALL; no privilege gain through exec.
            "capabilities": {"bounding": [], "effective": [], "inheritable": [], "permitted": []},
            "noNewPrivileges": True,
        },
        # Writable only through gVisor's memory overlay (--overlay2=root:memory): the host dir stays as is.
        "root": {"path": str(rootfs), "readonly": False},
        "hostname": "sandbox",
        "mounts": mounts + binds + software,
        "linux": {
            "namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")],
        },
    }


def prepare_skeleton(path: Path) -> Path:
    """The empty root every gVisor sandbox shares read-only: mount points and the host's
    top-level symlinks (/bin -> usr/bin on a merged-/usr host)."""
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    for name in _SKELETON_DIRS:
        (path / name).mkdir(parents=True, exist_ok=True)
    for name in (".pandastack", ".pandastack-rootfs", GUEST_SOCKET_DIR.lstrip("/")):
        (path / name).mkdir()
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        host = Path("/") / name
        if host.is_symlink():
            (path / name).symlink_to(os.readlink(host))
    (path / "tmp").chmod(0o1777)
    (path / "var" / "tmp").chmod(0o1777)
    return path


AT_FDCWD, AT_EMPTY_PATH = -100, 0x1000


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def link_agent_socket(directory: Path, owner: int) -> bool:
    """Link the socket the agent bound in ``directory/s`` as ``directory/agent.sock``, the name
    the server connects to, if it is one the sandbox made: opened from the server's own
    ``directory`` without following a link, a socket, owned by ``owner`` (the sandbox's host
    uid), with no other name. False (and the link left as it was) for anything else."""
    flags = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        sock_dir = os.open(directory / "s", flags | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        found = os.open(AGENT_SOCKET, flags, dir_fd=sock_dir)
    except OSError:
        return False
    finally:
        os.close(sock_dir)
    link = directory / AGENT_SOCKET
    try:
        st = os.fstat(found)
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != owner:
            return False
        with contextlib.suppress(OSError):
            current = os.stat(link, follow_symlinks=False)
            if (current.st_dev, current.st_ino) == (st.st_dev, st.st_ino):
                return True  # linked already
        if st.st_nlink != 1:
            return False
        staged = directory / f"{AGENT_SOCKET}.new"
        with contextlib.suppress(FileNotFoundError):
            staged.unlink()
        # linkat(fd, "", AT_EMPTY_PATH): a name for the inode the fd holds (root's
        # CAP_DAC_READ_SEARCH; a /proc/self/fd path is refused with EXDEV for a socket).
        if _libc().linkat(found, b"", AT_FDCWD, os.fsencode(staged), AT_EMPTY_PATH) != 0:
            return False
        os.replace(staged, link)
        return True
    except OSError:
        return False
    finally:
        os.close(found)


@dataclasses.dataclass
class AgentPipes:
    """The server's ends of a sandbox's agent pipes (see the module docstring)."""

    resume: int  # written: the go-ahead after a checkpoint
    listening: int  # read on the event loop: the agent has bound its socket


class GvisorBackend:
    """Sandboxes as runsc containers (see the module docstring)."""

    name = "gvisor"
    memory_fork = True

    def __init__(self, cgroups: Cgroups, runsc: str | None) -> None:
        self.cgroups = cgroups
        self.runsc, self.version = check_runsc(runsc)
        self.guest_dir = Path()
        self.rootfs = Path()
        self.images_dir = Path()
        # Boot images by template (see boot_image_key); a create restores one when it exists.
        self.boot_images: dict[str, Path] = {}
        self.pipes: dict[str, AgentPipes] = {}

    def socket_path(self, sandboxes_dir: Path, name: str) -> Path:
        """The server's link to the agent's socket (link_agent_socket), beside the socket dir."""
        return sandboxes_dir / name / AGENT_SOCKET

    def describe(self) -> str:
        return f"gvisor (runsc {self.version}, systrap)"

    def start(self, guest_dir: Path, templates: list[Template]) -> None:
        self.guest_dir = guest_dir
        self.rootfs = prepare_skeleton(guest_dir.parent / "gvisor-root")
        self.images_dir = guest_dir.parent / "gvisor-images"
        shutil.rmtree(self.images_dir, ignore_errors=True)
        self.images_dir.mkdir(mode=0o700)

    def expose_built(self, path: Path) -> None:
        """runsc runs as root and reads every bind source where it is."""

    def _runsc(self, directory: Path, *args: str) -> list[str]:
        return [self.runsc, "--root", str(directory / "runsc"), *RUNSC_FLAGS, *args]

    def _launch(
        self, name: str, template: Template, sandboxes_dir: Path, command: list[str], resume: bool
    ) -> process.SandboxProcess:
        directory = sandboxes_dir / name
        directory.mkdir(parents=True, mode=0o700)
        directory.chmod(0o700)
        sock_dir = directory / "s"
        sock_dir.mkdir(mode=0o700)
        bundle = directory / "bundle"
        bundle.mkdir()
        limits: dict[str, int] = {"nofile": template.nofile, "nproc": template.pids_max}
        if "memory" not in self.cgroups.bases:
            limits["as_bytes"] = template.memory_mb * 1024 * 1024
        config = oci_config(template, self.guest_dir, self.rootfs, sock_dir, limits)
        (bundle / "config.json").write_text(json.dumps(config))
        # The host's pids wall also counts the sentry's and gofer's threads and one systrap stub
        # per guest process: room for those, while RLIMIT_NPROC (which gVisor enforces even for
        # its root) is the jobs' wall, so a fork bomb gets EAGAIN instead of crashing the sentry.
        host_pids = 2 * template.pids_max + SENTRY_PIDS
        procs_files = self.cgroups.create(name, dataclasses.replace(template, pids_max=host_pids))
        argv = self._runsc(directory, *command, "--bundle", str(bundle), name)
        resume_r, resume_w = os.pipe()
        listening_r, listening_w = os.pipe()
        os.set_blocking(resume_w, False)
        os.set_blocking(listening_r, False)
        if resume:  # a restored agent waits for this before listening again
            os.write(resume_w, RESUME)
        try:
            proc = process.launch(argv, procs_files, pdeathsig=True, stdin=resume_r, stdout=listening_w)
        except BaseException:
            os.close(resume_w)
            os.close(listening_r)
            raise
        finally:
            os.close(resume_r)
            os.close(listening_w)
        self.pipes[name] = AgentPipes(resume=resume_w, listening=listening_r)
        asyncio.get_running_loop().add_reader(listening_r, self._agent_listening, directory, listening_r)
        (directory / "record.json").write_text(json.dumps({"name": name, "pid": proc.pid}))
        return process.SandboxProcess(
            name=name,
            proc=proc,
            directory=directory,
            socket_path=self.socket_path(sandboxes_dir, name),
            restored=resume,
        )

    def spawn(self, name: str, template: Template, sandboxes_dir: Path) -> process.SandboxProcess:
        """Restore the template's boot image when there is one, else boot."""
        image = self.boot_images.get(boot_image_key(template))
        if image is not None:
            return self.restore(name, template, sandboxes_dir, image)
        return self.boot(name, template, sandboxes_dir)

    def boot(self, name: str, template: Template, sandboxes_dir: Path) -> process.SandboxProcess:
        """A sandbox from nothing: ``runsc run``, the agent starts its interpreter."""
        return self._launch(name, template, sandboxes_dir, ["run"], resume=False)

    def has_boot_image(self, template: Template) -> bool:
        return boot_image_key(template) in self.boot_images

    def save_boot_image(self, sp: process.SandboxProcess, template: Template) -> None:
        """Checkpoint ``sp`` (booted, quiesced, never used) as the template's boot image; it stops."""
        key = boot_image_key(template)
        image = self.images_dir / key
        shutil.rmtree(image, ignore_errors=True)
        self.checkpoint(sp, image, leave_running=False)
        self.boot_images[key] = image

    def drop_boot_image(self, template: Template) -> None:
        """A boot image that did not restore: later creates boot again."""
        image = self.boot_images.pop(boot_image_key(template), None)
        if image is not None:
            shutil.rmtree(image, ignore_errors=True)

    def restore(
        self, name: str, template: Template, sandboxes_dir: Path, image: Path
    ) -> process.SandboxProcess:
        """A new sandbox from a checkpoint image: a copy of the parent's memory and files."""
        return self._launch(
            name, template, sandboxes_dir, ["restore", "--image-path", str(image)], resume=True
        )

    def checkpoint(self, sp: process.SandboxProcess, image: Path, leave_running: bool = True) -> None:
        """Write ``sp``'s image (its agent has quiesced); the sandbox keeps running unless told.
        The server's link to the old socket goes first: the agent relinks when it listens again."""
        with contextlib.suppress(FileNotFoundError):
            sp.socket_path.unlink()
        argv = self._runsc(
            sp.directory,
            "checkpoint",
            *(["--leave-running"] if leave_running else []),
            "--compression=none",
            "--image-path",
            str(image),
            sp.name,
        )
        try:
            out = subprocess.run(
                argv, capture_output=True, text=True, timeout=CHECKPOINT_TIMEOUT_SECONDS, check=False
            )
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"runsc checkpoint took over {CHECKPOINT_TIMEOUT_SECONDS:.0f}s") from None
        if out.returncode != 0:
            raise RuntimeError(f"runsc checkpoint failed: {(out.stderr or out.stdout).strip()[-500:]}")

    def _agent_listening(self, directory: Path, fd: int) -> None:
        """The agent said it bound its socket (or its sandbox ended: EOF). On the event loop."""
        try:
            said = os.read(fd, 4096)
        except BlockingIOError:
            return
        except OSError:
            said = b""
        if said:
            link_agent_socket(directory, 0)
            return
        asyncio.get_running_loop().remove_reader(fd)
        os.close(fd)

    def prepare_quiesce(self, sp: process.SandboxProcess) -> None:
        """Before a checkpoint (nothing to prepare: the go-ahead is a byte on the resume pipe)."""

    def resume(self, sp: process.SandboxProcess) -> None:
        """Let the checkpointed parent's agent listen again (it says so when it does)."""
        pipes = self.pipes.get(sp.name)
        if pipes is not None:
            with contextlib.suppress(OSError):  # a full pipe: a go-ahead is already waiting
                os.write(pipes.resume, RESUME)

    def kill(self, sp: process.SandboxProcess) -> None:
        process.kill(sp, self.cgroups)
        # (the listening pipe ends with the sandbox's processes: _agent_listening closes it)
        pipes = self.pipes.pop(sp.name, None)
        if pipes is not None:
            os.close(pipes.resume)

    def reap_leftovers(self, sandboxes_dir: Path) -> list[str]:
        return process.reap_leftovers(sandboxes_dir, self.cgroups)

    def close(self) -> None:
        self.boot_images.clear()
        shutil.rmtree(self.images_dir, ignore_errors=True)


def boot_image_key(template: Template) -> str:
    """One boot image per template as it is now: a rebuilt template (new environment, new
    limits) gets a new image, since the agent's limits and environment are in the image."""
    ident = json.dumps(dataclasses.astuple(template), default=str)  # name, limits, env, built dir...
    return hashlib.sha256(ident.encode()).hexdigest()[:16]
