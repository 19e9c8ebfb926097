"""The non-root leg's server user: what LocalServer opens up for it is closed again on close()."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from pandastack_local import LocalServer
from pandastack_local.harness import SERVER_USER_ENV


def test_modes_opened_for_the_server_user_are_restored_on_close(tmp_path: Path) -> None:
    user = os.environ.get(SERVER_USER_ENV)
    if not user or os.getuid() != 0:
        pytest.skip(f"runs in the non-root leg (make test-nonroot sets {SERVER_USER_ENV} as root)")
    private = tmp_path / "private"
    template = private / "tpl"
    template.mkdir(parents=True)
    (template / "template.json").write_text('{"name": "private-tpl"}')
    private.chmod(0o700)
    (template / "template.json").chmod(0o600)
    with LocalServer(template_dirs=[str(template)], pool_size=0) as server:
        assert stat.S_IMODE(private.stat().st_mode) & 0o001, "the server user must traverse the parent"
        sb = server.client().sandboxes.create(template="private-tpl")
        server.client().sandboxes.delete(sb.id)
    assert stat.S_IMODE(private.stat().st_mode) == 0o700
    assert stat.S_IMODE((template / "template.json").stat().st_mode) == 0o600
