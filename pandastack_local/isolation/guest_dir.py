"""The read-only files every sandbox gets at ``/.pandastack``: the guest code (``guest/``) and a
minimal ``/etc``. Written by the host once at start-up, before any guest runs."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

GUEST_CODE = Path(__file__).resolve().parent.parent / "guest"
AGENT_SOURCE = GUEST_CODE / "agent.py"
REPL_KERNEL_SOURCE = GUEST_CODE / "repl_kernel.py"  # a code context's python
AGENT_CODE = "agent.pyc"
# Compiles argv[1] into argv[2], run by the guest's own interpreter (its bytecode's magic number).
_COMPILE = "import py_compile, sys; py_compile.compile(sys.argv[1], cfile=sys.argv[2], doraise=True)"
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
    compile_agent(path)
    shutil.copyfile(REPL_KERNEL_SOURCE, path / "repl_kernel.py")
    for name, text in _ETC_FILES.items():
        (etc / name).write_text(text)
    # Multiarch library lookup and Debian's /etc/alternatives symlinks (awk, etc.).
    if Path("/etc/ld.so.cache").exists():
        shutil.copyfile("/etc/ld.so.cache", etc / "ld.so.cache")
    if Path("/etc/alternatives").is_dir():
        shutil.copytree("/etc/alternatives", path / "alternatives", symlinks=True)
    return path


def compile_agent(path: Path) -> bool:
    """``agent.pyc`` beside ``agent.py`` in the guest dir, compiled once here by the interpreter
    that runs it in every sandbox: a sandbox's first process then starts from bytecode instead of
    compiling the agent's source at every start (about 7 ms of CPU a sandbox, of the ~50 ms a
    create and delete cost: benchmarks/RESULTS.md, section 11). False (and no ``agent.pyc``: the
    sandboxes run ``agent.py``) if that interpreter cannot compile it."""
    from pandastack_local.isolation.process import GUEST_PYTHON

    source, code = path / "agent.py", path / AGENT_CODE
    argv = [GUEST_PYTHON, "-I", "-S", "-c", _COMPILE, str(source), str(code)]
    try:
        subprocess.run(argv, check=True, capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        code.unlink(missing_ok=True)
        return False
    return True


def agent_path(path: Path) -> str:
    """The agent's path in the sandbox: its bytecode when :func:`compile_agent` made it."""
    return f"/.pandastack/{AGENT_CODE}" if (path / AGENT_CODE).is_file() else "/.pandastack/agent.py"
