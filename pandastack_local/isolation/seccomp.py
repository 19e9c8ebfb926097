"""The seccomp filter every sandbox runs under (loaded by bwrap ``--seccomp FD``).

Namespaces and a dropped capability set already refuse most of these calls; the
filter makes the refusal independent of that configuration and removes kernel
attack surface that needs no capability at all (io_uring, keyrings,
perf_event_open, userfaultfd: the usual first step of a kernel exploit). The
policy is "allow by default, deny a documented list", as Docker and Flatpak do:
jobs run arbitrary software, so an allow-list would break them. Denied calls
fail with EPERM (``clone3``: ENOSYS, so glibc falls back to ``clone``, whose
flags the filter can see). Calls from another ABI (i386, x32) kill the process:
the filter cannot vouch for their numbers.

Sockets are the one allow-list: a job gets the families it has business with
(unix, IPv4, IPv6, and netlink for routing only); every other family fails with
EAFNOSUPPORT, as on a kernel built without it. The others are either not
namespaced (vsock shares the host's port space), or queue buffers that no
cgroup charges (netlink's other protocols), or are large surface a job never
needs (packet, alg, bluetooth, xdp, tipc, ...).

Generated with libseccomp (through ``pyseccomp``, a ctypes binding of the
system's ``libseccomp.so.2``) rather than hand-written BPF.
"""

from __future__ import annotations

import errno
import tempfile
from typing import Any

CLONE_NEWUSER = 0x10000000
# personality() flags that weaken the sandbox's own memory protections.
PER_MMAP_PAGE_ZERO = 0x0100000
PER_READ_IMPLIES_EXEC = 0x0400000
PER_ADDR_NO_RANDOMIZE = 0x0040000
PERSONALITY_QUERY = 0xFFFFFFFF  # personality(0xffffffff) only reads the current persona
# socket(2) families a job keeps (every other one is refused), and netlink's one protocol.
AF_UNIX, AF_INET, AF_INET6, AF_NETLINK = 1, 2, 10, 16
ALLOWED_FAMILIES = (AF_UNIX, AF_INET, AF_INET6, AF_NETLINK)
NETLINK_ROUTE = 0
INT_MAX_UNSIGNED = 0xFFFFFFFF

# syscall -> why a job must not have it. Names this libseccomp does not know are skipped.
DENIED: dict[str, str] = {
    "keyctl": "kernel keyrings are shared per uid and per kernel: keys and quota cross sandboxes",
    "add_key": "kernel keyrings (see keyctl)",
    "request_key": "kernel keyrings (see keyctl); can also call out to a host helper",
    "io_uring_setup": "io_uring: large, fast-moving kernel surface, bypasses the other syscall checks",
    "io_uring_enter": "io_uring (see io_uring_setup)",
    "io_uring_register": "io_uring (see io_uring_setup)",
    "io_setup": "native AIO contexts count against the host-wide fs.aio-max-nr: one sandbox could "
    "claim them all (a red-team finding); programs fall back to threads",
    "bpf": "loading kernel programs",
    "perf_event_open": "kernel/hardware performance counters: side channels and kernel surface",
    "userfaultfd": "stalls kernel threads at will: a classic exploit primitive",
    "kexec_load": "replacing the running kernel",
    "kexec_file_load": "replacing the running kernel",
    "init_module": "loading kernel modules",
    "finit_module": "loading kernel modules",
    "delete_module": "unloading kernel modules",
    "mount": "changing the sandbox's mounts (its walls)",
    "umount2": "removing the mounts that hide host files",
    "pivot_root": "changing the root of the sandbox",
    "move_mount": "new mount API (see mount)",
    "open_tree": "new mount API (see mount)",
    "fsopen": "new mount API (see mount)",
    "fsconfig": "new mount API (see mount)",
    "fsmount": "new mount API (see mount)",
    "fspick": "new mount API (see mount)",
    "mount_setattr": "new mount API (see mount)",
    "unshare": "new namespaces: a new user namespace hands capabilities back",
    "setns": "joining other namespaces",
    "ptrace": "tracing another process of the sandbox (the agent, the other jobs)",
    "process_vm_readv": "reading another process's memory (as ptrace)",
    "process_vm_writev": "writing another process's memory (as ptrace)",
    "acct": "process accounting writes to a host file",
    "swapon": "host swap configuration",
    "swapoff": "host swap configuration",
    "reboot": "the host's power state",
    "syslog": "the host kernel's log",
    "open_by_handle_at": "opens files by handle, bypassing the mount namespace (the 'shocker' escape)",
    "quotactl": "host filesystem quotas",
    "lookup_dcookie": "host kernel profiling interface",
}


def build_filter() -> bytes:
    """The filter as a raw BPF program, ready for bwrap ``--seccomp FD``."""
    import pyseccomp as sc

    filt = sc.SyscallFilter(defaction=sc.ALLOW)
    for name in DENIED:
        try:
            filt.add_rule(sc.ERRNO(errno.EPERM), name)
        except (OSError, ValueError, RuntimeError):
            continue  # not a syscall of this architecture or of this libseccomp
    # clone(2) with CLONE_NEWUSER; clone3 passes its flags in memory the filter cannot read.
    filt.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, CLONE_NEWUSER, CLONE_NEWUSER))
    filt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    for flag in (PER_MMAP_PAGE_ZERO, PER_READ_IMPLIES_EXEC, PER_ADDR_NO_RANDOMIZE):
        # The kernel reads a 32-bit persona and treats 0xffffffff as a query. "flag set and some
        # other low bit clear" is "sets the flag": one masked compare per other bit.
        for bit in range(32):
            if not flag & (1 << bit):
                filt.add_rule(
                    sc.ERRNO(errno.EPERM), "personality", sc.Arg(0, sc.MASKED_EQ, flag | 1 << bit, flag)
                )
    for call in ("socket", "socketpair"):
        _deny_families(filt, call)
    with tempfile.TemporaryFile() as out:
        filt.export_bpf(out)
        out.seek(0)
        return out.read()


def _deny_families(filt: Any, call: str) -> None:
    """``call``'s families outside ALLOWED_FAMILIES, and netlink protocols but routing: EAFNOSUPPORT.

    The kernel takes ``int`` arguments; the filter sees 64-bit registers. A domain with anything
    in its upper half (garbage, or a negative int sign-extended) is refused outright, so the
    comparisons below see exactly the value the kernel will use."""
    import pyseccomp as sc

    deny = sc.ERRNO(errno.EAFNOSUPPORT)
    filt.add_rule(deny, call, sc.Arg(0, sc.GT, INT_MAX_UNSIGNED))
    for family in range(max(ALLOWED_FAMILIES)):
        if family not in ALLOWED_FAMILIES:
            filt.add_rule(deny, call, sc.Arg(0, sc.EQ, family))
    filt.add_rule(deny, call, sc.Arg(0, sc.GT, max(ALLOWED_FAMILIES)))
    # Netlink: routing only (a NETLINK_ROUTE with garbage in its upper half is refused too).
    filt.add_rule(deny, call, sc.Arg(0, sc.EQ, AF_NETLINK), sc.Arg(2, sc.NE, NETLINK_ROUTE))
