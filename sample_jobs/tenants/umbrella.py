"""Tenant umbrella: a running total, written as records."""

import json

rows = json.load(open("/work/input.json"))["rows"]
running, out = 0.0, []
for r in rows:
    running += r["amount"]
    out.append({"id": r["id"], "running_total": round(running, 2)})
json.dump(out, open("/work/result.json", "w"))
