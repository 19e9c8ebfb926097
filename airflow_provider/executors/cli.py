"""The executor's ``airflow`` CLI commands (the provider info's ``cli`` entry): none yet.

Declaring the entry tells Airflow not to import every configured executor just to ask.
"""

from __future__ import annotations

from typing import Any


def get_cli_commands() -> list[Any]:
    """No extra commands: sandboxes are listed and deleted with the PandaStack API."""
    return []
