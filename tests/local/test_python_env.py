"""Templates that carry a host Python environment and code, bound read-only at their own paths."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pandastack_local import LocalServer
from pandastack_local.templates.registry import TemplateError, load_template_dir
from tests.support.server import GVISOR

HOST_REPO = Path(__file__).resolve().parents[2]


def write_template(directory: Path, **spec: object) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "template.json").write_text(json.dumps(spec))
    return directory


@pytest.fixture(scope="module")
def code_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    code = tmp_path_factory.mktemp("flowcode")
    # A sandbox's root is an unprivileged host uid: what it reads must be world-readable (o+rX),
    # as a container image layer is; pytest's temp dirs are 0700.
    code.chmod(0o755)
    (code / "jobmod.py").write_text("ANSWER = 42\n")
    return code


@pytest.fixture(scope="module")
def env_server(tmp_path_factory: pytest.TempPathFactory, code_dir: Path) -> Iterator[LocalServer]:
    templates = tmp_path_factory.mktemp("pyenv-templates")
    write_template(templates / "pyenv", python_env=sys.prefix, code_dirs=[str(code_dir)], memory_mb=512)
    with LocalServer(template_dirs=[str(templates / "pyenv")], pool_size=0) as server:
        yield server


def run(server: LocalServer, command: str) -> tuple[int, str, str]:
    client = server.client()
    sb = client.sandboxes.create(template="pyenv")
    try:
        result = sb.exec(command, timeout_seconds=60)
        return int(result.exit_code), str(result.stdout), str(result.stderr)
    finally:
        sb.kill()


def test_the_environment_runs_inside_as_python_on_path(env_server: LocalServer) -> None:
    code, out, err = run(
        env_server, "python -c 'import sys, pytest; print(sys.prefix); print(pytest.__file__)'"
    )
    assert code == 0, err
    prefix, module = out.split()
    assert prefix == sys.prefix
    assert module.startswith(sys.prefix)


def test_code_dir_is_importable_at_its_own_path(env_server: LocalServer, code_dir: Path) -> None:
    code, out, err = run(env_server, f"cd {code_dir} && python -c 'import jobmod; print(jobmod.ANSWER)'")
    assert (code, out.strip()) == (0, "42"), err


def test_environment_and_code_are_read_only(env_server: LocalServer, code_dir: Path) -> None:
    # gVisor checks permissions before the mount's read-only flag: the environment is host root's,
    # which is nobody inside a sandbox of its own host uid.
    refusal = "Permission denied" if GVISOR else "Read-only file system"
    for target in (Path(sys.prefix) / "pwned", code_dir / "pwned"):
        code, _, err = run(env_server, f"echo x > {target}")
        assert code != 0
        assert refusal in err
        assert not target.exists()


def test_nothing_else_of_the_host_comes_along(env_server: LocalServer) -> None:
    # The venv's editable install points at this repository, which is not bound.
    code, out, _ = run(
        env_server, f"test -e {HOST_REPO}/pandastack_local/egress.py && echo VISIBLE || echo absent"
    )
    assert (code, out.strip()) == (0, "absent")


def test_a_plain_template_keeps_the_system_python(local_server: LocalServer) -> None:
    sb = local_server.client().sandboxes.create(template="base")
    try:
        out = sb.exec("python3 -c 'import sys; print(sys.prefix)'", timeout_seconds=30)
        assert out.stdout.strip() == "/usr"
    finally:
        sb.kill()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"python_env": "relative/venv"}, "python_env must be an absolute path"),
        ({"python_env": "/nonexistent/venv"}, "is not a directory"),
        ({"python_env": "/tmp"}, "has no bin/python"),
        ({"code_dirs": ["/proc/self"]}, "may not be / or under /proc"),
        ({"code_dirs": ["/"]}, "may not be /"),
        ({"code_dirs": 5}, "code_dirs must be a list"),
    ],
)
def test_bad_template_names_the_field(tmp_path: Path, spec: dict[str, object], message: str) -> None:
    (tmp_path / "template.json").write_text(json.dumps(spec))
    with pytest.raises(TemplateError, match=message):
        load_template_dir(tmp_path)


def test_server_refuses_a_template_binding_its_state_dir(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    write_template(tmp_path / "leaky", code_dirs=[str(tmp_path)])
    server = LocalServer(template_dirs=[str(tmp_path / "leaky")], state_dir=state)
    with pytest.raises(RuntimeError, match="overlaps the server's state dir"):
        server.start()
    server.close()
