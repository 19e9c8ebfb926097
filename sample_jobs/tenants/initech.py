"""Tenant initech: orders bucketed by size, with a scratch file in /tmp (gone with the sandbox)."""

import json

rows = json.load(open("/work/input.json"))["rows"]
buckets = {"small": 0, "medium": 0, "large": 0}
for r in rows:
    buckets["small" if r["amount"] < 50 else "medium" if r["amount"] < 150 else "large"] += 1
open("/tmp/scratch.bin", "wb").write(b"\0" * 10_000_000)
json.dump({"tenant": "initech", "buckets": buckets}, open("/work/result.json", "w"))
