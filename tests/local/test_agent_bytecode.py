"""The guest agent starts from bytecode compiled once per server, not from its source per sandbox.

Why: compiling the agent's ~1,300 lines cost every sandbox start about 7 ms of CPU (of the ~50 ms
a create and delete cost), measured by benchmarks/kafka.py (benchmarks/RESULTS.md, section 11).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from pandastack_local.isolation import guest_dir
from pandastack_local.isolation.process import GUEST_PYTHON


def test_the_guest_dir_holds_the_agent_compiled_by_the_guest_python(tmp_path: Path) -> None:
    path = guest_dir.prepare_guest_dir(tmp_path / "guest")
    code = path / guest_dir.AGENT_CODE
    assert code.is_file()
    # The guest interpreter's own magic number: the bytecode is for the python that runs it.
    magic = subprocess.run(
        [GUEST_PYTHON, "-I", "-S", "-c", "import importlib.util as u; print(u.MAGIC_NUMBER.hex())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert code.read_bytes()[:4].hex() == magic
    assert guest_dir.agent_path(path) == "/.pandastack/agent.pyc"
    assert (path / "agent.py").read_bytes() == guest_dir.AGENT_SOURCE.read_bytes()


def test_without_a_compiling_guest_python_the_sandboxes_run_the_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("pandastack_local.isolation.process.GUEST_PYTHON", str(tmp_path / "no-python"))
    path = guest_dir.prepare_guest_dir(tmp_path / "guest")
    assert not (path / guest_dir.AGENT_CODE).exists()
    assert guest_dir.agent_path(path) == "/.pandastack/agent.py"


def test_a_sandbox_init_is_the_agent_bytecode(ps_client: Any) -> None:
    sb = ps_client.sandboxes.create(template="base", ttl_seconds=60)
    try:
        init = sb.exec("tr '\\0' ' ' < /proc/1/cmdline", timeout_seconds=30).stdout
        assert init.startswith(f"{GUEST_PYTHON} -I -S /.pandastack/agent.pyc "), init
        assert sb.exec("echo ok", timeout_seconds=30).stdout.strip() == "ok"
    finally:
        sb.kill()
