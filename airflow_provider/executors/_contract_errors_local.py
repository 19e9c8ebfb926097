"""The fallback copy of ``common.sandbox``'s exceptions (see :mod:`.contract_errors`).

Same names and tree as the provider's ``exceptions.py``. Import them through :mod:`.contract` (or
:mod:`.contract_errors` below the models), never from here.
"""

from __future__ import annotations


class SandboxError(Exception):
    """Base of the sandbox executor's contract errors."""


class SandboxConfigurationError(SandboxError, ValueError):
    """A sandbox option is invalid. The message names the option and the fix."""


class SandboxProtocolError(SandboxError):
    """A driver returned something the contract does not allow."""


class SandboxInvalidHandleError(SandboxProtocolError):
    """A persisted handle does not describe a sandbox of this request."""


class SandboxLaunchUnfencedError(SandboxError):
    """A launch failed and the driver could not prove that nothing of it still runs.

    The executor keeps the try until a fence of ``request_id`` holds, and only then fails it
    with ``launch_error``: Airflow must not start the next try beside a live sandbox.
    """

    def __init__(self, request_id: str, launch_error: BaseException, fence_error: BaseException) -> None:
        self.request_id = request_id
        self.launch_error = launch_error
        self.fence_error = fence_error
        super().__init__(
            f"sandbox launch for request {request_id} failed and could not be fenced: {fence_error}"
        )
