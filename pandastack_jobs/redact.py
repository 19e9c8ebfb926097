"""Secret redaction for every text that leaves the core.

The API key must never reach a log, an XCom, an artifact or an exception
message. The core redacts the client's key automatically; adapters add their
own secrets (connection passwords, block secrets).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

MASK = "***"
# A PandaStack token: ``pds_`` + 32 hex characters. Redacted even when the
# caller did not tell us about it (a job printing someone else's key).
TOKEN_PATTERN = re.compile(r"pds_[0-9a-fA-F]{32}")
# Shorter strings are too likely to be ordinary words.
MIN_SECRET_LENGTH = 6


class Redactor:
    """Replaces known secrets and anything shaped like a PandaStack token with ``***``."""

    def __init__(self, secrets: Iterable[str | None] = ()) -> None:
        self._secrets: tuple[str, ...] = ()
        self.add(*secrets)

    def add(self, *secrets: str | None) -> None:
        """Register more secrets (None and short strings are ignored)."""
        merged = set(self._secrets)
        merged.update(s for s in secrets if s and len(s) >= MIN_SECRET_LENGTH)
        # Longest first, so a secret that contains another is masked whole.
        self._secrets = tuple(sorted(merged, key=len, reverse=True))

    def __call__(self, text: str) -> str:
        """Return ``text`` with every secret masked."""
        for secret in self._secrets:
            if secret in text:
                text = text.replace(secret, MASK)
        return TOKEN_PATTERN.sub(MASK, text)


def redact(text: str, secrets: Iterable[str | None] = ()) -> str:
    """One-shot form of :class:`Redactor`."""
    return Redactor(secrets)(text)
