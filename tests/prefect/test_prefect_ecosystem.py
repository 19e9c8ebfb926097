"""The checks Prefect's own tooling makes on a collection, run on this one.

Against the session's temporary Prefect server: ``prefect block register -m
prefect_blocks`` registers both blocks (their types are deleted first, so only
the CLI can have registered them), a saved credentials block shows its key as
``********`` through the REST API, the block schemas are valid JSON Schema that
real block documents validate against, and the package's version is the
distribution's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from importlib.metadata import version
from typing import Any

import jsonschema
import pytest
from prefect.client.orchestration import get_client
from prefect.exceptions import ObjectNotFound
from prefect.settings import PREFECT_API_URL

import prefect_blocks
from prefect_blocks import PandaStackCredentials, PandaStackSandbox

BLOCKS = {"pandastack-credentials": PandaStackCredentials, "pandastack-sandbox": PandaStackSandbox}
FAKE_KEY = "pds_" + "5eC7e7" * 6


def api_get(path: str) -> Any:
    with urllib.request.urlopen(f"{PREFECT_API_URL.value()}{path}", timeout=30) as resp:
        return json.loads(resp.read())


def test_block_register_cli_registers_both_blocks() -> None:
    with get_client(sync_client=True) as client:
        for slug in BLOCKS:
            try:
                client.delete_block_type(client.read_block_type_by_slug(slug).id)
            except ObjectNotFound:
                pass
            with pytest.raises(ObjectNotFound):
                client.read_block_type_by_slug(slug)

    proc = subprocess.run(
        [sys.executable, "-m", "prefect", "block", "register", "-m", "prefect_blocks"],
        env={**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Successfully registered 2 blocks" in " ".join(proc.stdout.split()), proc.stdout

    with get_client(sync_client=True) as client:
        for slug, block in BLOCKS.items():
            block_type = client.read_block_type_by_slug(slug)
            assert block_type.name == block.get_block_type_name()
            assert block_type.logo_url and block_type.documentation_url and block_type.code_example
            schema = client.read_block_schema_by_checksum(block._calculate_schema_checksum())
            assert schema.block_type_id == block_type.id
            assert set(block.get_block_capabilities()) <= set(schema.capabilities)


def test_saved_credentials_show_the_key_as_stars_through_the_api() -> None:
    PandaStackCredentials(api_url="http://127.0.0.1:9", api_key=FAKE_KEY).save("eco-creds", overwrite=True)
    PandaStackSandbox(credentials=PandaStackCredentials.load("eco-creds")).save("eco-box", overwrite=True)

    for slug, name in (("pandastack-credentials", "eco-creds"), ("pandastack-sandbox", "eco-box")):
        raw = json.dumps(api_get(f"/block_types/slug/{slug}/block_documents/name/{name}"))
        assert FAKE_KEY not in raw
        assert '"api_key": "********"' in raw, raw
    with get_client(sync_client=True) as client:
        doc = client.read_block_document_by_name("eco-creds", "pandastack-credentials", include_secrets=False)
        assert doc.data["api_key"] == "********"
    assert PandaStackCredentials.load("eco-creds").api_key.get_secret_value() == FAKE_KEY


@pytest.mark.parametrize("slug", sorted(BLOCKS))
def test_block_schemas_are_valid_json_schema_that_documents_satisfy(slug: str) -> None:
    block = BLOCKS[slug]
    fields = block._to_block_schema().fields
    validator = jsonschema.validators.validator_for(fields)
    validator.check_schema(fields)
    assert fields["block_type_slug"] == slug and fields["secret_fields"] == (
        ["api_key"] if block is PandaStackCredentials else ["credentials.api_key"]
    )
    example = (
        PandaStackCredentials(api_url="http://127.0.0.1:9", api_key=FAKE_KEY)
        if block is PandaStackCredentials
        else PandaStackSandbox(timeout=20, collect=["report.md"], permanent_exit_codes=[3])
    )
    data = example.model_dump(mode="json", context={"include_secrets": True})
    validator(fields).validate(data)
    bad = {**data, "timeout" if block is PandaStackSandbox else "request_timeout": "soon"}
    with pytest.raises(jsonschema.ValidationError):
        validator(fields).validate(bad)


def test_version_exists_and_is_the_distributions() -> None:
    assert prefect_blocks.__version__ == version("pandastack-workflows")
    assert prefect_blocks.__version__ not in ("", "0.0.0")
