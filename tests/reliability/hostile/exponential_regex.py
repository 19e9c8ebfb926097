"""Catastrophic backtracking: (a+)+$ against 64 a's and a b."""

import re

print("matching", flush=True)
re.match(r"(a+)+$", "a" * 64 + "b")
print("regex finished: no wall", flush=True)
