"""The stderr progress bar: redrawn when the shown percentage changes, always at the end."""

import io

from moe_place.progress import ProgressBar


def test_draws_each_percent_once_and_the_end():
    out = io.StringIO()
    bar = ProgressBar(1000, "replay ours", "steps", width=10, stream=out, enabled=True)
    for _ in range(1000):
        bar.advance()
    bar.close()
    frames = out.getvalue().split("\r")[1:]
    assert len(frames) == 101  # 0%, 1%, ..., 100%
    assert frames[0] == "replay ours [..........] 0/1000 steps"
    assert frames[-1] == "replay ours [##########] 1000/1000 steps\n"
    assert frames[50].startswith("replay ours [#####.....] 500/1000")


def test_small_totals_draw_every_unit_and_never_overrun():
    out = io.StringIO()
    bar = ProgressBar(3, "plan fast", "layers", width=3, stream=out, enabled=True)
    bar.advance(2)
    bar.advance(5)
    assert out.getvalue().split("\r")[1:] == ["plan fast [...] 0/3 layers", "plan fast [##.] 2/3 layers",
                                              "plan fast [###] 3/3 layers"]


def test_nothing_is_drawn_when_the_stream_is_not_a_terminal():
    out = io.StringIO()  # a log file, a pipe: isatty() is False
    bar = ProgressBar(10, "plan fast", "layers", stream=out)
    bar.advance(10)
    bar.close()
    assert out.getvalue() == ""
