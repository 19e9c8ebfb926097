"""Issue 36: a queue worker's first hour, from docs/queues.md alone. One test per friction found:
the install line for each case (the hosted API, a local server), the missing extra's hint (a clone's
install line, not the package index, which does not have the distribution), the group name (the
help's example and the documented default are the transport's), and a Redis with a password in the
URL form the docs give (a real redis-server, started here on a free loopback port)."""

from __future__ import annotations

import re
import subprocess
import sys
from urllib.parse import quote

import pytest
import tomllib

from tests.docs.snippets import ROOT

QUEUES = (ROOT / "docs" / "queues.md").read_text()
EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def test_each_case_has_an_install_line_of_extras_that_exist() -> None:
    install = QUEUES.split("### Install", 1)[1].split("### A Redis", 1)[0]
    lines = re.findall(r"pip install '\.\[([a-z,]+)\]'", install)
    assert "queue" in lines and "queue,local" in lines, lines
    for extras in lines:
        assert set(extras.split(",")) <= set(EXTRAS), extras
    # The local-server case installs the server itself, and says PANDASTACK_API must be set for it.
    assert any(r.startswith(("fastapi", "uvicorn")) for r in EXTRAS["local"])
    assert "PANDASTACK_API=http://127.0.0.1:8321" in install and "set it even on the default port" in install
    assert "pandastack-workflows[" not in QUEUES  # an index install: the distribution is not there


def _stderr_without(blocked: str, code: str) -> str:
    """What ``code`` prints to stderr when the module ``blocked`` cannot be imported."""
    prelude = f"import sys; sys.path.insert(0, {str(ROOT)!r}); sys.modules[{blocked!r}] = None; "
    proc = subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=60)
    return proc.stderr


def test_a_missing_queue_extra_names_the_clone_install_line() -> None:
    code = "from pandastack_jobs.queue.cli import main; sys.exit(main(['send', '--broker', 'redis://127.0.0.1:1/0']))"
    err = _stderr_without("redis", code)
    assert "the [queue] extra: in a clone of the repository, pip install '.[queue]'" in err, err
    assert "pandastack-workflows[" not in err and "not on the package index" in err


def test_a_missing_local_extra_names_the_clone_install_line() -> None:
    code = "from pandastack_local.cli import main; main(['serve', '--port', '0'])"
    err = _stderr_without("uvicorn", code)
    assert "the [local] extra: in a clone of the repository, pip install '.[local]'" in err, err
    assert "[queue,local]" in err and "pandastack-workflows[" not in err


def test_the_help_example_and_the_docs_name_the_transports_default_group() -> None:
    from pandastack_jobs.queue.cli import EXAMPLES
    from pandastack_jobs.queue.redis_streams import RedisStreamsTransport

    default = RedisStreamsTransport("redis://127.0.0.1:6379/0?stream=jobs").group
    assert default == "pandastack"
    assert set(re.findall(r"group=(\w+)", EXAMPLES)) == {default}
    assert set(re.findall(r"group=(\w+)", QUEUES)) == {default}


def _cli(args: list[str], stdin: str) -> subprocess.CompletedProcess[str]:
    """``pandastack-jobs ARGS`` from this checkout, ``stdin`` on its standard input."""
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); from pandastack_jobs.queue.cli import main; "
    code += f"sys.exit(main({args!r}))"
    return subprocess.run(
        [sys.executable, "-c", code], input=stdin, capture_output=True, text=True, timeout=60
    )


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> object:
    from demo.redis_server import redis_server

    log = tmp_path_factory.mktemp("redis") / "redis.log"
    with redis_server(log) as url:  # redis://:PASSWORD@127.0.0.1:PORT/0, requirepass in a 0600 file
        yield url


def test_the_documented_password_url_reaches_a_redis_with_requirepass(redis_url: str) -> None:
    from pandastack_jobs.queue import open_transport

    password = re.match(r"redis://:([^@]+)@", redis_url).group(1)  # type: ignore[union-attr]
    assert "redis://:PASSWORD@host:6379/0?stream=jobs" in QUEUES  # the form the docs give
    broker = f"{redis_url}?stream=first-hour"
    sent = _cli(["send", "--broker", broker], '{"id": "r-1", "command": "true"}\n')
    assert sent.returncode == 0, sent.stderr
    transport = open_transport(broker, 30)
    transport.connect()
    try:
        (delivery,) = transport.receive(1, 5)
        assert b'"r-1"' in delivery.body
        transport.ack(delivery)
    finally:
        transport.close()
    # A wrong password: refused at the start, and the error shows no password.
    wrong = broker.replace(password, quote("not-it@x", safe=""))
    err = _cli(["send", "--broker", wrong], "{}\n")
    assert err.returncode == 3 and "cannot reach the broker" in err.stderr, err.stderr
    assert password not in err.stderr and "not-it" not in err.stderr
