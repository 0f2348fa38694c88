"""Progress on stderr: on a terminal a bar redrawn when the shown percentage changes (always at the end); off a
terminal a plain line every few seconds of a monotonic clock, and a last one; stdout stays clean."""

import io
import json
import subprocess
import sys

import numpy as np

from moe_place.progress import INTERVAL_S, LINE, ProgressBar


class FakeClock:
    """A monotonic clock the test moves by hand: the lines depend on it, never on the machine's speed."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_draws_each_percent_once_and_the_end():
    out = io.StringIO()
    bar = ProgressBar(1000, "replay ours", "steps", width=10, stream=out, redraw=True)
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
    bar = ProgressBar(3, "plan fast", "layers", width=3, stream=out, redraw=True)
    bar.advance(2)
    bar.advance(5)
    assert out.getvalue().split("\r")[1:] == ["plan fast [...] 0/3 layers", "plan fast [##.] 2/3 layers",
                                              "plan fast [###] 3/3 layers"]


def test_off_a_terminal_a_line_every_interval_and_a_last_one():
    out, clock = io.StringIO(), FakeClock()  # a log file, a pipe: isatty() is False
    bar = ProgressBar(48, "plan fast", "layers", stream=out, clock=clock)
    for layer in range(48):
        clock.now += 1.0  # a layer a second: a line every INTERVAL_S (5) layers
        bar.advance()
    bar.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert INTERVAL_S == 5.0 and len(lines) == 48 // 5 + 1
    assert lines[0] == "plan fast: 5/48 layers (10%) after 5 s"
    assert lines[1] == "plan fast: 10/48 layers (20%) after 10 s"
    assert lines[-1] == "plan fast: 48/48 layers (100%) after 48 s, done"
    assert all(LINE.fullmatch(line) for line in lines)  # how readers of a log set them apart


def test_off_a_terminal_a_short_phase_prints_nothing_and_disabled_never():
    out, clock = io.StringIO(), FakeClock()
    bar = ProgressBar(10, "plan fast", "layers", stream=out, clock=clock)
    clock.now += INTERVAL_S - 0.5
    bar.advance(10)
    bar.close()
    off = ProgressBar(10, "plan fast", "layers", stream=out, clock=clock, enabled=False)
    clock.now += 60
    off.advance(10)
    off.close()
    assert out.getvalue() == ""


def test_off_a_terminal_a_slow_unit_prints_at_its_end():
    out, clock = io.StringIO(), FakeClock()
    bar = ProgressBar(3, "size redundancy", "plans", stream=out, clock=clock)
    clock.now += 60  # one unit of a minute: the line comes when it ends (the bar has no thread of its own)
    bar.advance()
    clock.now += 1
    bar.advance(2)
    bar.close()
    assert out.getvalue().splitlines() == ["size redundancy: 1/3 plans (33%) after 60 s",
                                           "size redundancy: 3/3 plans (100%) after 61 s, done"]


# A real command with stderr piped (not a terminal). INTERVAL_S = 0 prints a line at every unit of work, so the
# test does not wait for the clock; what each line says is the same as at 5 s.
RUN_WITH_LINES = ("import sys, moe_place.progress as p; p.INTERVAL_S = 0; from moe_place.cli.main import main; "
                  "sys.exit(main(sys.argv[1:]))")


def _trace(tmp_path):
    rng = np.random.default_rng(3)
    path = tmp_path / "t.npz"
    counts = 2 * rng.integers(0, 200, (8, 3, 16))  # 8 steps, 3 layers, 16 experts, top-2
    np.savez(path, format_version=1, num_experts=16, top_k=2, counts=counts)
    return path


def test_plan_per_batch_search_prints_lines_off_a_terminal_and_stdout_stays_json(tmp_path):
    argv = ["plan", str(_trace(tmp_path)), "--gpus", "4", "--redundant", "4", "--split", "per-batch",
            "--out", str(tmp_path / "p.json"), "--format", "json"]
    done = subprocess.run([sys.executable, "-c", RUN_WITH_LINES, *argv], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    json.loads(done.stdout)  # progress went to stderr only
    search = [line for line in done.stderr.splitlines() if line.startswith("plan per-batch split search: ")]
    assert search and search[-1] == "plan per-batch split search: 120/120 layer rounds (100%) after 0 s, done"
    assert [line for line in done.stderr.splitlines() if line.startswith("plan fast: ")]
    assert "\r" not in done.stderr
    quiet = subprocess.run([sys.executable, "-c", RUN_WITH_LINES, *argv, "--no-progress"], capture_output=True,
                           text=True, timeout=300)
    assert quiet.returncode == 0 and " layer rounds " not in quiet.stderr and "plan fast: " not in quiet.stderr
