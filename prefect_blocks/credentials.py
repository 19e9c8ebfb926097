"""Where PandaStack is and how to reach it: the credentials block.

The block only holds connection settings; the SDK client comes from
:class:`pandastack_jobs.ConnectionConfig`, the same place every adapter gets
it, so capacity refusals are recorded for redelivery delays.
"""

from __future__ import annotations

import os
from typing import Optional

import pandastack
from prefect.blocks.abstract import CredentialsBlock
from pydantic import Field, SecretStr

from pandastack_jobs import ConnectionConfig, Redactor
from pandastack_jobs.connection import DEFAULT_REQUEST_TIMEOUT

# The logo is docs/img/pandastack-logo.png in this repository (a 256 px square PNG).
LOGO_URL = (
    "https://raw.githubusercontent.com/pandastack-io/pandastack-workflows/main/docs/img/pandastack-logo.png"
)
DOCS_URL = "https://github.com/pandastack-io/pandastack-workflows/blob/main/docs/prefect.md"
# The saved block used when a task is given none and the SDK finds no key (env, config file), as
# prefect-aws falls back to its default chain: a block named "default", or the one this names.
DEFAULT_BLOCK_ENV = "PREFECT_INTEGRATIONS_PANDASTACK_CREDENTIALS_BLOCK"
DEFAULT_BLOCK_NAME = "default"


class PandaStackCredentials(CredentialsBlock):
    """Connection settings for a PandaStack server: API key, API URL and the create-retry budget.

    Left empty, the API key and URL fall back to the SDK's environment
    (``PANDASTACK_API_KEY``, ``PANDASTACK_API``) on the machine that runs the task.
    """

    _block_type_name = "PandaStack Credentials"
    _block_type_slug = "pandastack-credentials"
    _logo_url = LOGO_URL  # type: ignore[assignment]
    _documentation_url = DOCS_URL  # type: ignore[assignment]
    _description = "API key and URL of a PandaStack server, for running jobs in throwaway sandboxes."
    _code_example = """
    ```python
    from prefect_blocks import PandaStackCredentials

    pandastack_credentials_block = PandaStackCredentials.load("BLOCK_NAME")
    client = pandastack_credentials_block.get_client()
    ```
    """

    api_key: Optional[SecretStr] = Field(
        default=None,
        title="API key",
        description="PandaStack API token (pds_...); empty means the PANDASTACK_API_KEY variable.",
    )
    api_url: Optional[str] = Field(
        default=None,
        title="API URL",
        description="Base URL of the PandaStack API; empty means PANDASTACK_API or the hosted platform.",
        examples=["https://api.pandastack.ai", "http://127.0.0.1:8321"],
    )
    max_create_retry_seconds: Optional[float] = Field(
        default=None,
        ge=0,
        title="Create-retry budget (seconds)",
        description=(
            "How long the SDK keeps retrying a sandbox create refused for capacity before the job is "
            "redelivered; empty means the SDK default (60)."
        ),
    )
    request_timeout: float = Field(
        default=DEFAULT_REQUEST_TIMEOUT,
        gt=0,
        title="Request timeout (seconds)",
        description="Timeout of one HTTP request to the API (job execs wait longer, up to the job timeout).",
    )

    def connection_config(self) -> ConnectionConfig:
        """The engine-agnostic connection settings the core runs jobs with."""
        return ConnectionConfig(
            api_url=self.api_url or None,
            api_key=self.api_key.get_secret_value() if self.api_key else None,
            request_timeout=self.request_timeout,
            max_create_retry_seconds=self.max_create_retry_seconds,
        )

    def get_client(self) -> pandastack.Client:
        """A new PandaStack SDK client (one per job: clients are not shared across threads)."""
        return self.connection_config().client()

    def redactor(self) -> Redactor:
        """A redactor that masks this block's API key (and anything shaped like a token)."""
        return Redactor([self.api_key.get_secret_value() if self.api_key else None])


def default_block_name() -> str:
    return os.environ.get(DEFAULT_BLOCK_ENV, "").strip() or DEFAULT_BLOCK_NAME


def resolve_credentials(credentials: Optional[PandaStackCredentials] = None) -> PandaStackCredentials:
    """The credentials a job runs with: the given block when it (or the SDK: ``PANDASTACK_API_KEY``,
    ``~/.config/pandastack``) has a key, else the saved default block, else an error saying how.

    Raises ``pandastack.AuthError`` (dead-lettered: no retry finds a key) naming the three ways.
    """
    given = credentials if credentials is not None else PandaStackCredentials()
    if given.get_client().api_key:
        return given
    name = default_block_name()
    try:
        saved = PandaStackCredentials.load(name, _sync=True)  # type: ignore[call-arg]
    except (ValueError, LookupError):  # no such block (or no block type registered yet)
        saved = None
    if isinstance(saved, PandaStackCredentials) and saved.get_client().api_key:
        return saved
    raise pandastack.AuthError(
        'no PandaStack API key: pass credentials=PandaStackCredentials.load("NAME") (or a '
        "PandaStackSandbox block with credentials), save a block named "
        f"{name!r} (PandaStackCredentials(api_url=..., api_key=...).save({name!r}); "
        f"{DEFAULT_BLOCK_ENV} names another), or set PANDASTACK_API_KEY (and PANDASTACK_API)"
    )
