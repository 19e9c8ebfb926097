"""The read-only files every sandbox gets at ``/.pandastack``: the guest code (``guest/``) and a
minimal ``/etc``. Written by the host once at start-up, before any guest runs."""

from __future__ import annotations

import shutil
from pathlib import Path

GUEST_CODE = Path(__file__).resolve().parent.parent / "guest"
AGENT_SOURCE = GUEST_CODE / "agent.py"
REPL_KERNEL_SOURCE = GUEST_CODE / "repl_kernel.py"  # a code context's python
_ETC_FILES = {
    "passwd": "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
    "group": "root:x:0:\nnogroup:x:65534:\n",
    "hosts": "127.0.0.1\tlocalhost sandbox\n::1\tlocalhost ip6-localhost\n",
    "hostname": "sandbox\n",
    "nsswitch.conf": "passwd: files\ngroup: files\nhosts: files\n",
    "resolv.conf": "",
}


def prepare_guest_dir(path: Path) -> Path:
    """Write the read-only files every sandbox gets at /.pandastack (agent, code-context kernel,
    minimal /etc)."""
    etc = path / "etc"
    if path.exists():
        shutil.rmtree(path)
    etc.mkdir(parents=True)
    shutil.copyfile(AGENT_SOURCE, path / "agent.py")
    shutil.copyfile(REPL_KERNEL_SOURCE, path / "repl_kernel.py")
    for name, text in _ETC_FILES.items():
        (etc / name).write_text(text)
    # Multiarch library lookup and Debian's /etc/alternatives symlinks (awk, etc.).
    if Path("/etc/ld.so.cache").exists():
        shutil.copyfile("/etc/ld.so.cache", etc / "ld.so.cache")
    if Path("/etc/alternatives").is_dir():
        shutil.copytree("/etc/alternatives", path / "alternatives", symlinks=True)
    return path
