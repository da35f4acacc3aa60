"""A small line chart as inline SVG (no script, no external file): one polyline and one circle per point for
each series, the axes labelled with their ranges."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

from agl.ui.html import esc, number

WIDTH, HEIGHT, PAD_LEFT, PAD = 640, 220, 48, 22


@dataclass
class Series:
    label: str
    points: List[Tuple[float, float]]
    color: str
    dashed: bool = False


def svg_chart(title: str, series: Sequence[Series], x_label: str) -> str:
    """The chart of ``series`` (points as (x, y)); the y range holds every point and 0..1 (rates, rewards)."""
    xs = [x for s in series for x, _ in s.points]
    ys = [y for s in series for _, y in s.points] + [0.0, 1.0]
    if not xs:
        return f'<p class="note">{esc(title)}: no finished rollouts yet.</p>'
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    x1 = x1 if x1 > x0 else x0 + 1
    y1 = y1 if y1 > y0 else y0 + 1

    def at(x: float, y: float) -> Tuple[float, float]:
        px = PAD_LEFT + (x - x0) / (x1 - x0) * (WIDTH - PAD_LEFT - PAD)
        py = HEIGHT - PAD - (y - y0) / (y1 - y0) * (HEIGHT - 2 * PAD)
        return round(px, 1), round(py, 1)

    parts = [
        f'<svg class="chart" role="img" aria-label="{esc(title)}" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" xmlns="http://www.w3.org/2000/svg"><title>{esc(title)}</title>',
        _axes(x0, x1, y0, y1, x_label),
    ]
    for s in series:
        coords = [at(x, y) for x, y in s.points]
        dash = ' stroke-dasharray="5 4"' if s.dashed else ""
        if len(coords) > 1:
            line = " ".join(f"{px},{py}" for px, py in coords)
            parts.append(f'<polyline fill="none" stroke="{s.color}" stroke-width="2"{dash} points="{line}"/>')
        for (px, py), (x, y) in zip(coords, s.points):
            tip = f"{s.label}: {number(y)} at {x_label} {number(x)}"
            parts.append(
                f'<circle class="point" data-series="{esc(s.label)}" cx="{px}" cy="{py}" r="3.5" fill="{s.color}">'
                f"<title>{esc(tip)}</title></circle>"
            )
    parts.append("</svg>")
    legend = "".join(f'<span style="color:{s.color}">&#9679; {esc(s.label)}</span>' for s in series)
    return f'<figure><figcaption>{esc(title)}</figcaption>{"".join(parts)}<div class="legend">{legend}</div></figure>'


def _axes(x0: float, x1: float, y0: float, y1: float, x_label: str) -> str:
    """The frame, and the ends of both ranges as labels."""
    left, bottom = PAD_LEFT, HEIGHT - PAD
    return (
        f'<line x1="{left}" y1="{PAD}" x2="{left}" y2="{bottom}" stroke="#999"/>'
        f'<line x1="{left}" y1="{bottom}" x2="{WIDTH - PAD}" y2="{bottom}" stroke="#999"/>'
        f'<text x="{left - 6}" y="{bottom}" text-anchor="end">{esc(number(y0))}</text>'
        f'<text x="{left - 6}" y="{PAD + 4}" text-anchor="end">{esc(number(y1))}</text>'
        f'<text x="{left}" y="{HEIGHT - 6}">{esc(number(x0))}</text>'
        f'<text x="{WIDTH - PAD}" y="{HEIGHT - 6}" text-anchor="end">{esc(number(x1))}</text>'
        f'<text x="{(left + WIDTH - PAD) / 2}" y="{HEIGHT - 6}" text-anchor="middle">{esc(x_label)}</text>'
    )
