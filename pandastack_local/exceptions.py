"""The one base of the local server's exceptions.

Every exception class of ``pandastack_local`` derives from :class:`PandaStackLocalError` (and
keeps the builtin it always was), except the guest's (``guest/``: standard library only, it runs
inside the sandbox and imports nothing of the host's).
"""

from __future__ import annotations


class PandaStackLocalError(Exception):
    """Base of every exception the local server's host side defines."""
