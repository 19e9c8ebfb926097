"""The well-behaved neighbour: overlaps with a hostile job, prints a token-shaped string (which
the Redactor must mask), and returns what the host can check (tests/reliability/catalogue.py)."""

import json
import os
import time

with open(os.environ["JOB_INPUT"]) as f:
    rows = json.load(f)["rows"]
time.sleep(0.5)  # overlap with the hostile neighbour
print("sibling done; token", "pds_" + "feedfacecafebeef" * 2)
with open("/opt/app/hello.txt") as f:
    hello = f.read()
with open(os.environ["JOB_RESULT"], "w") as f:
    json.dump({"n": len(rows), "sum_sq": sum(r * r for r in rows), "hello": hello}, f)
