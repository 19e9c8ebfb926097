"""The fallback copy of ``common.sandbox``'s driver contract (see :mod:`.contract`); its exceptions
are copied in :mod:`._contract_errors_local`, below the models the driver's signatures name.

Same names and signatures as the provider's ``driver.py``, so a driver subclassing this one also
subclasses the provider's once it is installed. Import these through :mod:`.contract`, never from here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from .models import (
        RecoveredSandbox,
        SandboxHandle,
        SandboxLaunchRequest,
        SandboxOutput,
        SandboxResult,
    )


class SandboxDriver(ABC):
    """Translate the executor's lifecycle operations to one sandbox service.

    ``request_id`` is the deterministic correlation key. ``terminate`` and ``fence``
    are idempotent and return only once nothing of the handle / request still runs.
    """

    driver_id: ClassVar[str]

    @abstractmethod
    async def health_check(self) -> None:
        """Check the credentials and that the control plane answers."""

    @abstractmethod
    async def launch(self, request: SandboxLaunchRequest) -> SandboxHandle:
        """Create a fresh sandbox and start the request's argv in it."""

    @abstractmethod
    def validate_handle(self, handle: SandboxHandle, *, request_id: str) -> None:
        """Raise :class:`SandboxInvalidHandleError` when ``handle`` is not usable."""

    @abstractmethod
    async def get_status(self, handle: SandboxHandle) -> SandboxResult:
        """One observation of the launched workload."""

    @abstractmethod
    async def terminate(self, handle: SandboxHandle) -> None:
        """Stop and delete the sandbox of ``handle`` (idempotent)."""

    @abstractmethod
    async def fence(self, request_id: str) -> None:
        """Delete every sandbox correlated with ``request_id`` (idempotent)."""

    async def recover(self, request_id: str) -> RecoveredSandbox | None:
        """Rebuild a handle after a crash before it was persisted; the safe default fences."""
        await self.fence(request_id)
        return None

    async def get_output(self, handle: SandboxHandle) -> SandboxOutput | None:
        """The end of the workload's output, for diagnostics; None when not available."""
        return None

    @abstractmethod
    async def close(self) -> None:
        """Release clients."""


SandboxDriverFactory = Callable[[], SandboxDriver]
