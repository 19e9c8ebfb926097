"""A state dir too deep for the agents' unix sockets is refused when the server starts, with the fix,
instead of every create failing later with a bare 500 ("AF_UNIX path too long")."""

from __future__ import annotations

from pathlib import Path

import pytest

from pandastack_local import LocalServer


def test_a_state_dir_too_deep_for_agent_sockets_is_refused_at_start(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 50) / ("e" * 50)
    server = LocalServer(state_dir=deep, pool_size=0)
    try:
        with pytest.raises(RuntimeError, match=r"too deep .* pass a shorter --state-dir"):
            server.start()
    finally:
        server.close()
