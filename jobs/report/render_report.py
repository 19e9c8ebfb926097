"""Render the daily orders report inside the sandbox: CSV in, markdown + JSON summary out."""

import csv
import json
from collections import defaultdict

params = json.load(open("/work/input.json"))
by_region = defaultdict(lambda: {"orders": 0, "revenue": 0.0})
with open("/work/orders.csv", newline="") as fh:
    for row in csv.DictReader(fh):
        region = by_region[row["region"]]
        region["orders"] += 1
        region["revenue"] += float(row["amount"])

rows = sorted(
    ({"region": k, "orders": v["orders"], "revenue": round(v["revenue"], 2)} for k, v in by_region.items()),
    key=lambda r: -r["revenue"],
)
total = round(sum(r["revenue"] for r in rows), 2)
lines = [f"# Orders report for {params['date']}", "", f"Total revenue: **{total:.2f}**", ""]
lines += ["| region | orders | revenue |", "|---|---:|---:|"]
lines += [f"| {r['region']} | {r['orders']} | {r['revenue']:.2f} |" for r in rows]
with open("/work/report.md", "w") as fh:
    fh.write("\n".join(lines) + "\n")
json.dump(
    {
        "date": params["date"],
        "total_revenue": total,
        "orders": sum(r["orders"] for r in rows),
        "regions": rows,
    },
    open("/work/result.json", "w"),
)
