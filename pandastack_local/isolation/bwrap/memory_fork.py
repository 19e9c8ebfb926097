"""Why a bwrap fork copies the disk only, and says so (issue 27, item 2: the spike's outcome).

A memory fork must put a running copy of the parent's processes into a sandbox as walled as a
fresh one: its own pid, user, mount, net, ipc, uts and cgroup namespaces, its own cgroup and
host uid, no descriptor or page shared with the parent or a sibling. Measured and reasoned here
(docs/local-server.md, "Memory fork under bwrap: the spike"):

- ``fork()`` cannot get there. A process's pid namespace is fixed when it is made, and a fork of
  a process in the parent sandbox lands in the parent's pid namespace or one nested below it;
  its uid is the parent's host uid (the parent's user namespace maps only that one), which owns
  any user namespace the copy makes: the parent could see, signal and ptrace every child. The
  copy also shares the parent's ``MAP_SHARED`` pages and inherits its descriptors (channels
  between siblings). A zygote forked *before* it is sandboxed (SOCK, Sandbox2) avoids all that,
  but it only carries what the trusted server preloaded (imports), never a tenant's state.
- Checkpoint/restore (CRIU) copies instead of sharing and restores into fresh namespaces, which
  is the right shape; Debian's criu 3.17 cannot start on kernels 6.13+ (``criu check``: "vdso:
  Unexpected rt vDSO area bounds", the ``[vvar_vclock]`` mapping; fixed in criu 4.0). It is not
  wired in.

So ``BwrapBackend.memory_forker()`` is None and every bwrap fork answers ``memory_copied: false``
with ``WHY_NOT``; a fork that asks ``require_memory`` is refused (409) before any child is made.
"""

from __future__ import annotations

WHY_NOT = (
    "under --isolation bwrap a fork copies the parent's disk only, not its memory or processes "
    "(a live process can reach a fresh sandbox only by checkpoint/restore, which is not available "
    "here: see docs/local-server.md, 'Memory fork under bwrap')"
)
