"""pandastack_local: a local PandaStack-compatible server with real Linux isolation.

``LocalServer`` runs it as a subprocess for tests and the demo; ``pandastack-local
serve`` runs it from the command line. See docs/local-server.md.
"""

from __future__ import annotations

__version__ = "0.1.0"

from pandastack_local.harness import LocalServer

__all__ = ["LocalServer", "__version__"]
