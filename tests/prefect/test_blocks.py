"""The blocks: Prefect's standard block suite, registration, save/load, and the JobBlock contract."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from importlib.metadata import entry_points
from pathlib import Path

import pandastack
import pytest
from prefect.blocks.abstract import CredentialsBlock, JobBlock
from prefect.client.orchestration import get_client
from prefect.settings import PREFECT_API_URL
from prefect.testing.standard_test_suites import BlockStandardTestSuite

from prefect_blocks import PandaStackCredentials, PandaStackSandbox, SandboxJobFailed

BLOCKS = [PandaStackCredentials, PandaStackSandbox]


@pytest.mark.parametrize("block", BLOCKS)
class TestStandardBlockSuite(BlockStandardTestSuite):
    @pytest.fixture
    def block(self, block):  # type: ignore[override]
        return block

    def test_has_a_valid_image(self, block) -> None:  # type: ignore[override]
        """The suite's own checks, on the file the logo URL serves (this machine has no internet)."""
        from PIL import Image

        marker = "/pandastack-workflows/main/"
        assert marker in block._logo_url, block._logo_url
        path = Path(__file__).resolve().parents[2] / block._logo_url.split(marker, 1)[1]
        img = Image.open(path)
        assert img.format == "PNG"
        assert img.width == img.height, "Logo should be a square image"
        assert 1000 > img.width > 45


def test_blocks_are_the_right_kinds() -> None:
    assert issubclass(PandaStackCredentials, CredentialsBlock)
    assert issubclass(PandaStackSandbox, JobBlock)


def test_collection_entry_point_names_the_package() -> None:
    eps = {ep.name: ep.value for ep in entry_points(group="prefect.collections")}
    assert eps.get("pandastack_workflows") == "prefect_blocks"


def test_block_register_cli_registers_both_block_types() -> None:
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    proc = subprocess.run(
        [sys.executable, "-m", "prefect", "block", "register", "-m", "prefect_blocks"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with get_client(sync_client=True) as client:
        for slug in ("pandastack-credentials", "pandastack-sandbox"):
            block_type = client.read_block_type_by_slug(slug)
            assert block_type.documentation_url and block_type.code_example
            assert client.read_block_schemas  # schema registered alongside


def test_save_and_load_keeps_the_key_secret(local_server) -> None:
    creds = PandaStackCredentials(api_url=local_server.url, api_key=local_server.api_key)
    creds.save("test-creds", overwrite=True)
    sandbox = PandaStackSandbox(credentials=creds, timeout=20, permanent_exit_codes=[42], collect=["a.md"])
    sandbox.save("test-sandbox", overwrite=True)

    loaded = PandaStackSandbox.load("test-sandbox")
    assert loaded.credentials.api_key is not None
    assert loaded.credentials.api_key.get_secret_value() == local_server.api_key
    assert local_server.api_key not in repr(loaded) and local_server.api_key not in str(loaded.model_dump())
    assert loaded.permanent_exit_codes == [42] and loaded.timeout == 20
    assert loaded.credentials.get_client().sandboxes.list() == []


def test_trigger_wait_and_fetch_result(credentials) -> None:
    block = PandaStackSandbox(credentials=credentials, timeout=30, publish_artifacts=False)
    run = block.trigger(
        "python3 -c \"import json; d = json.load(open('/work/input.json')); "
        "json.dump({'double': d['x'] * 2}, open('/work/result.json', 'w'))\"",
        input={"x": 21},
    )
    run.wait_for_completion()
    assert run.done
    assert run.fetch_result() == {"double": 42}
    assert run.outcome is not None and run.outcome.ok

    failing = block.trigger("exit 5")
    failing.wait_for_completion()
    with pytest.raises(SandboxJobFailed) as info:
        failing.fetch_result()
    assert info.value.exit_code == 5 and info.value.redeliver


def test_leaving_the_block_deletes_running_sandboxes(credentials, ps_client) -> None:
    block = PandaStackSandbox(credentials=credentials, timeout=120, publish_artifacts=False)
    with pytest.raises(RuntimeError, match="flow code blew up"):
        with block:
            run = block.trigger("sleep 100")
            deadline = time.monotonic() + 30
            while run.sandbox_id is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert run.sandbox_id is not None
            assert [sb.id for sb in ps_client.sandboxes.list()] == [run.sandbox_id]
            raise RuntimeError("flow code blew up")
    with pytest.raises(pandastack.NotFoundError):
        ps_client.sandboxes.get(run.sandbox_id)
    run.wait_for_completion()
    with pytest.raises(SandboxJobFailed) as info:
        run.fetch_result()
    assert info.value.kind is not None and info.value.kind.value == "cancelled"
    assert info.value.dead_letter
