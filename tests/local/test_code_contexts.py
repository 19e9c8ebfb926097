"""Code contexts (issue 13 item 3) through the real SDK against a real pandastack-local on the
``code-interpreter`` template: ``sb.create_code_context()``, ``ctx.run_code()``, ``close()``."""

from __future__ import annotations

import base64
import concurrent.futures
import io
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pandastack
import pytest
from PIL import Image

from pandastack_local import LocalServer
from pandastack_local.limits import MAX_REPL_OUTPUT_BYTES, MAX_REPL_REPLY_BYTES


@pytest.fixture
def sb(local_server: LocalServer) -> Iterator[Any]:
    with local_server.client().sandboxes.create(template="code-interpreter") as sandbox:
        yield sandbox


def kernels(sb: Any) -> list[str]:
    """The code contexts' python processes in the sandbox, one per context: each context is a
    supervisor running ``repl_kernel.py`` with its kernel (the same program) as its child, so the
    count is of the ``repl_kernel.py`` processes whose parent is not one (a stray kernel counts)."""
    rows = [line.split(None, 2) for line in sb.exec("ps -eo pid=,ppid=,args=").stdout.splitlines()]
    repl = {row[0] for row in rows if len(row) == 3 and "repl_kernel.py" in row[2]}
    return [" ".join(row) for row in rows if row[0] in repl and row[1] not in repl]


def test_variables_persist_and_streams_come_apart(sb: Any) -> None:
    with sb.create_code_context() as ctx:
        first = ctx.run_code("import os, sys\nx = 41\nprint('to out')\nprint('to err', file=sys.stderr)")
        assert (first.stdout, first.stderr, first.error, first.exit_code) == ("to out\n", "to err\n", None, 0)
        later = ctx.run_code("x + 1")
        assert later.text == "42" and later.stdout == "42\n"  # the last expression, as on the real server
        sub = ctx.run_code("import subprocess\nsubprocess.run(['sh', '-c', 'echo from-child; echo e >&2'])")
        assert "from-child\n" in sub.stdout and sub.stderr == "e\n"  # captured at the fd level
        frame = ctx.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2]})")
        assert "<table" in (frame.results[0].html or "") and "a" in (frame.text or "")


def test_an_exception_comes_back_as_the_error(sb: Any, local_http: httpx.Client) -> None:
    with sb.create_code_context() as ctx:
        ex = ctx.run_code("def f():\n    return 1 / 0\nf()")
        assert ex.exit_code == 1 and ex.error is not None
        assert ex.error.rstrip().endswith("ZeroDivisionError: division by zero")
        assert 'File "<cell>", line 2, in f' in ex.error and "repl_kernel" not in ex.error
        assert ex.stderr == ex.error  # the real server's kernel prints the traceback to stderr
        raw = local_http.post(f"/v1/sandboxes/{sb.id}/repl/sessions/{ctx.id}/run", json={"code": "{}['k']"})
        exc = raw.json()["exception"]
        assert (exc["name"], exc["value"]) == ("KeyError", "'k'") and "KeyError" in exc["traceback"]
        assert ctx.run_code("'still here'").text == "'still here'"


def test_plt_show_returns_a_real_png(sb: Any) -> None:
    code = (
        "import matplotlib.pyplot as plt\n"
        "fig, ax = plt.subplots(figsize=(4, 3), dpi=100)\n"
        "ax.bar(['a', 'b', 'c'], [3, 1, 2], color='tab:red')\n"
        "plt.show()\n"
        "len(plt.get_fignums())"
    )
    with sb.create_code_context() as ctx:
        ex = ctx.run_code(code)
    assert ex.error is None, ex.error
    assert ex.text == "0"  # show() saved and closed the figure
    image = Image.open(io.BytesIO(base64.b64decode(ex.png or "")))
    assert image.format == "PNG"
    assert 250 <= image.width <= 420 and 180 <= image.height <= 320, image.size
    rgb = image.convert("RGB")
    reds = sum(1 for r, g, b in rgb.getdata() if r > 180 and g < 80 and b < 80)
    assert reds > 2000, reds  # the bars are drawn, not a blank figure
    assert len(set(rgb.getdata())) > 10


def test_a_timeout_interrupts_the_run_and_the_context_survives(sb: Any) -> None:
    with sb.create_code_context() as ctx:
        ctx.run_code("x = 'kept'")
        with pytest.raises(pandastack.SandboxTimeout):
            ctx.run_code("import time\nwhile True: time.sleep(0.1)", timeout_seconds=1)
        assert ctx.run_code("x").text == "'kept'"


def test_code_that_will_not_stop_is_killed_and_says_its_state_is_lost(sb: Any) -> None:
    # Swallows the interrupt, so only killing its process stops it.
    stubborn = (
        "import time\nwhile True:\n    try:\n        time.sleep(10)\n    except BaseException:\n        pass"
    )
    ctx = sb.create_code_context()
    with pytest.raises(pandastack.SandboxTimeout):
        ctx.run_code(stubborn, timeout_seconds=1)
    with pytest.raises(pandastack.NotFoundError, match="not found in sandbox"):
        ctx.run_code("1")
    assert kernels(sb) == []


def test_a_crashed_context_is_a_clear_error(sb: Any) -> None:
    ctx = sb.create_code_context()
    with pytest.raises(pandastack.ServerError, match=r"exited \(code 3\): its state is lost"):
        ctx.run_code("import os\nos._exit(3)")
    with pytest.raises(pandastack.NotFoundError):
        ctx.run_code("1")


def test_close_leaves_no_process_and_contexts_are_independent(sb: Any, local_http: httpx.Client) -> None:
    a, b = sb.create_code_context(), sb.create_code_context()
    assert len(kernels(sb)) == 2
    a.run_code("x = 'a'")
    assert "NameError: name 'x' is not defined" in (b.run_code("x").error or "")
    a.close()
    assert len(kernels(sb)) == 1
    listed = local_http.get(f"/v1/sandboxes/{sb.id}/repl/sessions").json()
    assert [c["id"] for c in listed] == [b.id] and listed[0]["cells"] == 1
    b.close()
    assert kernels(sb) == []


def test_output_is_capped_per_run(sb: Any) -> None:
    with sb.create_code_context() as ctx:
        ex = ctx.run_code(f"print('x' * {MAX_REPL_OUTPUT_BYTES + 100_000})")
    assert ex.stdout.startswith("x" * MAX_REPL_OUTPUT_BYTES)
    assert "100001 more bytes of stdout dropped" in ex.stdout
    assert len(ex.stdout) < MAX_REPL_OUTPUT_BYTES + 512


def test_a_forged_reply_is_checked_and_a_flood_ends_the_context(sb: Any) -> None:
    """Code in the context can write to its channel to the agent itself (and, in its own memory,
    find the run's token that a reply must carry): the server keeps only known fields of known
    types, and never reads more than MAX_REPL_REPLY_BYTES."""
    forge = (
        "import os, sys\n"
        "f = sys._getframe()\n"
        "while 'request' not in f.f_locals:\n"
        "    f = f.f_back\n"
        "token = f.f_locals['request']['token'].encode()\n"
        'os.write(int(sys.argv[2]), b\'{"token": "\' + token + b\'", "stdout": 5, "exit": "no", "results": '
        '[{"type": "text/x-evil", "data": "x"}, {"text/plain": "ok", "evil": "y"}]}\\n\')'
    )
    with sb.create_code_context() as ctx:
        ex = ctx.run_code(forge)
        assert (ex.stdout, ex.exit_code, [r.data for r in ex.results]) == ("", 1, [{"text/plain": "ok"}])
    flood = f"import os, sys\nos.write(int(sys.argv[2]), b'x' * {MAX_REPL_REPLY_BYTES + (1 << 20)})"
    ctx = sb.create_code_context()
    with pytest.raises(pandastack.ServerError, match=r"over the \d+-byte cap and was killed"):
        ctx.run_code(flood)
    assert kernels(sb) == []


def test_bad_input_is_a_json_4xx_naming_the_field(sb: Any, local_http: httpx.Client) -> None:
    base = f"/v1/sandboxes/{sb.id}/repl/sessions"
    r = local_http.post(base, json={"language": "ruby"})
    assert r.status_code == 400 and "language" in r.json()["error"]
    with pytest.raises(pandastack.BadRequestError, match="language"):
        sb.create_code_context(language="ruby")
    cid = local_http.post(base, json={"language": "python"}).json()["id"]
    bad = (({}, "code"), ({"code": ""}, "code"), ({"code": "1", "timeout_ms": "5"}, "timeout_ms"))
    for body, field in bad:
        r = local_http.post(f"{base}/{cid}/run", json=body)
        assert r.status_code == 400 and field in r.json()["error"], (body, r.text)
    for unknown in ("0" * 32, "nope"):
        r = local_http.post(f"{base}/{unknown}/run", json={"code": "1"})
        assert r.status_code == 404 and "code context" in r.json()["error"], r.text
        assert local_http.delete(f"{base}/{unknown}").status_code == 404
    assert local_http.delete(f"{base}/{cid}").status_code == 204


def test_a_deleted_sandbox_is_a_clear_error_not_a_hang(local_server: LocalServer) -> None:
    client = local_server.client()
    sandbox = client.sandboxes.create(template="code-interpreter")
    ctx = sandbox.create_code_context()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(ctx.run_code, "import time\ntime.sleep(60)", timeout_seconds=120)
        time.sleep(1)
        started = time.monotonic()
        client.sandboxes.delete(sandbox.id)
        with pytest.raises(pandastack.ServerError, match="not running"):
            running.result(timeout=20)
        assert time.monotonic() - started < 15
    with pytest.raises(pandastack.NotFoundError):
        ctx.run_code("1")
