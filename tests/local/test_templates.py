"""Templates with real software: code-interpreter's data stack, base's python3 + node, user templates
built from a requirements file, and their failures (a bad line, a package that cannot be installed)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandastack
import pytest

from pandastack_local import LocalServer
from pandastack_local.templates import build as template_build
from pandastack_local.templates.build import TemplateBuildError, parse_requirements
from tests.support.server import GVISOR


def write_template(directory: Path, **spec: object) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "template.json").write_text(json.dumps(spec))
    return directory


DATA_STACK = "numpy pandas scipy sklearn matplotlib seaborn pyarrow openpyxl requests sqlalchemy orjson"


def test_code_interpreter_has_the_data_stack_and_headless_matplotlib(ps_client) -> None:
    with ps_client.sandboxes.create(template="code-interpreter") as sb:
        imports = sb.exec(f"python3 -c 'import {', '.join(DATA_STACK.split())}; print(\"ok\")'")
        assert (imports.exit_code, imports.stdout) == (0, "ok\n"), imports.stderr[-2000:]
        chart = sb.exec(
            "cd /work && python3 -c '"
            "import matplotlib.pyplot as plt, seaborn as sns, pandas as pd\n"
            'df = pd.DataFrame({"day": ["mon", "tue"], "n": [3, 5]})\n'
            'sns.barplot(df, x="day", y="n"); plt.savefig("chart.png"); print(plt.get_backend())\''
        )
        # Agg without being told, and the prebuilt font cache: no "building the font cache" warning.
        assert (chart.exit_code, chart.stdout, chart.stderr) == (0, "Agg\n", ""), chart.stderr[-2000:]
        png = sb.filesystem.read("/work/chart.png")
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000
        # Tracebacks name guest paths, not the host's cache dir.
        tb = sb.exec("python3 -c 'import pandas; pandas.read_csv(\"/nope.csv\")'")
        assert tb.exit_code == 1 and "/opt/pandastack/env/lib/" in tb.stderr
        assert ".cache/pandastack-local" not in tb.stderr


def test_template_software_is_read_only_and_shared(ps_client) -> None:
    with ps_client.sandboxes.create(template="code-interpreter") as a:
        probe = a.exec(
            "touch /opt/pandastack/env/x 2>&1; "
            'python3 -c \'import pandas, os; open(os.path.dirname(pandas.__file__) + "/x", "w")\' '
            "2>&1 | tail -1"
        )
        # gVisor checks permissions before the mount's read-only flag: the environment is host
        # root's, which is nobody inside a sandbox of its own host uid.
        refusal = "Permission denied" if GVISOR else "Read-only file system"
        assert probe.stdout.count(refusal) == 2, probe.stdout
        same = "stat -c %d:%i /opt/pandastack/env/bin/python3"
        with ps_client.sandboxes.create(template="code-interpreter") as b:
            assert a.exec(same).stdout == b.exec(same).stdout
        # A fork copies the sandbox's own disk, not the shared environment, and still has it.
        a.exec("mkdir -p /work && echo mine > /work/own.txt")
        child = a.fork()
        try:
            out = child.exec(f"cat /work/own.txt && {same} && python3 -c 'import pandas'")
            if GVISOR:  # gVisor numbers a restored sandbox's inodes afresh: same file, new number
                assert out.exit_code == 0 and re.fullmatch(r"mine\n\d+:\d+\n", out.stdout), out.stderr
            else:
                assert (out.exit_code, out.stdout) == (0, "mine\n" + a.exec(same).stdout), out.stderr
        finally:
            ps_client.sandboxes.delete(child.id)


def test_base_has_python3_and_node(ps_client) -> None:
    with ps_client.sandboxes.create(template="base") as sb:
        out = sb.exec("python3 -c 'print(1 + 1)' && node -e 'console.log(6 * 7)'")
        assert (out.exit_code, out.stdout) == (0, "2\n42\n"), out.stderr


def test_requirements_lines_are_validated_with_the_line_in_the_message() -> None:
    assert parse_requirements(["# comment", "", "six>=1.16  # why", "pandas[excel]==2.2.3"], "r.txt") == (
        "six>=1.16",
        "pandas[excel]==2.2.3",
    )
    with pytest.raises(TemplateBuildError, match=r"r.txt line 2: 'six=>1\.16'"):
        parse_requirements(["numpy", "six=>1.16"], "r.txt")
    with pytest.raises(TemplateBuildError, match=r"line 1: '--index-url http://x/': pip options are not"):
        parse_requirements(["--index-url http://x/"], "r.txt")


def test_templates_build_cli_stops_at_a_bad_line(tmp_path: Path) -> None:
    bad = write_template(tmp_path / "bad", name="bad", requirements="requirements.txt")
    (bad / "requirements.txt").write_text("six\nnot a requirement!\n")
    out = subprocess.run(
        [sys.executable, "-m", "pandastack_local", "templates", "build", "bad", "--template-dir", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "requirements.txt line 2: 'not a requirement!'" in out.stderr


@pytest.fixture(scope="module")
def user_templates(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A user template from a requirements file, and one whose package cannot be installed."""
    base = tmp_path_factory.mktemp("user-templates")
    good = write_template(base / "withsix", name="withsix", requirements="requirements.txt", memory_mb=512)
    (good / "requirements.txt").write_text("six==1.16.0\n")
    broken = write_template(base / "broken", name="broken", requirements=["six==0.0.1"])
    return good, broken


@pytest.fixture
def private_cache() -> Iterator[dict[str, Path]]:
    """A state dir with its own template cache inside (a server run as another user may write it),
    short enough for the agents' socket paths. With no warm pool, a server builds only what is
    created: the built-ins are not rebuilt here."""
    state = Path(tempfile.mkdtemp(prefix="ps-tpl-"))
    yield {"state_dir": state, "cache_dir": state / "cache"}
    shutil.rmtree(state, ignore_errors=True)


def serve_with_private_cache(
    make_local_server: Any, dirs: dict[str, Path], template: Path
) -> tuple[LocalServer, Any, Path]:
    """A server with only ``template`` and its own build cache; a client whose creates wait out a
    slow (loaded) build; the cache dir."""
    server = make_local_server(template_dirs=[str(template)], pool_size=0, **dirs)
    return server, server.client(max_create_retry_seconds=600), dirs["cache_dir"]


def test_user_template_from_a_requirements_file_is_built_once(
    user_templates, make_local_server, private_cache
) -> None:
    good, _ = user_templates
    server, client, cache = serve_with_private_cache(make_local_server, private_cache, good)
    with client.sandboxes.create(template="withsix") as sb:
        out = sb.exec("python3 -c 'import six; print(six.__version__)'")
        assert (out.exit_code, out.stdout) == (0, "1.16.0\n"), out.stderr
        assert sb.memory_mb == 512
    [built] = [p for p in (cache / "templates").glob("withsix-*") if p.is_dir()]
    marker = json.loads((built / template_build.MARKER).read_text())
    assert marker["requirements"] == ["six==1.16.0"]
    stamp = (built / template_build.MARKER).stat().st_mtime_ns
    assert "pip install" in server.log_tail(400)
    # A restarted server (and a second server on the same cache) reuses it: no pip at all.
    server.stop()
    server.start()
    with client.sandboxes.create(template="withsix") as sb:
        assert sb.exec("python3 -c 'import six'").exit_code == 0
    assert (built / template_build.MARKER).stat().st_mtime_ns == stamp
    assert server.log_tail(400).count("pip install") == 1


def test_failed_build_names_the_package_and_the_server_keeps_serving(
    user_templates, make_local_server, private_cache
) -> None:
    _, broken = user_templates
    _, client, cache = serve_with_private_cache(make_local_server, private_cache, broken)
    with pytest.raises(pandastack.ServerError) as err:
        client.sandboxes.create(template="broken")
    message = str(err.value)
    assert "template 'broken' is not available" in message and "six==0.0.1" in message, message
    with client.sandboxes.create(template="base") as sb:
        assert sb.exec("true").exit_code == 0
    assert not [p for p in (cache / "templates").glob("broken-*") if p.is_dir()]
    # Nothing else was built in that cache: builds happen when a template is first needed.
    assert not [p for p in (cache / "templates").iterdir() if p.is_dir()]


# A local package whose build hook starts two children (as ``compileall -j 0`` starts its workers)
# and then waits: a build that is still running when its server stops.
SLOW_BACKEND = """
import subprocess, sys, time
def get_requires_for_build_wheel(config_settings=None):
    for _ in range(2):
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(900)", "{marker}"])
    time.sleep(900)
    return []
build_wheel = get_requires_for_build_wheel
"""


def build_processes(marker: str) -> list[int]:
    """The processes a template build started (by the marker on their command lines)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if marker.encode() in (proc / "cmdline").read_bytes():
                    found.append(int(proc.name))
            except OSError:
                pass
    return found


@pytest.mark.parametrize("stop", ["sigterm", "sigkill"])
def test_a_server_stopped_mid_build_leaves_no_build_process(
    make_local_server, private_cache, stop: str
) -> None:
    """The build runs in a process group of its own that dies with its server, however it stops:
    before, its step's children (pip's build hooks, ``compileall -j 0``'s workers) were orphaned."""
    marker = f"pandastack-slow-build-{uuid.uuid4().hex}"
    package = Path(tempfile.mkdtemp(prefix="ps-slowpkg-"))
    package.chmod(0o755)  # the unprivileged server's pip reads it
    (package / "backend.py").write_text(SLOW_BACKEND.format(marker=marker))
    (package / "pyproject.toml").write_text(
        '[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n'
        '[project]\nname = "slowpkg"\nversion = "1"\n'
    )
    base = Path(tempfile.mkdtemp(prefix="ps-slowtpl-"))
    try:
        template = write_template(base / "slow", name="slow", requirements=[f"slowpkg @ file://{package}"])
        server, _, _ = serve_with_private_cache(make_local_server, private_cache, template)
        client = server.client(max_create_retry_seconds=0)

        def create() -> None:  # starts the build; answered "still being built" or cut by the stop
            with contextlib.suppress(Exception):
                client.sandboxes.create(template="slow")

        threading.Thread(target=create, daemon=True).start()
        deadline = time.monotonic() + 120
        while len(build_processes(marker)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(build_processes(marker)) == 2, server.log_tail(40)
        server.stop(graceful=stop == "sigterm")
        deadline = time.monotonic() + 10
        while build_processes(marker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert build_processes(marker) == []
    finally:
        for pid in build_processes(marker):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(package, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)


def test_unknown_template_is_the_real_servers_500(ps_client, local_server) -> None:
    import httpx

    resp = httpx.post(
        f"{local_server.url}/v1/sandboxes",
        json={"template": "no-such-template"},
        headers={"Authorization": f"Bearer {local_server.api_key}"},
    )
    assert resp.status_code == 500
    assert resp.json() == {
        "error": 'template "no-such-template" is not on this host and could not be pulled: '
        "available templates: base, code-interpreter"
    }
