"""Tenant globex: the largest orders."""

import json

rows = json.load(open("/work/input.json"))["rows"]
top = sorted(rows, key=lambda r: -r["amount"])[:3]
json.dump({"tenant": "globex", "top_ids": [r["id"] for r in top]}, open("/work/result.json", "w"))
