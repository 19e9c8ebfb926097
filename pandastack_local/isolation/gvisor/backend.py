"""The gVisor backend: every sandbox is a ``runsc`` container with a user-space kernel.

Each sandbox gets an OCI bundle under its host dir: an empty skeleton of its own
as its root (gVisor overlays it in memory, so the root's writes are charged to
the sandbox's memory and never reach the host), the host's ``/usr`` read-only,
the guest files and template environments read-only, ``/tmp`` a tmpfs capped at
the template's disk, ``--network=none``. Its init is the same agent as bwrap's;
the agent binds its unix socket in a directory bound from the host
(``--host-uds=create``), so the server speaks the same frames over it.

A root server runs each sandbox's sentry and gofer as host uids of its own: the
spec has a user namespace mapping the guest's root and SOCKET_DIR_OWNER to two
uids from ``idmap.UidPool``, and what they read is exposed to them as for bwrap
(``mountns.Exposed``). The socket dir is 0700 and SOCKET_DIR_OWNER's, so no job
(root without capabilities) can list, write or chmod it: only the agent, which
holds AGENT_CAPABILITY for its bind.

``runsc run`` stays in the foreground as the server's child (its sandbox and
gofer are its children), inside the sandbox's cgroups (joined before exec, as
for bwrap; ``--ignore-cgroups`` keeps runsc from moving itself), with
``PDEATHSIG`` so a dead server takes it along. Delete is SIGKILL to that tree
plus the cgroup sweep, then the host dir (bundle, runsc state, skeleton, socket dir,
images: ``process.remove_tree``, which trusts nothing in it).

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
import json
import logging
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Any

from pandastack_local.exceptions import PandaStackLocalError
from pandastack_local.isolation import mountns, process
from pandastack_local.isolation.backend import Kill, Ready
from pandastack_local.isolation.bwrap.sandbox import bind_sources, exposed_sources
from pandastack_local.isolation.cgroups import Cgroups
from pandastack_local.isolation.guest_dir import agent_path
from pandastack_local.isolation.gvisor.boot_images import BootImages, boot_image_key
from pandastack_local.isolation.idmap import UidPool
from pandastack_local.templates import pythonenv
from pandastack_local.templates.registry import Template

log = logging.getLogger(__name__)

MIN_RUNSC_DATE = "20240729"
INSTALL_HINT = (
    "install a working runsc with `make runsc` from the pandastack-workflows checkout (Debian 12: "
    "apt-get install -t bookworm-backports runsc), or pass --runsc PATH"
)
# The agent's socket dir inside the sandbox (bound read-write from the sandbox's host dir).
GUEST_SOCKET_DIR = "/.pandastack-sock"
# Its owner as the guest sees it (mapped to a host uid of the sandbox's own): not the jobs' root,
# so with mode 0700 and no capabilities no job can list, write or chmod it.
SOCKET_DIR_OWNER = 1
# The one capability the agent holds (permitted, not effective, and out of its bounding set, so
# no process it starts can have it): raised only while it binds its socket in that dir.
AGENT_CAPABILITY = "CAP_DAC_OVERRIDE"
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


class RunscUnavailable(PandaStackLocalError, RuntimeError):
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
    template: Template,
    guest_dir: Path,
    rootfs: Path,
    sock_dir: Path,
    limits: dict[str, int],
    sources: dict[str, str] | None = None,
    host_ids: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """The sandbox's config.json: the agent as init, read-only system view, capped /tmp.

    ``sources``: host dir -> where the server exposes it to the sandbox's uid (every bind source
    under such a dir is read from there). ``host_ids``: the host uids of the guest's root and of
    SOCKET_DIR_OWNER, in a user namespace of the sandbox's own (None: no mapping)."""
    sources = sources or {}

    def exposed(path: Path) -> str:
        return exposed_sources(["--ro-bind", str(path), "/"], sources)[1]

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
        _bind(exposed(guest_dir), "/.pandastack"),
        _bind(str(sock_dir), GUEST_SOCKET_DIR, writable=True),
    ]
    if (guest_dir / "alternatives").is_dir():
        mounts.append(_bind(exposed(guest_dir / "alternatives"), "/etc/alternatives"))
    if template.rootfs is not None:
        mounts.append(_bind(exposed(template.rootfs), "/.pandastack-rootfs"))
    binds, _ = oci_mounts_and_env(exposed_sources(pythonenv.bind_args(template), sources))
    software, template_env = oci_mounts_and_env(exposed_sources(template.guest_args(), sources))
    env = {"PATH": pythonenv.guest_path(template), "HOME": "/root", "LANG": "C.UTF-8", **template_env}
    config: dict[str, Any] = {
        "ociVersion": "1.0.2",
        "process": {
            "args": [
                process.GUEST_PYTHON,
                "-I",
                "-S",
                agent_path(guest_dir),  # its bytecode, compiled once per server (guest_dir.py)
                f"{GUEST_SOCKET_DIR}/{AGENT_SOCKET}",
                json.dumps(limits),
            ],
            "cwd": "/root",
            "user": {"uid": 0, "gid": 0},
            "env": [f"{k}={v}" for k, v in env.items()],
            # Jobs get no capabilities (like bwrap's --cap-drop ALL) and no privilege gain through
            # exec: the bounding set is empty, so an exec as root gains nothing. The agent keeps
            # AGENT_CAPABILITY permitted, for its bind in the socket dir.
            "capabilities": {
                "bounding": [],
                "effective": [],
                "inheritable": [],
                "permitted": [AGENT_CAPABILITY],
            },
            "noNewPrivileges": True,
        },
        # Writable only through gVisor's memory overlay (--overlay2=root:memory): the host dir stays as is.
        "root": {"path": exposed(rootfs), "readonly": False},
        "hostname": "sandbox",
        "mounts": mounts + binds + software,
        "linux": {"namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")]},
    }
    if host_ids is not None:
        # runsc starts the sentry and the gofer in this user namespace: on the host they are the
        # sandbox's uid, with capabilities only over its own files.
        ids = [
            {"containerID": 0, "hostID": host_ids[0], "size": 1},
            {"containerID": SOCKET_DIR_OWNER, "hostID": host_ids[1], "size": 1},
        ]
        config["linux"]["namespaces"].append({"type": "user"})
        config["linux"]["uidMappings"] = ids
        config["linux"]["gidMappings"] = ids
    return config


def prepare_skeleton(path: Path, mounts: list[dict[str, Any]], owner: int) -> Path:
    """A sandbox's empty root (gVisor overlays it in memory, so the host dir stays as is): the
    usual top-level dirs, a mount point for each of ``mounts`` and the host's top-level symlinks
    (/bin -> usr/bin on a merged-/usr host), all owned by ``owner``, the host uid of the
    sandbox's root, so that its root owns /, /root and /etc as anywhere else."""
    made = [path]

    def make(rel: str, directory: bool = True) -> None:
        target = path
        parts = Path(rel).parts
        for i, part in enumerate(parts):
            target = target / part
            if os.path.lexists(target):
                continue
            if directory or i < len(parts) - 1:
                target.mkdir(mode=0o755)
            else:
                target.touch(mode=0o644)
            made.append(target)

    path.mkdir(mode=0o755, exist_ok=True)  # (it may be exposed already: filled in place)
    for name in _SKELETON_DIRS:
        make(name)
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        host = Path("/") / name
        if host.is_symlink():
            (path / name).symlink_to(os.readlink(host))
            made.append(path / name)
    for mount in mounts:
        if mount["type"] == "bind":
            make(mount["destination"].lstrip("/"), Path(mount["source"]).is_dir())
    for name, mode in (("tmp", 0o1777), ("var/tmp", 0o1777), ("root", 0o700)):
        (path / name).chmod(mode)
    for made_path in made:
        os.lchown(made_path, owner, owner)
    return path


AT_FDCWD, AT_EMPTY_PATH = -100, 0x1000


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def link_agent_socket(directory: Path, owner: int, stale: tuple[int, int] | None = None) -> bool:
    """Link the socket the agent bound in ``directory/s`` as ``directory/agent.sock``, the name
    the server connects to, if it is one the sandbox made: opened from the server's own
    ``directory`` without following a link, a socket, owned by ``owner`` (the sandbox's host
    uid), with no other name, and not ``stale`` (the (device, inode) of the socket it had before
    a checkpoint: the agent binds a new one). False (and the link left as it was) otherwise."""
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
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != owner or (st.st_dev, st.st_ino) == stale:
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


def template_sources(templates: list[Template]) -> list[Path]:
    """The host dirs the templates bind into their sandboxes (rootfs, python_env, code_dirs)."""
    wanted: list[Path] = []
    for template in templates:
        if template.rootfs is not None:
            wanted.append(template.rootfs)
        wanted += [Path(p) for p in bind_sources(pythonenv.bind_args(template))]
    return list(dict.fromkeys(wanted))


@dataclasses.dataclass
class SandboxHost:
    """What the server holds on the host for one live sandbox (see the module docstring)."""

    directory: Path
    owner: int = 0  # the host uid of its root (what the agent's socket is owned by)
    resume: int = -1  # the resume pipe's write end: the go-ahead after a checkpoint
    # The listening pipe's read end, read on ``loop`` only while the server waits for a bind
    # (a job can write it too, through /proc/1/fd under gVisor: otherwise a flood stops at a
    # full pipe), and the socket the agent had before its last checkpoint.
    listening: int = -1
    loop: asyncio.AbstractEventLoop | None = None
    watching: bool = False
    stale: tuple[int, int] | None = None
    exposed: list[Path] = dataclasses.field(default_factory=list)  # its root and socket dir, for its uid


class GvisorBackend:
    """Sandboxes as runsc containers (see the module docstring)."""

    name = "gvisor"
    egress = False
    no_memory_fork = ""

    def memory_forker(self) -> GvisorBackend:
        return self

    def boot_image_store(self, sandboxes_dir: Path, ready: Ready, kill: Kill) -> BootImages:
        return BootImages(self, sandboxes_dir, ready, kill)

    def __init__(self, cgroups: Cgroups, runsc: str | None, instance: str) -> None:
        self.cgroups = cgroups
        self.runsc, self.version = check_runsc(runsc)
        # Two host uids per sandbox (its root, its socket dir's owner), as for bwrap's sandboxes.
        self.uids = UidPool(instance) if UidPool.available() and mountns.private() else None
        self.exposed: mountns.Exposed | None = None
        self.sources: dict[str, str] = {}
        self.guest_dir = Path()
        self.images_dir = Path()
        # Boot images by template (see boot_image_key); a create restores one when it exists.
        self.boot_images: dict[str, Path] = {}
        self.sandboxes: dict[str, SandboxHost] = {}

    def socket_path(self, sandboxes_dir: Path, name: str) -> Path:
        """The server's link to the agent's socket (link_agent_socket), beside the socket dir."""
        return sandboxes_dir / name / AGENT_SOCKET

    def describe(self) -> str:
        return f"gvisor (runsc {self.version}, systrap)"

    def start(self, guest_dir: Path, templates: list[Template]) -> None:
        self.guest_dir = guest_dir
        self.images_dir = guest_dir.parent / "gvisor-images"
        shutil.rmtree(self.images_dir, ignore_errors=True)
        self.images_dir.mkdir(mode=0o700)
        if self.uids is None:
            log.warning(
                "isolation: every gVisor sandbox's sentry and gofer run as host root (only a root "
                "server in its own mount namespace maps each sandbox to its own unprivileged uid)"
            )
            return
        # The sentry and the gofer run as the sandbox's uid, which may not walk the server's
        # private dirs: what they read is exposed to it, as for bwrap (mountns.Exposed).
        self.exposed = mountns.Exposed()
        for path in (guest_dir, *template_sources(templates)):
            self.expose_built(path)

    def expose_built(self, path: Path) -> None:
        """A bind source (a template built after start-up too): let the sandboxes' uids read it."""
        if self.exposed is not None and str(path) not in self.sources:
            self.sources[str(path)] = str(self.exposed.expose(path, f"d{len(self.sources)}"))

    def _runsc(self, directory: Path, *args: str) -> list[str]:
        return [self.runsc, "--root", str(directory / "runsc"), *RUNSC_FLAGS, *args]

    def _launch(
        self, name: str, template: Template, sandboxes_dir: Path, command: list[str], resume: bool
    ) -> process.SandboxProcess:
        host = SandboxHost(directory=sandboxes_dir / name)
        self.sandboxes[name] = host
        try:
            proc = self._start(name, template, host, command, resume)
        except BaseException:
            self._release(name)
            raise
        return process.SandboxProcess(
            name=name,
            proc=proc,
            directory=host.directory,
            socket_path=self.socket_path(sandboxes_dir, name),
            restored=resume,
        )

    def _start(
        self, name: str, template: Template, host: SandboxHost, command: list[str], resume: bool
    ) -> subprocess.Popen[bytes]:
        directory = host.directory
        directory.mkdir(parents=True, mode=0o700)
        directory.chmod(0o700)
        sock_dir, root = directory / "s", directory / "root"
        sock_dir.mkdir(mode=0o700)
        root.mkdir(mode=0o755)
        guest_root, guest_sock_dir, host_ids = root, sock_dir, None
        if self.uids is not None and self.exposed is not None:
            # Its root and its socket dir's owner; what the sandbox's uid reads, exposed to it.
            host_ids = (self.uids.take(name), self.uids.take(f"{name}/s"))
            host.owner = host_ids[0]
            guest_root = self.exposed.expose(root, f"r-{name}")
            host.exposed.append(guest_root)
            guest_sock_dir = self.exposed.expose(sock_dir, f"s-{name}", writable=True)
            host.exposed.append(guest_sock_dir)
        os.chown(sock_dir, *(2 * [host_ids[1] if host_ids else SOCKET_DIR_OWNER]))
        bundle = directory / "bundle"
        bundle.mkdir(mode=0o700)
        limits: dict[str, int] = {"nofile": template.nofile, "nproc": template.pids_max}
        if "memory" not in self.cgroups.bases:
            limits["as_bytes"] = template.memory_mb * 1024 * 1024
        config = oci_config(
            template, self.guest_dir, guest_root, guest_sock_dir, limits, self.sources, host_ids
        )
        prepare_skeleton(root, config["mounts"], host.owner)
        (bundle / "config.json").write_text(json.dumps(config))
        # The host's pids wall also counts the sentry's and gofer's threads and one systrap stub
        # per guest process: room for those, while RLIMIT_NPROC (which gVisor enforces even for
        # its root) is the jobs' wall, so a fork bomb gets EAGAIN instead of crashing the sentry.
        host_pids = 2 * template.pids_max + SENTRY_PIDS
        procs_files = self.cgroups.create(name, dataclasses.replace(template, pids_max=host_pids))
        argv = self._runsc(directory, *command, "--bundle", str(bundle), name)
        resume_r, host.resume = os.pipe()
        host.listening, listening_w = os.pipe()
        os.set_blocking(host.resume, False)
        os.set_blocking(host.listening, False)
        if resume:  # a restored agent waits for this before listening again
            os.write(host.resume, RESUME)
        try:
            proc = process.launch(argv, procs_files, pdeathsig=True, stdin=resume_r, stdout=listening_w)
        finally:
            os.close(resume_r)
            os.close(listening_w)
        host.loop = asyncio.get_running_loop()
        self._watch(host)
        (directory / "record.json").write_text(json.dumps({"name": name, "pid": proc.pid}))
        return proc

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
        The server's link to the old socket goes first: the agent's next bind is linked anew."""
        host = self.sandboxes.get(sp.name)
        with contextlib.suppress(FileNotFoundError):
            st = sp.socket_path.lstat()
            if host is not None:
                host.stale = (st.st_dev, st.st_ino)
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

    def _watch(self, host: SandboxHost) -> None:
        """Wait for the agent's "listening" (on the event loop)."""
        if host.loop is not None and host.listening >= 0 and not host.watching:
            host.loop.add_reader(host.listening, self._agent_listening, host)
            host.watching = True

    def _unwatch(self, host: SandboxHost, close: bool = False) -> None:
        """Stop reading the listening pipe (on the event loop); ``close``: it is done with."""
        if host.watching and host.loop is not None:
            host.loop.remove_reader(host.listening)
            host.watching = False
        if close and host.listening >= 0:
            os.close(host.listening)
            host.listening = -1

    def _agent_listening(self, host: SandboxHost) -> None:
        """The agent said it bound its socket (or its sandbox ended: EOF). On the event loop."""
        try:
            said = os.read(host.listening, 4096)
        except BlockingIOError:
            return
        except OSError:
            said = b""
        if not said:
            self._unwatch(host, close=True)
        elif link_agent_socket(host.directory, host.owner, host.stale):
            self._unwatch(host)  # linked: nothing more to read until the next checkpoint

    def prepare_quiesce(self, sp: process.SandboxProcess) -> None:
        """Before a checkpoint (nothing to prepare: the go-ahead is a byte on the resume pipe)."""

    def resume(self, sp: process.SandboxProcess) -> None:
        """Let the checkpointed parent's agent listen again (it says so when it does)."""
        host = self.sandboxes.get(sp.name)
        if host is not None and host.resume >= 0:
            self._watch(host)
            with contextlib.suppress(OSError):  # a full pipe: a go-ahead is already waiting
                os.write(host.resume, RESUME)

    def kill(self, sp: process.SandboxProcess) -> None:
        process.kill(sp, self.cgroups)
        self._release(sp.name)

    def _release(self, name: str) -> None:
        """What the server holds for a sandbox that is gone: its pipes, its root's and socket
        dir's exposures, its uids. (From a worker thread: the listening pipe is closed on the loop.)"""
        host = self.sandboxes.pop(name, None)
        if host is None:
            return
        if host.resume >= 0:
            os.close(host.resume)
        try:
            if host.loop is None:
                raise RuntimeError("never watched")
            host.loop.call_soon_threadsafe(self._unwatch, host, True)
        except RuntimeError:  # no loop reads the pipe (any more)
            host.watching = False
            self._unwatch(host, close=True)
        if self.exposed is not None:
            for target in host.exposed:
                self.exposed.conceal(target)
        if self.uids is not None:
            self.uids.give_back(name)
            self.uids.give_back(f"{name}/s")

    def stop_job(self, sp: process.SandboxProcess) -> int | None:
        """None: a job's memory is the sentry's, and the sentry keeps the pages of a job that
        ended (for its own reuse), so only stopping the sandbox gives them back to the host."""
        return None

    def reap_leftovers(self, sandboxes_dir: Path) -> list[str]:
        return process.reap_leftovers(sandboxes_dir, self.cgroups)

    def close(self) -> None:
        self.boot_images.clear()
        shutil.rmtree(self.images_dir, ignore_errors=True)
        if self.exposed is not None:
            self.exposed.close()
