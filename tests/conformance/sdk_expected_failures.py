"""What of the pandastack SDK's own material fails against pandastack-local, and why.

``test_sdk_sdist.py`` runs the pinned sdist's live end-to-end tests and its examples against a
fresh server. Each entry here is a strict expected failure: it must fail, and its failure must
contain the error text given, so CI notices when one starts passing (remove it from here) or
fails for another reason. Everything not listed must pass; nothing is skipped.
"""

from __future__ import annotations

from typing import NamedTuple

# The SDK version whose sdist is downloaded (the one the repo's extras install).
SDK_VERSION = "0.10.0"


class Expected(NamedTuple):
    reason: str
    error: str  # text the failure must contain


EXPECTED_FAILURES: dict[str, Expected] = {
    "examples/custom_template.py": Expected(
        "builds a template from a rootfs tarball (POST /v1/templates/build): pandastack-local takes "
        "its templates from --template-dir (a requirements file), it builds no images",
        "is not supported by pandastack-local",
    ),
    "examples/code_interpreter.py": Expected(
        "saves its chart to /home/panda/squares.png: PandaStack's code-interpreter template has no "
        "/home/panda either (its WORKDIR is /workspace, exec runs as root), so the example fails "
        "there the same way; the same code with the path moved to /tmp passes here",
        "No such file or directory",
    ),
    "examples/browser_scraping.py": Expected(
        "fetches https://example.com from the sandbox: a pandastack-local sandbox has no network "
        "unless the server allows it (--allow-egress HOST:PORT), and CI has no internet",
        "printed '', expected 'Example Domain'",
    ),
}
