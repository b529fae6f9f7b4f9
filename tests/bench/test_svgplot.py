"""The hand-written SVG charts: well-formed, every point where its data puts it."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from ipuserve.bench.svgplot import Axis, Series, line_chart

NS = {"svg": "http://www.w3.org/2000/svg"}


def parse(text: str) -> ET.Element:
    return ET.fromstring(text)


def polylines(root: ET.Element) -> list[list[tuple[float, float]]]:
    lines = root.findall(".//svg:g[@class='series']/svg:polyline", NS)
    return [
        [(float(x), float(y)) for x, y in (p.split(",") for p in line.attrib["points"].split())]
        for line in lines
    ]


def texts(root: ET.Element) -> list[str]:
    return [t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text")]


def test_each_series_is_a_polyline_whose_points_follow_the_data() -> None:
    fast = Series("fast", [(100, 1.0), (200, 2.0), (400, 3.0)], ["1", "2", "4"])
    slow = Series("slow", [(50, 4.0), (80, 8.0)], dashed=True)
    root = parse(line_chart([fast, slow], title="t", x=Axis("requests/s"), y=Axis("latency (us)")))
    first, second = polylines(root)
    assert len(first) == 3 and len(second) == 2
    xs = [x for x, _ in first]
    ys = [y for _, y in first]
    assert xs == sorted(xs)  # more throughput: further right
    assert ys == sorted(ys, reverse=True)  # more latency: higher up (smaller y)
    # linear axes are proportional from zero: 200 is twice as far from the origin as 100
    origin_x = float(root.find(".//svg:line", NS).attrib["x1"])  # type: ignore[union-attr]
    assert xs[1] - origin_x == pytest.approx(2 * (xs[0] - origin_x), rel=1e-3)
    assert {"1", "2", "4", "fast", "slow", "requests/s", "latency (us)", "t"} <= set(texts(root))
    dashed = root.findall(".//svg:polyline[@stroke-dasharray]", NS)
    assert len(dashed) == 1


def test_a_log_axis_has_1_2_5_ticks_and_leaves_out_points_it_cannot_show() -> None:
    series = Series("p99", [(1, 0.0), (2, 900.0), (3, 1800.0), (4, 3600.0)], list("abcd"))
    root = parse(line_chart([series], title="t", x=Axis("x"), y=Axis("y", log=True)))
    (line,) = polylines(root)
    assert len(line) == 3  # latency 0 has no place on a log axis
    assert "a" not in texts(root) and {"b", "c", "d"} <= set(texts(root))
    assert {"500", "1k", "2k", "5k"} <= set(texts(root))
    (_, b), (_, c), (_, d) = line
    assert b - c == pytest.approx(c - d, abs=0.15)  # equal ratios, equal steps


def test_labels_are_escaped_and_an_empty_chart_is_still_a_document() -> None:
    tricky = Series('a<b & "c"', [(1, 1)])
    root = parse(line_chart([tricky], title="x < y", x=Axis("&"), y=Axis(">")))
    assert 'a<b & "c"' in texts(root) and "x < y" in texts(root)
    empty = parse(line_chart([], title="none", x=Axis("x"), y=Axis("y", log=True)))
    assert polylines(empty) == []


def test_series_given_one_colour_share_it_and_others_take_the_palette() -> None:
    both = [Series("p50", [(1, 1)], colour="#123456"), Series("p99", [(1, 2)], colour="#123456")]
    root = parse(line_chart([*both, Series("x", [(2, 2)])], title="t", x=Axis("x"), y=Axis("y")))
    strokes = [
        line.attrib["stroke"] for line in root.findall(".//svg:g[@class='series']/svg:polyline", NS)
    ]
    assert strokes[:2] == ["#123456", "#123456"] and strokes[2] != "#123456"
