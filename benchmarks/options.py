"""The benchmarks' command lines."""

from __future__ import annotations

import argparse


def int_options(**defaults: int) -> argparse.Namespace:
    """This benchmark's command line: one integer option per default (``cold_n`` is ``--cold-n``)."""
    parser = argparse.ArgumentParser()
    for name, default in defaults.items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=default)
    return parser.parse_args()
