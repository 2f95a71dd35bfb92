"""Fixed-width tables of the benchmarks' result rows."""

from __future__ import annotations


def print_table(columns: list[tuple[str, str, int]], rows: list[dict]) -> None:
    """A line of titles, then a line per row; each column is ``(key, title, width)``, right-aligned,
    and a row without the key shows ``-``."""
    print(" ".join(f"{title:>{width}}" for _, title, width in columns))
    for row in rows:
        print(" ".join(f"{row.get(key, '-')!s:>{width}}" for key, _, width in columns))
