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

Generated with libseccomp (through ``pyseccomp``, a ctypes binding of the
system's ``libseccomp.so.2``) rather than hand-written BPF.
"""

from __future__ import annotations

import errno
import os
import tempfile

CLONE_NEWUSER = 0x10000000
# personality() flags that weaken the sandbox's own memory protections.
PER_MMAP_PAGE_ZERO = 0x0100000
PER_READ_IMPLIES_EXEC = 0x0400000
PER_ADDR_NO_RANDOMIZE = 0x0040000

# syscall -> why a job must not have it. Names this libseccomp does not know are skipped.
DENIED: dict[str, str] = {
    "keyctl": "kernel keyrings are shared per uid and per kernel: keys and quota cross sandboxes",
    "add_key": "kernel keyrings (see keyctl)",
    "request_key": "kernel keyrings (see keyctl); can also call out to a host helper",
    "io_uring_setup": "io_uring: large, fast-moving kernel surface, bypasses the other syscall checks",
    "io_uring_enter": "io_uring (see io_uring_setup)",
    "io_uring_register": "io_uring (see io_uring_setup)",
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
    "ptrace": "tracing the sandbox's init (which shares an eventfd with the host-side bwrap)",
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
        filt.add_rule(sc.ERRNO(errno.EPERM), "personality", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    with tempfile.TemporaryFile() as out:
        filt.export_bpf(out)
        out.seek(0)
        return out.read()


def filter_fd(program: bytes) -> int:
    """A pipe read end holding ``program`` (bwrap reads it to EOF); the caller closes it."""
    read_end, write_end = os.pipe()
    with os.fdopen(write_end, "wb") as w:
        w.write(program)
    return read_end
