"""What each example job should end as. The demo exits non-zero on any surprise."""

from __future__ import annotations

from typing import Any, TypedDict


class Row(TypedDict, total=False):
    """One line of the demo's summary table (``result``: the job's JSON result, when read)."""

    engine: str
    job: str
    outcome: str  # "success" or "failed"
    reason: str
    seconds: float | None  # None: overlapping mapped tasks, timed on the flow's own row
    result: Any
    files: Any  # Airflow: the ``files`` XCom (collected file -> its stored path)


# Jobs that must fail (hostile on purpose), by the name that appears in ``Row["job"]``.
EXPECTED_FAILURES = {
    "pandastack_tenant_transforms.transform[evil_fork_bomb]",
    "pandastack_tenant_transforms.transform[evil_memory_hog]",
    "pandastack-tenant-transforms/evil_fork_bomb",
    "pandastack-tenant-transforms/evil_memory_hog",
}


def surprises(rows: list[Row]) -> list[str]:
    """Rows whose outcome is not the expected one, as readable lines."""
    out = []
    for row in rows:
        should_fail = row["job"] in EXPECTED_FAILURES
        if should_fail != (row["outcome"] != "success"):
            expected = "failure" if should_fail else "success"
            out.append(
                f"{row['engine']} {row['job']}: expected {expected}, got {row['outcome']} ({row['reason']})"
            )
    return out


def format_table(rows: list[Row]) -> str:
    """A plain-text table: engine, job, outcome, reason, seconds."""
    headers = ("engine", "job", "outcome", "reason", "seconds")
    cells = [
        (r["engine"], r["job"], r["outcome"], _clip(r["reason"], 70), _seconds(r.get("seconds")))
        for r in rows
    ]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    sep = "  ".join("-" * w for w in widths)
    body = ["  ".join(c.ljust(w) for c, w in zip(cell, widths, strict=True)) for cell in cells]
    return "\n".join([line, sep, *body])


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _clip(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


# The report's chart as render_report.py draws it (7 x 4 in at 110 dpi, blue bars on white).
CHART_SIZE = (770, 440)


def chart_problem(png: bytes) -> str | None:
    """Why ``png`` is not a readable chart (None when it is): a PNG of the expected size whose bars
    cover a plausible share of the image, so an empty or blank figure is caught."""
    import io

    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(png)).convert("RGB")
    except UnidentifiedImageError:
        return "not an image"
    if image.size != CHART_SIZE:
        return f"size {image.size}, expected {CHART_SIZE}"
    colours: list[tuple[int, tuple[int, int, int]]] = image.getcolors(maxcolors=1 << 20) or []  # type: ignore[assignment]
    bars = sum(n for n, (r, _g, b) in colours if b > 180 and r < 100)
    share = bars / (image.size[0] * image.size[1])
    if not 0.05 < share < 0.6:
        return f"bars cover {share:.0%} of the image: no chart drawn"
    return None
