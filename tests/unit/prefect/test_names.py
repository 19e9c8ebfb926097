"""The Prefect collection's renamed module keeps its old import path, and its exceptions share
one base."""

from __future__ import annotations

from tests.unit.core.test_names import assert_moved, assert_one_base


def test_errors_is_exceptions() -> None:
    assert_moved("prefect_blocks.errors", "prefect_blocks.exceptions")
    from prefect_blocks.errors import SandboxJobFailed

    from prefect_blocks.exceptions import SandboxJobFailed as New

    assert SandboxJobFailed is New


def test_every_collection_exception_is_a_pandastack_prefect_error() -> None:
    import pickle

    from prefect_blocks import PandaStackPrefectError, SandboxJobFailed
    from prefect_blocks.queue import QueueMessageFailed

    # UntestedPrefectWarning: a warning category for filters, from versions.py, which runs first.
    assert_one_base("prefect_blocks", PandaStackPrefectError, foreign=frozenset({"UntestedPrefectWarning"}))
    assert issubclass(QueueMessageFailed, RuntimeError)
    failed = pickle.loads(pickle.dumps(SandboxJobFailed("sandbox job failed [timeout]", {"kind": "timeout"})))
    assert isinstance(failed, PandaStackPrefectError) and failed.summary == {"kind": "timeout"}
