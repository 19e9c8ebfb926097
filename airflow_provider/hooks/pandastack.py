"""The ``pandastack`` connection type: where the PandaStack API is and the key to use it.

Connection fields:

- **Host** (``API URL``): the API base URL, e.g. ``https://api.pandastack.ai`` or
  ``http://127.0.0.1:8080``. A bare host name gets ``https://`` (or the ``scheme``
  extra) and the port, when one is set. Empty: the SDK's ``PANDASTACK_API``.
- **Password** (``API key``): the ``pds_...`` token. Empty: the SDK's
  ``PANDASTACK_API_KEY`` / ``~/.config/pandastack``.
- **Extra**: ``max_create_retry_seconds`` (the SDK's capacity-retry budget for
  creates, default 60), ``request_timeout`` (seconds, default 30), ``scheme``.

The key is registered with Airflow's secrets masker as soon as it is read and
with the core's :class:`~pandastack_jobs.Redactor`, so it never reaches a task
log, a rendered template or an XCom.
"""

from __future__ import annotations

import math
from functools import cached_property
from typing import TYPE_CHECKING, Any

import pandastack
from airflow.sdk import BaseHook

from pandastack_jobs import ConnectionConfig, Redactor

from ..compat import AirflowNotFoundException
from ..exceptions import PandaStackAirflowError

if TYPE_CHECKING:
    from airflow.sdk import Connection


class PandaStackConnectionError(PandaStackAirflowError, ValueError):
    """The ``pandastack`` connection is misconfigured. The message names the field and the fix."""


def _number(extra: dict[str, Any], name: str, conn_id: str, minimum: float) -> float | None:
    value = extra.get(name)
    if value is None or value == "":
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number) or number < minimum:
        raise PandaStackConnectionError(
            f"connection {conn_id!r}: extra {name}={value!r} is not a number >= {minimum:g}; "
            f'fix the Extra JSON, e.g. {{"{name}": 60}}'
        )
    return number


def config_from_connection(conn: Connection | None) -> ConnectionConfig:
    """The core's :class:`ConnectionConfig` for an Airflow connection (None: the SDK's environment)."""
    if conn is None:
        return ConnectionConfig()
    extra = conn.extra_dejson or {}
    conn_id = conn.conn_id or "?"
    api_url: str | None = None
    host = (conn.host or "").strip()
    if host:
        if "://" in host:
            api_url = host.rstrip("/")
        else:
            scheme = str(extra.get("scheme") or "https")
            api_url = f"{scheme}://{host}" + (f":{conn.port}" if conn.port else "")
    timeout = _number(extra, "request_timeout", conn_id, 1)
    budget = _number(extra, "max_create_retry_seconds", conn_id, 0)
    kwargs: dict[str, Any] = {"api_url": api_url, "api_key": conn.password or None}
    if timeout is not None:
        kwargs["request_timeout"] = timeout
    if budget is not None:
        kwargs["max_create_retry_seconds"] = budget
    return ConnectionConfig(**kwargs)


def mask_key(key: str | None) -> None:
    """Tell Airflow's secrets masker about the key (task log, rendered fields, XCom display)."""
    if not key:
        return
    try:
        from airflow.sdk.log import mask_secret

        mask_secret(key)
    except Exception:  # noqa: BLE001 - masking must never break a task; the Redactor still applies
        return


class PandaStackHook(BaseHook):
    """Builds PandaStack SDK clients from an Airflow connection of type ``pandastack``.

    :param pandastack_conn_id: the connection id. A missing ``pandastack_default``
        falls back to the SDK's environment (``PANDASTACK_API``,
        ``PANDASTACK_API_KEY``); any other missing id is an error.
    """

    conn_name_attr = "pandastack_conn_id"
    default_conn_name = "pandastack_default"
    conn_type = "pandastack"
    hook_name = "PandaStack"

    def __init__(self, pandastack_conn_id: str = default_conn_name, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pandastack_conn_id = pandastack_conn_id

    @cached_property
    def connection(self) -> Connection | None:
        try:
            return self.get_connection(self.pandastack_conn_id)
        except AirflowNotFoundException as exc:
            self._missing_connection(exc)
            return None

    def _missing_connection(self, exc: AirflowNotFoundException) -> None:
        """Only a missing ``pandastack_default`` falls back to the SDK's environment."""
        if self.pandastack_conn_id != self.default_conn_name:
            raise exc
        self.log.info(
            "Connection %r not found; using the SDK's environment (PANDASTACK_API, PANDASTACK_API_KEY)",
            self.pandastack_conn_id,
        )

    @cached_property
    def config(self) -> ConnectionConfig:
        config = config_from_connection(self.connection)
        mask_key(config.api_key)
        return config

    @cached_property
    def redactor(self) -> Redactor:
        """Masks this connection's key (and any ``pds_`` token) in texts the provider emits."""
        return Redactor([self.config.api_key])

    def get_conn(self) -> pandastack.Client:
        """A new SDK client for this connection (cheap; one per job keeps threads apart)."""
        client = self.config.client()
        mask_key(client.api_key)
        self.redactor.add(client.api_key)
        return client

    async def aget_conn(self) -> pandastack.Client:
        """:meth:`get_conn` for async code (the triggerer): the connection is read without blocking
        the event loop; the key is masked and redacted the same way."""
        if "connection" not in self.__dict__:
            conn: Connection | None = None
            try:
                conn = await self.aget_connection(self.pandastack_conn_id)
            except AirflowNotFoundException as exc:
                self._missing_connection(exc)
            self.__dict__["connection"] = conn
        return self.get_conn()

    def test_connection(self) -> tuple[bool, str]:
        """List sandboxes with the key: proves the URL is reachable and the key is accepted."""
        try:
            client = self.get_conn()
            count = len(client.sandboxes.list())
        except Exception as exc:  # noqa: BLE001 - reported to the connection form, never raised
            return False, self.redactor(f"{type(exc).__name__}: {exc}")
        return True, f"Connected to {client.api_url}: the key is accepted ({count} sandbox(es) visible)"
