"""The one progress line (:mod:`ipuserve.progress`), which the runtime's tools and
``ipuserve bench`` both draw with."""

from __future__ import annotations

import io

from ipuserve.progress import Progress, ProgressLine


def test_progress_line_draws_one_updating_line_when_forced() -> None:
    stream = io.StringIO()
    line = ProgressLine(stream, enabled=True, interval_s=0.0)
    line(Progress("warm-up", 1.0, 10, "items"))
    line(Progress("measuring", 2.0, 500, "items"))
    line.finish()
    text = stream.getvalue()
    assert text.count("\r") == 2 and text.endswith("\n") and text.count("\n") == 1
    assert "measuring" in text and "500 items" in text and "250 items/s" in text


def test_progress_line_is_silent_off_a_terminal_unless_enabled() -> None:
    stream = io.StringIO()  # isatty() is False
    for line in (ProgressLine(stream), ProgressLine(stream, enabled=False, interval_s=0.0)):
        line(Progress("measuring", 1.0, 1, "runs"))
        line.finish()
    assert stream.getvalue() == ""


def test_progress_line_redraws_at_most_once_per_interval() -> None:
    stream = io.StringIO()
    line = ProgressLine(stream, enabled=True, interval_s=3600.0)
    for done in range(100):
        line(Progress("measuring", 1.0, done, "runs"))
    assert stream.getvalue().count("\r") == 1


def test_the_line_ends_on_the_last_snapshot_even_one_the_interval_held_back() -> None:
    """A wait that ends within the interval (a load READY 0.1 s after its last drawing)
    must not leave the line saying LOADING above a table that says READY."""
    stream = io.StringIO()
    line = ProgressLine(stream, enabled=True, interval_s=3600.0)
    line(Progress("loading", 0.1, 0, "ready", "v2 LOADING", rate=False))
    line(Progress("loading", 0.3, 1, "ready", "v2 READY", rate=False))
    line.finish()
    drawings = stream.getvalue().split("\r")[1:]
    assert len(drawings) == 2 and drawings[-1].rstrip("\n").endswith("v2 READY")
    assert stream.getvalue().endswith("\n")


def test_progress_line_shows_the_detail_after_the_rate() -> None:
    stream = io.StringIO()
    line = ProgressLine(stream, enabled=True, interval_s=0.0)
    line(Progress("measuring", 2.0, 100, "requests", "errors 3  in flight 16"))
    assert stream.getvalue().endswith("50 requests/s  errors 3  in flight 16")


def test_a_note_has_its_own_line_even_off_a_terminal() -> None:
    """What a user must see (a run stuck waiting) is said even where nothing is drawn,
    and below a line drawn so far, not over it."""
    quiet = io.StringIO()
    ProgressLine(quiet).note("waiting")
    assert quiet.getvalue() == "waiting\n"
    drawn = io.StringIO()
    line = ProgressLine(drawn, enabled=True, interval_s=0.0)
    line(Progress("measuring", 1.0, 1, "runs"))
    line.note("waiting")
    line(Progress("measuring", 2.0, 2, "runs"))
    line.finish()
    first, note, last, end = drawn.getvalue().split("\n")
    assert first.startswith("\rmeasuring") and note == "waiting"
    assert last.startswith("\rmeasuring") and end == ""


def test_a_count_with_no_rate_draws_none() -> None:
    """A load's wait counts versions READY: "0 ready/s" would say nothing."""
    stream = io.StringIO()
    line = ProgressLine(stream, enabled=True, interval_s=0.0)
    line(Progress("loading mlp", 2.0, 1, "ready", "v1 READY v2 LOADING", rate=False))
    text = stream.getvalue()
    assert "/s" not in text and text.endswith("1 ready  v1 READY v2 LOADING")
