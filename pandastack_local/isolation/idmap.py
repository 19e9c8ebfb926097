"""Host uids for the sandboxes' root: each sandbox's uid 0 is an unprivileged host uid.

A root server gives every live sandbox its own uid from a block of the range
systemd reserves for containers (524288-1879048191), chosen per server instance
so that servers sharing a host rarely overlap, and never one that a host
account uses. What a sandbox then owns, uses up or reaches on the host (the
per-user limits such as inotify instances, key quotas, RLIMIT_NPROC, files a
failed wall would let it write) is that nobody-uid's, not root's and not a
neighbour's. A non-root server cannot map other uids: its sandboxes' root is
the server's own uid (see docs/local-server.md, "which walls need root").
"""

from __future__ import annotations

import os
import pwd

RANGE_START = 0x60000000  # inside systemd's container range, above nspawn's usual picks
BLOCK = 4096  # uids per server instance: more than one server's live sandboxes
BLOCKS = 0x0F000000 // BLOCK  # stays below 0x6F000000, inside the container range


class UidPool:
    """Hands out distinct host uids to live sandboxes of one server (root only)."""

    def __init__(self, instance: str) -> None:
        self.base = RANGE_START + (int(instance, 16) % BLOCKS) * BLOCK
        self.free = list(range(self.base, self.base + BLOCK))
        self.used: dict[str, int] = {}

    @staticmethod
    def available() -> bool:
        """Only the host's root may map a sandbox's root to another host uid (not a server that is
        root only inside its own user namespace, as a non-root server is: see mountns)."""
        if os.geteuid() != 0:
            return False
        try:
            with open("/proc/self/uid_map") as f:
                return f.read().split() == ["0", "0", "4294967295"]
        except OSError:
            return False

    def take(self, name: str) -> int:
        while self.free:
            uid = self.free.pop(0)
            try:
                pwd.getpwuid(uid)
            except KeyError:
                self.used[name] = uid
                return uid
        raise RuntimeError("no free host uid left for a sandbox: too many live sandboxes")

    def give_back(self, name: str) -> None:
        uid = self.used.pop(name, None)
        if uid is not None:
            self.free.append(uid)
