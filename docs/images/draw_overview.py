"""Draws docs/images/overview.svg, README.md's picture: each request's keys and values in one
contiguous virtual range, with 2 MB physical pages mapped into it as the request grows.

    python3 docs/images/draw_overview.py    # rewrites docs/images/overview.svg

Plain SVG written by hand, so that redrawing needs nothing but Python.
"""

import pathlib

WIDTH, HEIGHT = 760, 305
CELL, GAP = 44, 4           # one 2 MB page of virtual range, and the space between pages
LEFT = 150                  # where the virtual ranges start
REQUESTS = [                # (label, pages backed, tokens in the last backed page as a fraction)
    ("request 0", 4, 0.5),
    ("request 1", 2, 0.25),
    ("request 2", 6, 0.75),
]
PAGES_PER_SLOT = 12         # the slot's whole virtual range: max_context_len tokens
# Which physical page (index in the pool) backs each backed virtual page: pages come from
# anywhere in the pool, in any order.
BACKING = [[3, 9, 1, 14], [6, 0], [11, 4, 15, 2, 8, 12]]
POOL_PAGES = 17
COLORS = ["#4c78a8", "#f58518", "#54a24b"]


def rect(x, y, w, h, fill, stroke="#333", dash=False, opacity=1.0):
    dashes = ' stroke-dasharray="4 3"' if dash else ""
    return (f'<rect x="{x}" y="{y}" width="{w}" height="{h}" fill="{fill}" fill-opacity="{opacity}" '
            f'stroke="{stroke}"{dashes}/>')


def text(x, y, body, size=12, anchor="start", weight="normal", fill="#222"):
    return (f'<text x="{x}" y="{y}" font-family="Helvetica, Arial, sans-serif" font-size="{size}" '
            f'text-anchor="{anchor}" font-weight="{weight}" fill="{fill}">{body}</text>')


def draw() -> str:
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
             f'viewBox="0 0 {WIDTH} {HEIGHT}">', rect(0, 0, WIDTH, HEIGHT, "white", stroke="none")]
    parts.append(text(10, 22, "Virtual memory: reserved once (cuMemAddressReserve), one contiguous range per request",
                      13, weight="bold"))
    pool_y = 212
    lines = []  # drawn first, under the pages
    pool_cell = (WIDTH - LEFT - 10) / POOL_PAGES
    row_y = [40 + 52 * i for i in range(len(REQUESTS))]
    for row, ((label, backed, last), y, color) in enumerate(zip(REQUESTS, row_y, COLORS)):
        parts.append(text(LEFT - 10, y + 24, label, 12, anchor="end"))
        for page in range(PAGES_PER_SLOT):
            x = LEFT + page * (CELL + GAP)
            if page < backed:
                parts.append(rect(x, y, CELL, 34, color, opacity=0.25))
                filled = CELL * (last if page == backed - 1 else 1.0)
                parts.append(rect(x, y, filled, 34, color, stroke="none", opacity=0.85))
                target = BACKING[row][page]
                px = LEFT + target * pool_cell + pool_cell / 2
                lines.append(f'<line x1="{x + CELL / 2}" y1="{y + 34}" x2="{px}" y2="{pool_y}" '
                             f'stroke="{color}" stroke-width="1.2" stroke-opacity="0.8"/>')
            else:
                parts.append(rect(x, y, CELL, 34, "#f4f4f4", stroke="#999", dash=True))
    # The physical pool.
    parts.append(text(10, pool_y + 22, "2 MB physical", 12, weight="bold"))
    parts.append(text(10, pool_y + 38, "pages (cuMemCreate)", 12, weight="bold"))
    used = {page: COLORS[row] for row, pages in enumerate(BACKING) for page in pages}
    for page in range(POOL_PAGES):
        x = LEFT + page * pool_cell
        if page in used:
            parts.append(rect(x + 1, pool_y, pool_cell - 2, 34, used[page], opacity=0.85))
        else:
            parts.append(rect(x + 1, pool_y, pool_cell - 2, 34, "#ffffff", stroke="#999"))
    parts.append(text(LEFT, pool_y + 54, "free pages wait, zero-filled, for the next step(); "
                      "free_reqid() gives a request's pages back", 11, fill="#555"))
    legend_y = pool_y + 80
    parts.append(rect(10, legend_y - 11, 14, 12, COLORS[0], stroke="none", opacity=0.85))
    parts.append(text(30, legend_y, "tokens written", 11))
    parts.append(rect(130, legend_y - 11, 14, 12, COLORS[0], opacity=0.25))
    parts.append(text(150, legend_y, "backed by step(), not written yet", 11))
    parts.append(rect(360, legend_y - 11, 14, 12, "#f4f4f4", stroke="#999", dash=True))
    parts.append(text(380, legend_y, "reserved only, no memory (reads zeros with zero_page=True)", 11))
    parts[2:2] = lines
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    out = pathlib.Path(__file__).with_name("overview.svg")
    out.write_text(draw())
    print(f"wrote {out}")
