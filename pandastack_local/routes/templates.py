"""Templates: the rules for the ``template`` a create request names (routes that list and
get templates belong here too)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from ..manager import ApiError
from ..templates import TEMPLATE_NAME_RE

router = APIRouter(prefix="/v1")

DEFAULT_TEMPLATE = "code-interpreter"


def template_name(value: Any) -> str:
    """A well-formed template name, or 400 (an unknown one is the manager's 500, as on the wire)."""
    if not isinstance(value, str) or not TEMPLATE_NAME_RE.match(value):
        raise ApiError(400, "invalid template name (allowed: [A-Za-z0-9._-], at most 64 chars)")
    return value
