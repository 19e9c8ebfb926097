"""The Prefect collection's renamed module keeps its old import path, and its exceptions share
one base."""

from __future__ import annotations

from tests.unit.core.test_names import assert_moved


def test_errors_is_exceptions() -> None:
    assert_moved("prefect_blocks.errors", "prefect_blocks.exceptions")
    from prefect_blocks.errors import SandboxJobFailed

    from prefect_blocks.exceptions import SandboxJobFailed as New

    assert SandboxJobFailed is New
