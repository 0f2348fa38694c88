"""Ctrl-C (SIGINT) and SIGTERM at several moments of long commands: one stderr line
"moe-place CMD: interrupted", exit 130 / 143, no traceback, no file (partial or temporary) left,
no worker process left; and the pieces that make it so (moe_place.interrupts)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from ortools.sat.python import cp_model

from moe_place import progress
from moe_place.interrupts import Interrupted, run_stoppable, signals_raise
from moe_place.io import write_atomic
from moe_place.solvers.base import stoppable_solve

ROOT = Path(__file__).resolve().parents[1]
QWEN = ROOT / "traces" / "data" / "qwen3-30b-a3b_prefill_topk.npz"
CLI = [sys.executable, "-m", "moe_place.cli.main"]
LONG_PLAN = ["plan", str(QWEN), "--gpus", "64", "--redundant", "64", "--time-limit", "60"]  # 30-60 s of work
LONG_REPLAY = ["replay", "--synthetic", "drift:steps=40000,seed=0", "--gpus", "8"]  # about 20 s
GRACE_S = 30  # a run not stopped by the signal would go on for longer than this (liveness, not speed)


def _start(argv: list[str], folder: Path) -> subprocess.Popen:
    """The command in its own process group, as a shell runs a foreground job."""
    return subprocess.Popen(CLI + argv, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


# (name, command line, signal, seconds after the start). Moments of the plan: during the imports, while
# the trace is read and the anytime plan made, during fast, during CP-SAT (from about 5 s on 2 cores).
# SIGINT goes to the process group (a terminal's Ctrl-C reaches the workers of --jobs too), SIGTERM to
# the command alone (`kill PID`: it must stop its workers itself).
CASES = [(f"plan-{signal.Signals(signum).name}-{after_s}s{'-jobs2' if jobs else ''}",
          LONG_PLAN + (["--jobs", "2"] if jobs else []) + ["--out", "plan.json"], signum, after_s)
         for signum, after_s, jobs in [(signal.SIGINT, 0.8, False), (signal.SIGINT, 1.5, False),
                                       (signal.SIGINT, 4.0, False), (signal.SIGINT, 9.0, False),
                                       (signal.SIGINT, 12.0, False), (signal.SIGTERM, 2.5, False),
                                       (signal.SIGTERM, 10.0, False), (signal.SIGINT, 9.0, True),
                                       (signal.SIGTERM, 9.0, True)]]
CASES += [(f"replay-{signal.Signals(signum).name}-{after_s}s",
           LONG_REPLAY + ["--out", "replay.json", "--plot", "replay.png"], signum, after_s)
          for signum, after_s in [(signal.SIGINT, 1.0), (signal.SIGINT, 3.0), (signal.SIGTERM, 3.0)]]
# `--objective time` runs its own CP-SAT models (solvers/comm/replicas.py)
CASES += [("plan-time-objective-SIGINT-8.0s", ["plan", str(QWEN), "--gpus", "32", "--nodes", "4", "--redundant",
                                               "32", "--objective", "time", "--time-limit", "60", "--out",
                                               "plan.json"], signal.SIGINT, 8.0)]


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """{case name: (signal, command, exit code, stdout, stderr, files left, group gone)}, all runs
    started together (so the whole takes as long as the latest moment)."""
    runs = {}
    for name, argv, signum, after_s in CASES:
        folder = tmp_path_factory.mktemp(name)
        runs[name] = (signum, after_s, folder, _start(argv, folder), argv[0])
    start = time.monotonic()
    for signum, after_s, _, proc, _ in sorted(runs.values(), key=lambda r: r[1]):
        time.sleep(max(0.0, start + after_s - time.monotonic()))
        if signum == signal.SIGINT:
            os.killpg(proc.pid, signum)
        else:
            os.kill(proc.pid, signum)
    results = {}
    for name, (signum, _, folder, proc, command) in runs.items():
        try:
            out, err = proc.communicate(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        results[name] = (signum, command, proc.returncode, out, err, sorted(p.name for p in folder.iterdir()),
                         _group_gone(proc.pid))
    return results


def _group_gone(pgid: int) -> bool:
    for _ in range(50):
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    os.killpg(pgid, signal.SIGKILL)
    return False


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_an_interrupt_ends_the_command_with_one_line_and_no_file(interrupted, name):
    signum, command, code, out, err, left, group_gone = interrupted[name]
    assert code == 128 + signum, (code, err)  # 130 for SIGINT, 143 for SIGTERM; not 0, not 134 (abort)
    # stderr is a pipe: progress prints a plain line every few seconds (moe_place.progress), then the one line
    lines = [line for line in err.splitlines() if not progress.LINE.fullmatch(line)]
    assert lines == [f"moe-place {command}: interrupted"], err
    assert out == ""
    assert left == [], "a file was left behind"
    assert group_gone, "a worker process outlived the command"


# ---------------------------------------------------------------------- the pieces
def _hard_model() -> cp_model.CpModel:
    """Bin packing CP-SAT cannot close in seconds: 120 items on 12 bins, minimise the fullest bin."""
    weights = np.random.default_rng(0).integers(1000, 100_000, size=120)
    model = cp_model.CpModel()
    x = [[model.NewBoolVar("") for _ in range(12)] for _ in weights]
    for row in x:
        model.AddExactlyOne(row)
    fullest = model.NewIntVar(0, int(weights.sum()), "fullest")
    for b in range(12):
        model.Add(sum(int(w) * row[b] for w, row in zip(weights, x)) <= fullest)
    model.Minimize(fullest)
    return model


def _signal_self_after(seconds: float, signum: int = signal.SIGINT) -> threading.Timer:
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signum))
    timer.start()
    return timer


def test_a_cpsat_solve_stops_through_stop_search_when_interrupted():
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.max_time_in_seconds = 60.0
    model = _hard_model()
    with signals_raise():
        _signal_self_after(0.5, signal.SIGTERM)
        with pytest.raises(Interrupted) as caught:
            stoppable_solve(solver, model)
    assert 128 + caught.value.signum == 143
    assert solver.wall_time < 30  # stopped by stop_search, not by its 60 s limit
    assert solver.parameters.catch_sigint_signal is False  # CP-SAT's own handler would swallow Ctrl-C


def test_cpsat_keeps_the_python_sigint_handler():
    """CP-SAT's own handler (catch_sigint_signal, on by default) resets SIGINT to the default
    action after a solve: later Ctrl-Cs then kill the process, or abort it inside OR-Tools."""
    with signals_raise():
        ours = signal.getsignal(signal.SIGINT)
        model = cp_model.CpModel()
        x = model.NewIntVar(0, 10, "x")
        model.Maximize(x)
        stoppable_solve(cp_model.CpSolver(), model)
        _signal_self_after(0.05)
        with pytest.raises(Interrupted):
            time.sleep(5)
        assert signal.getsignal(signal.SIGINT) is ours


def test_run_stoppable_returns_and_raises_what_the_work_does():
    assert run_stoppable(lambda: 42, lambda: None) == 42
    with pytest.raises(ZeroDivisionError):
        run_stoppable(lambda: 1 / 0, lambda: None)


def test_run_stoppable_stops_even_when_the_interrupt_comes_before_the_work_starts():
    started = threading.Event()
    stop = threading.Event()
    stops = []

    def work():
        started.set()
        stop.wait(30)
        return "stopped" if stop.is_set() else "ran out"

    def stopper():
        stops.append(started.is_set())
        if started.is_set():
            stop.set()

    with signals_raise():
        _signal_self_after(0.1)
        with pytest.raises(Interrupted):
            run_stoppable(lambda: (time.sleep(0.3), work())[1], stopper)
    assert stops and stops[-1] is True  # stopped again until the work had started and could stop


def test_a_second_signal_does_not_cut_the_cleanup_short(tmp_path):
    """The first signal raises; one arriving while that unwinds is ignored (the temporary file of
    an atomic write is still removed)."""
    target = tmp_path / "out.json"
    real_fsync = os.fsync

    def slow_fsync(fd):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # the first interrupt lands here
        real_fsync(fd)

    with signals_raise():
        os.fsync = slow_fsync
        try:
            with pytest.raises(Interrupted):
                write_atomic(target, "x" * 1000)
        finally:
            os.fsync = real_fsync
        os.kill(os.getpid(), signal.SIGINT)  # the second one, after: ignored
        time.sleep(0.05)
    assert list(tmp_path.iterdir()) == []


def test_an_interrupt_that_became_another_exception_is_still_reported_as_one(monkeypatch, capsys):
    """Raised inside a C extension's initialisation (Ctrl-C while OR-Tools is imported), the
    interrupt surfaces as `ImportError: initialization failed`: a traceback and exit 1 before."""
    from moe_place.cli import main as cli_main
    from moe_place.cli import synth

    def interrupted_import(args):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except KeyboardInterrupt:
            raise ImportError("initialization failed") from None

    monkeypatch.setattr(synth, "run", interrupted_import)
    assert cli_main.main(["synth", "drift:steps=3", "--out", "/tmp/never-written.npz"]) == 130
    assert capsys.readouterr().err.splitlines() == ["moe-place synth: interrupted"]


def test_an_interrupt_a_library_swallowed_still_stops_the_command_before_it_writes(monkeypatch, capsys, tmp_path):
    """A C extension's import turned the interrupt into an ImportError that an optional-import
    fallback caught: the run went on and wrote its files (exit 0, seen once in the suite)."""
    from moe_place.cli import main as cli_main
    from moe_place.cli import synth

    real_run = synth.run

    def swallowing_run(args):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except KeyboardInterrupt:
            pass  # what `try: import optional_extension / except ImportError` amounts to
        return real_run(args)

    monkeypatch.setattr(synth, "run", swallowing_run)
    out = tmp_path / "s.npz"
    assert cli_main.main(["synth", "drift:steps=3", "--out", str(out)]) == 130
    assert capsys.readouterr().err.splitlines() == ["moe-place synth: interrupted"]
    assert list(tmp_path.iterdir()) == []


def test_scip_does_not_swallow_an_interrupt():
    """SCIP (the pairing IP of solvers/bounds.py, at 2 slots per GPU) caught Ctrl-C itself: the
    solve ended as 'unknown' and the command went on. Now the interrupt stops it after the solve."""
    from moe_place.solvers import bounds
    from moe_place.traces.synthetic import deepseek_r1_like

    loads = deepseek_r1_like(num_steps=8).total_counts().astype(float)[0]
    target = 1.01 * bounds.pairing_lp_bound(loads, 144, 288, loads.sum() / 144, loads.max())
    start = time.perf_counter()
    bounds.pairing_ip(loads, 144, 288, target, 10.0)
    solve_s = time.perf_counter() - start  # 0.1-0.5 s: most of it inside SCIP
    with signals_raise():
        _signal_self_after(solve_s / 2)
        with pytest.raises(Interrupted):
            bounds.pairing_ip(loads, 144, 288, target, 10.0)
            time.sleep(1)  # a signal that came before SCIP started is raised here; one SCIP swallowed is not
