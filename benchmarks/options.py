"""The benchmarks' command lines."""

from __future__ import annotations

import argparse
from pathlib import Path


def int_options(*, out: bool = False, **defaults: int) -> argparse.Namespace:
    """This benchmark's command line: one integer option per default (``cold_n`` is ``--cold-n``);
    ``out`` adds a required ``--out PATH`` (a benchmark of the other venv writes its JSON there for
    ``benchmarks.run``)."""
    parser = argparse.ArgumentParser()
    for name, default in defaults.items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=default)
    if out:
        parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args()
