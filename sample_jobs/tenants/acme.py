"""Tenant acme: total and average order value."""

import json

rows = json.load(open("/work/input.json"))["rows"]
amounts = [r["amount"] for r in rows]
json.dump(
    {"tenant": "acme", "total": round(sum(amounts), 2), "avg": round(sum(amounts) / len(amounts), 2)},
    open("/work/result.json", "w"),
)
