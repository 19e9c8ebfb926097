"""Render the daily orders report inside the sandbox (template code-interpreter: pandas + matplotlib).

In: /work/orders.csv and /work/input.json ({"date": ..., "embed_chart": false}).
Out: /work/chart.png (revenue by region), /work/report.md (links the chart, or embeds it as a
data URI when "embed_chart" is true, for viewers that only get the markdown), and the JSON
summary in /work/result.json.
"""

import base64
import json

import matplotlib.pyplot as plt  # headless: the template sets MPLBACKEND=Agg
import pandas as pd

params = json.load(open("/work/input.json"))
day = params["date"]
orders = pd.read_csv("/work/orders.csv")
by_region = (
    orders.groupby("region")["amount"]
    .agg(orders="count", revenue="sum", average="mean")
    .sort_values("revenue", ascending=False)
    .round(2)
)
total = round(float(orders["amount"].sum()), 2)

fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
bars = ax.bar(by_region.index, by_region["revenue"], color="#3b7dd8")
ax.bar_label(bars, labels=[f"{v:,.0f}" for v in by_region["revenue"]], padding=3)
ax.set_title(f"Revenue by region, {day} (total {total:,.2f})")
ax.set_xlabel("region")
ax.set_ylabel("revenue")
ax.margins(y=0.15)
ax.spines[["top", "right"]].set_visible(False)
fig.tight_layout()
fig.savefig("/work/chart.png")

if params.get("embed_chart"):
    with open("/work/chart.png", "rb") as fh:
        chart = "data:image/png;base64," + base64.b64encode(fh.read()).decode("ascii")
else:
    chart = "chart.png"
lines = [f"# Orders report for {day}", "", f"Total revenue: **{total:.2f}** over {len(orders)} orders", ""]
lines += [f"![Revenue by region]({chart})", ""]
lines += ["| region | orders | revenue | average order |", "|---|---:|---:|---:|"]
lines += [
    f"| {region} | {int(row.orders)} | {row.revenue:.2f} | {row.average:.2f} |"
    for region, row in by_region.iterrows()
]
with open("/work/report.md", "w") as fh:
    fh.write("\n".join(lines) + "\n")

regions = [
    {
        "region": region,
        "orders": int(row.orders),
        "revenue": float(row.revenue),
        "average": float(row.average),
    }
    for region, row in by_region.iterrows()
]
json.dump(
    {"date": day, "total_revenue": total, "orders": len(orders), "regions": regions},
    open("/work/result.json", "w"),
)
