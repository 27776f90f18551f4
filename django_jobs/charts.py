"""Inline SVG charts for the admin dashboard, rendered on the server (no JavaScript).

Two shapes: stacked columns over time (:func:`column_chart`) and stacked horizontal bars, one
per category (:func:`bar_chart`). Each has a legend, labelled axes with tick values, and a
``<title>`` per column or bar holding its values. Every text is escaped: queue names are user
data. Text and grid lines take ``currentColor``, so they follow the admin's light or dark theme.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from django.utils.html import format_html
from django.utils.safestring import SafeString, mark_safe

WIDTH = 860  # pixels: fits the admin's content column at 1280 px, beside the navigation sidebar
LEGEND_HEIGHT = 28
TICKS = 4
# The widest category label of a bar chart, in characters (its full text is in the bar's title).
LABEL_CHARS = 28
CHAR_WIDTH = 6.5  # of the 11 px labels, an average, to size the label column
ROW_HEIGHT = 22


@dataclass(frozen=True)
class Series:
    """One stacked part of every column or bar: its name (legend, titles), colour and values."""

    name: str
    colour: str
    values: Sequence[int]


def nice_ticks(peak: int, count: int = TICKS) -> list[int]:
    """Tick values from 0, a round step apart (1, 2 or 5 × 10ⁿ), the last one at least ``peak``."""
    raw = max(peak, 1) / count
    magnitude = 10 ** math.floor(math.log10(raw)) if raw >= 1 else 1
    step = next(factor * magnitude for factor in (1, 2, 5, 10) if factor * magnitude >= raw)
    return list(range(0, step * math.ceil(max(peak, 1) / step) + 1, step))


def column_chart(
    labels: Sequence[str],
    captions: Sequence[str],
    series: Sequence[Series],
    *,
    title: str,
    x_label: str,
    y_label: str,
    chart_id: str,
) -> SafeString:
    """Stacked columns, one per label (tick text under it; its caption starts its title), the
    values on a y axis with ticks, and the highest column's total written above it."""
    height, left, right, top, bottom = 260, 56, 12, LEGEND_HEIGHT + 16, 44
    totals = _totals(series, len(labels))
    ticks = nice_ticks(max(totals, default=0))
    plot_h = height - top - bottom
    scale = plot_h / ticks[-1]
    pitch = (WIDTH - left - right) / max(len(labels), 1)
    base = height - bottom
    parts = [_legend(series)]
    for tick in ticks:
        y = base - tick * scale
        parts.append(_grid(left, WIDTH - right, y))
        parts.append(format_html('<text x="{}" y="{}" text-anchor="end">{}</text>', left - 6, _n(y + 4), tick))
    parts.append(
        format_html(
            '<text x="14" y="{}" text-anchor="middle" transform="rotate(-90 14 {})">{}</text>',
            _n(top + plot_h / 2),
            _n(top + plot_h / 2),
            y_label,
        )
    )
    parts.append(format_html('<text x="{}" y="{}" text-anchor="middle">{}</text>', _n(WIDTH / 2), height - 4, x_label))
    for i, (label, caption) in enumerate(zip(labels, captions, strict=True)):
        x = left + i * pitch
        segments = _stack(series, i, base, scale, vertical=True, offset=x + 1, thickness=pitch - 2)
        parts.append(format_html("<g><title>{}</title>{}</g>", _caption(caption, series, i), segments))
        parts.append(
            format_html('<text x="{}" y="{}" text-anchor="middle">{}</text>', _n(x + pitch / 2), base + 14, label)
        )
    if totals and max(totals) > 0:
        peak = totals.index(max(totals))
        parts.append(
            format_html(
                '<text x="{}" y="{}" text-anchor="middle" font-weight="bold">{}</text>',
                _n(left + (peak + 0.5) * pitch),
                _n(base - totals[peak] * scale - 4),
                totals[peak],
            )
        )
    return _svg(chart_id, title, height, parts)


def bar_chart(
    labels: Sequence[str], series: Sequence[Series], *, title: str, x_label: str, chart_id: str
) -> SafeString:
    """Stacked horizontal bars, one per label (written left of it, cut to ``LABEL_CHARS``), the
    values on an x axis with ticks, and each bar's total written after it."""
    shown = [label if len(label) <= LABEL_CHARS else label[: LABEL_CHARS - 1] + "…" for label in labels]
    left = 8 + CHAR_WIDTH * max((len(label) for label in shown), default=0)
    right, top = 40, LEGEND_HEIGHT + 4
    height = top + ROW_HEIGHT * len(labels) + 40
    totals = _totals(series, len(labels))
    ticks = nice_ticks(max(totals, default=0))
    scale = (WIDTH - left - right) / ticks[-1]
    base = top + ROW_HEIGHT * len(labels)
    parts = [_legend(series)]
    for tick in ticks:
        x = left + tick * scale
        parts.append(format_html('<line x1="{}" y1="{}" x2="{}" y2="{}" {}/>', _n(x), top, _n(x), base, _GRID))
        parts.append(format_html('<text x="{}" y="{}" text-anchor="middle">{}</text>', _n(x), base + 14, tick))
    parts.append(
        format_html('<text x="{}" y="{}" text-anchor="middle">{}</text>', _n((left + WIDTH) / 2), height - 4, x_label)
    )
    for i, (label, short) in enumerate(zip(labels, shown, strict=True)):
        y = top + i * ROW_HEIGHT
        segments = _stack(series, i, left, scale, vertical=False, offset=y + 3, thickness=ROW_HEIGHT - 6)
        parts.append(format_html("<g><title>{}</title>{}</g>", _caption(label, series, i), segments))
        middle = _n(y + ROW_HEIGHT / 2 + 4)
        parts.append(format_html('<text x="{}" y="{}" text-anchor="end">{}</text>', _n(left - 6), middle, short))
        end = _n(left + totals[i] * scale + 4)
        parts.append(format_html('<text x="{}" y="{}">{}</text>', end, middle, totals[i]))
    return _svg(chart_id, title, height, parts)


_GRID = mark_safe('stroke="currentColor" stroke-opacity="0.2"')


def _svg(chart_id: str, title: str, height: int, parts: list[SafeString]) -> SafeString:
    return format_html(
        '<svg xmlns="http://www.w3.org/2000/svg" class="jobs-chart" id="{}" viewBox="0 0 {} {}" width="{}" '
        'height="{}" role="img" aria-labelledby="{}-title" font-size="11" fill="currentColor">'
        '<title id="{}-title">{}</title>{}</svg>',
        chart_id,
        WIDTH,
        height,
        WIDTH,
        height,
        chart_id,
        chart_id,
        title,
        _join(parts),
    )


def _legend(series: Sequence[Series]) -> SafeString:
    items = [
        format_html(
            '<rect x="{}" y="8" width="12" height="12" fill="{}"/><text x="{}" y="18">{}</text>',
            8 + 110 * i,
            entry.colour,
            26 + 110 * i,
            entry.name,
        )
        for i, entry in enumerate(series)
    ]
    return format_html('<g class="legend">{}</g>', _join(items))


def _grid(x1: float, x2: float, y: float) -> SafeString:
    return format_html('<line x1="{}" y1="{}" x2="{}" y2="{}" {}/>', _n(x1), _n(y), _n(x2), _n(y), _GRID)


def _stack(
    series: Sequence[Series], i: int, base: float, scale: float, *, vertical: bool, offset: float, thickness: float
) -> SafeString:
    """The ``i``-th column (upwards from ``base``) or bar (rightwards from it), one rect a series."""
    rects, start = [], base
    for entry in series:
        length = entry.values[i] * scale
        if length <= 0:
            continue
        if vertical:
            start -= length
            x, y, w, h = offset, start, thickness, length
        else:
            x, y, w, h = start, offset, length, thickness
            start += length
        rects.append(
            format_html(
                '<rect x="{}" y="{}" width="{}" height="{}" fill="{}"/>', _n(x), _n(y), _n(w), _n(h), entry.colour
            )
        )
    return _join(rects)


def _totals(series: Sequence[Series], count: int) -> list[int]:
    return [sum(entry.values[i] for entry in series) for i in range(count)]


def _caption(caption: str, series: Sequence[Series], i: int) -> str:
    return f"{caption}: " + ", ".join(f"{entry.values[i]} {entry.name}" for entry in series)


def _join(parts: Sequence[SafeString]) -> SafeString:
    return mark_safe("".join(parts))  # every part was built by format_html


def _n(value: float) -> str:
    """A coordinate, to a tenth of a pixel."""
    return f"{value:.1f}".removesuffix(".0")
