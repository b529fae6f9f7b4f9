"""Line charts as standalone SVG text: what ``ipuserve bench --plot`` and the
benchmark scripts draw (latency against throughput, one point per load level).

SVG written by hand rather than matplotlib: the project's dependencies stay numpy,
pyzmq and click, and a chart a browser or a Markdown page shows needs no more than
axes, ticks, polylines and a legend.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from xml.sax.saxutils import escape

#: Line colours, in series order (colour-blind safe: Okabe-Ito).
COLOURS = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000")
_MARGIN = {"left": 72, "right": 24, "top": 40, "bottom": 56}


@dataclass(frozen=True, slots=True)
class Series:
    """One line: its points in data units, and optional text beside each point.
    Lines of one thing measured two ways (p50 and p99) share a ``colour``; without one
    each series takes the next of :data:`COLOURS`."""

    label: str
    points: Sequence[tuple[float, float]]
    point_labels: Sequence[str] = ()
    dashed: bool = False
    colour: str | None = None


@dataclass(frozen=True, slots=True)
class Axis:
    label: str
    log: bool = False


def line_chart(
    series: Sequence[Series],
    *,
    title: str,
    x: Axis,
    y: Axis,
    width: int = 720,
    height: int = 440,
) -> str:
    """The chart as an SVG document. Axes start at zero unless logarithmic; points a
    log axis cannot show (zero or negative) are left out, not clamped."""
    shown = [_visible(s, x.log, y.log) for s in series]
    xs = [px for s in shown for px, _ in s.points]
    ys = [py for s in shown for _, py in s.points]
    x_scale = _Scale(xs, x.log, _MARGIN["left"], width - _MARGIN["right"])
    y_scale = _Scale(ys, y.log, height - _MARGIN["bottom"], _MARGIN["top"])
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{width / 2:.1f}" y="22" text-anchor="middle" font-size="15">'
        f"{escape(title)}</text>",
        *_x_axis(x_scale, x.label, height),
        *_y_axis(y_scale, y.label, right=x_scale.end),
    ]
    for index, line in enumerate(shown):
        parts.extend(_line(line, _colour(line, index), x_scale, y_scale))
    parts.extend(_legend(shown))
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _visible(series: Series, log_x: bool, log_y: bool) -> Series:
    keep = [
        i for i, (px, py) in enumerate(series.points) if _shows(px, log_x) and _shows(py, log_y)
    ]
    labels = [series.point_labels[i] for i in keep] if series.point_labels else []
    points = [series.points[i] for i in keep]
    return Series(series.label, points, labels, series.dashed, series.colour)


def _colour(series: Series, index: int) -> str:
    return series.colour or COLOURS[index % len(COLOURS)]


def _shows(value: float, log: bool) -> bool:
    return math.isfinite(value) and (value > 0 or not log)


class _Scale:
    """Data to pixels along one axis, with round tick values."""

    def __init__(self, values: list[float], log: bool, start: float, end: float) -> None:
        self.log = log
        self.start, self.end = start, end
        if log:
            self.low = _round_125(min(values, default=1.0), down=True)
            self.high = _round_125(max(values, default=10.0), down=False)
            if self.high <= self.low:
                self.high = _round_125(self.low * 1.01, down=False)
        else:
            high = max(values, default=1.0)
            self.step = _nice_step(high / 5 if high > 0 else 1.0)
            self.low = 0.0
            self.high = self.step * max(1, math.ceil(high / self.step))

    def __call__(self, value: float) -> float:
        if self.log:
            span = math.log10(self.high) - math.log10(self.low)
            share = (math.log10(value) - math.log10(self.low)) / span
        else:
            share = (value - self.low) / (self.high - self.low)
        return self.start + share * (self.end - self.start)

    def ticks(self) -> list[float]:
        if self.log:
            first, last = math.floor(math.log10(self.low)), math.ceil(math.log10(self.high))
            candidates = [m * 10.0**k for k in range(first, last + 1) for m in (1, 2, 5)]
            return [t for t in candidates if self.low * 0.999 <= t <= self.high * 1.001]
        count = round((self.high - self.low) / self.step)
        return [self.low + i * self.step for i in range(count + 1)]


def _round_125(value: float, down: bool) -> float:
    """The nearest 1, 2 or 5 times a power of ten below (or above) ``value``."""
    power = 10.0 ** math.floor(math.log10(value))
    steps = [m * power for m in (1.0, 2.0, 5.0, 10.0)]
    if down:
        return max(step for step in steps if step <= value * 1.000001)
    return min(step for step in steps if step >= value * 0.999999)


def _nice_step(rough: float) -> float:
    """The smallest 1, 2 or 5 times a power of ten at least ``rough``."""
    power = 10.0 ** math.floor(math.log10(rough))
    return next(m * power for m in (1.0, 2.0, 5.0, 10.0) if m * power >= rough)


def _number(value: float) -> str:
    if value >= 1000 and value % 100 == 0:
        return f"{value / 1000:g}k"
    return f"{value:g}"


def _x_axis(scale: _Scale, label: str, height: int) -> list[str]:
    base = height - _MARGIN["bottom"]
    out = [
        f'<line x1="{scale.start:.1f}" y1="{base}" x2="{scale.end:.1f}" y2="{base}" '
        'stroke="black"/>'
    ]
    for tick in scale.ticks():
        at = scale(tick)
        out.append(
            f'<line x1="{at:.1f}" y1="{_MARGIN["top"]}" x2="{at:.1f}" y2="{base}" '
            'stroke="#e0e0e0"/>'
        )
        out.append(
            f'<text x="{at:.1f}" y="{base + 16}" text-anchor="middle">{_number(tick)}</text>'
        )
    middle = (scale.start + scale.end) / 2
    out.append(
        f'<text x="{middle:.1f}" y="{height - 14}" text-anchor="middle">{escape(label)}</text>'
    )
    return out


def _y_axis(scale: _Scale, label: str, right: float) -> list[str]:
    left = _MARGIN["left"]
    out = [
        f'<line x1="{left}" y1="{scale.start:.1f}" x2="{left}" y2="{scale.end:.1f}" '
        'stroke="black"/>'
    ]
    for tick in scale.ticks():
        at = scale(tick)
        out.append(
            f'<line x1="{left}" y1="{at:.1f}" x2="{right:.1f}" y2="{at:.1f}" stroke="#e0e0e0"/>'
        )
        out.append(
            f'<text x="{left - 6}" y="{at + 4:.1f}" text-anchor="end">{_number(tick)}</text>'
        )
    middle = (scale.start + scale.end) / 2
    out.append(
        f'<text x="16" y="{middle:.1f}" text-anchor="middle" '
        f'transform="rotate(-90 16 {middle:.1f})">{escape(label)}</text>'
    )
    return out


def _line(series: Series, colour: str, x: _Scale, y: _Scale) -> list[str]:
    if not series.points:
        return []
    coords = [(x(px), y(py)) for px, py in series.points]
    dash = ' stroke-dasharray="6 4"' if series.dashed else ""
    path = " ".join(f"{cx:.1f},{cy:.1f}" for cx, cy in coords)
    out = [
        f'<g class="series" data-label="{escape(series.label, {chr(34): "&quot;"})}">',
        f'<polyline fill="none" stroke="{colour}" stroke-width="2"{dash} points="{path}"/>',
    ]
    for (cx, cy), text in zip(coords, series.point_labels or [""] * len(coords), strict=True):
        out.append(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="3" fill="{colour}"/>')
        if text:
            out.append(
                f'<text x="{cx + 5:.1f}" y="{cy - 6:.1f}" font-size="10" fill="{colour}">'
                f"{escape(text)}</text>"
            )
    out.append("</g>")
    return out


def _legend(series: Sequence[Series]) -> list[str]:
    out = []
    left = _MARGIN["left"] + 16  # top left: where latency/throughput curves rarely go
    for index, line in enumerate(series):
        colour = _colour(line, index)
        top = _MARGIN["top"] + 8 + index * 18
        dash = ' stroke-dasharray="6 4"' if line.dashed else ""
        out.append(
            f'<line x1="{left}" y1="{top}" x2="{left + 24}" y2="{top}" stroke="{colour}" '
            f'stroke-width="2"{dash}/>'
        )
        out.append(f'<text x="{left + 30}" y="{top + 4}">{escape(line.label)}</text>')
    return out
