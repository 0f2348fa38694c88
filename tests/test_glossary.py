"""Every column and label the CLI's tables print is defined in the glossary (`moe_place.glossary.TERMS`).

Each main table-printing subcommand runs in-process on the bundled traces, scenarios or a small synthetic
trace; the names it prints are read off its output by two rules, and each must be a term or an alias:

- a table header is a line without numbers directly above a row with at least two numbers (or above a
  line of dashes, the row under it), both fixed-width: two or more spaces between some of their words.
  Its columns are read against that row: a header word belongs to the row's cell it overlaps (`top8 share`
  over `21.8%`), a word over no cell to the next word's column (headers are right-aligned over their
  numbers: `mean max/bound`);
- a label is the `label  value` of a summary line: at most four words at the line's start, two or more
  spaces, a value of single-spaced words starting in the same column as another such line's (`replay`,
  `cadence`; `predict` and `payback` print the report's dotted keys: their first part, the section).
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from moe_place.cli.main import main
from moe_place.glossary import ALIASES, TERMS

_UNITS = {"s", "ms", "us", "mb", "gb", "gib", "mib", "%"}


def normalise(name: str) -> str:
    """A term or a printed column as `lookup` compares them: lower case, without backticks, brackets and a
    trailing unit word (`RDMA MB` -> `rdma`), every number written `n` (`EP8` -> `epn`)."""
    words = [word.strip("()[]|:,") for word in re.sub(r"\d+", "n", name.lower().replace("`", "")).split()]
    words = [word for word in words if word]
    if len(words) > 1 and words[-1] in _UNITS:
        words.pop()
    return " ".join(words)


_INDEX = {normalise(spelling): term for spelling, term in {**{t: t for t in TERMS}, **ALIASES}.items()}


def lookup(name: str) -> str | None:
    """The term of `TERMS` that `name` (a term, an alias or a printed column, any case) names, or None."""
    return _INDEX.get(normalise(name))


ROOT = Path(__file__).resolve().parents[1]
QWEN = str(ROOT / "traces" / "data" / "qwen3-30b-a3b_prefill_topk.npz")
OLMOE = str(ROOT / "traces" / "data" / "olmoe-1b-7b_expert_counts_L0_L7_L15.npz")
SCENARIOS = ROOT / "bench" / "scenarios"
DRIFT = "drift:steps={},layers=2,experts=32,tokens=1024,seed=0"
QUIET = "--no-progress"

# subcommand (the test's id) -> the command lines it runs; each takes a second or so here, cadence a few
COMMANDS = {
    "analyze": [["analyze", OLMOE, QUIET]],
    "plan": [["plan", QWEN, "--gpus", "32", "--redundant", "32", "--layers", "0-3", "--out", "p.json", QUIET]],
    "plan-sizing": [["plan", QWEN, "--gpus", "32", "--redundant", "auto", "--layers", "0-1", "--out", "p.json", QUIET]],
    "plan-budget": [["plan", QWEN, "--gpus", "64", "--expert-memory-budget", "7.5GiB", "--expert-bytes", "9MiB",
                     "--layers", "0-1", "--out", "p.json", QUIET]],
    "evaluate": [["plan", QWEN, "--gpus", "32", "--nodes", "4", "--redundant", "32", "--layers", "0-1", "--out",
                  "p.json", QUIET],
                 ["evaluate", "p.json", QWEN, QUIET]],
    "compare": [["compare", QWEN, "--gpus", "32", "--redundant", "32", "--layers", "0-3", "--solvers", "eplb,fast",
                 QUIET]],
    "predict": [["predict", str(path)] for path in sorted(SCENARIOS.glob("c*.toml")) if not path.name.startswith("c9")],
    "payback": [["payback", str(SCENARIOS / "c9_payback.toml")]],
    "replay": [["replay", "--synthetic", DRIFT.format(600), "--gpus", "8", "--redundant", "8", "--step-interval",
                "100", "--window", "100", QUIET],
               ["replay", "--synthetic", DRIFT.format(600), "--gpus", "8", "--nodes", "2", "--redundant", "8",
                "--engine", "sglang", "--controller", "engine-default", "--step-interval", "100", QUIET],
               ["replay", "--synthetic", DRIFT.format(600), "--gpus", "8", "--redundant", "8", "--split", "per-batch",
                "--step-interval", "100", QUIET]],
    "cadence": [["cadence", "--synthetic", DRIFT.format(760), "--gpus", "8", "--redundant", "8", QUIET]],
    "offload": [["offload", OLMOE, "--gpu-memory", "1GiB", "--batches", "16", "--out", "o.json"]],
}

NUMBER = re.compile(r"[-+]?(?:\d[\d,]*)?\.?\d+(?:e[-+]?\d+)?[%x]?")
DASHES = re.compile(r"-{3,}")
LABEL = re.compile(r"(\S+(?: \S+){0,3}) {2,}(\S+(?: \S+)*)")


def _words(line: str) -> list[tuple[int, int, str]]:
    return [(m.start(), m.end(), m.group()) for m in re.finditer(r"\S+", line)]


def _numbers(line: str) -> int:
    return sum(bool(NUMBER.fullmatch(word)) for _, _, word in _words(line))


def _fixed_width(line: str) -> bool:
    return "  " in line.strip()


def columns(header: str, row: str) -> list[str]:
    """The column names of a fixed-width table's header line, read against a row of the table."""
    cells = _words(row)
    groups: dict[int, list[str]] = {}
    waiting: list[str] = []
    for start, end, word in _words(header):
        overlap, cell = max(((min(end, e) - max(start, s), i) for i, (s, e, _) in enumerate(cells)), default=(0, -1))
        if overlap <= 0:
            waiting.append(word)
            continue
        groups.setdefault(cell, []).extend(waiting + [word])
        waiting = []
    names = [" ".join(words) for words in groups.values()] + ([" ".join(waiting)] if waiting else [])
    return [name for name in names if name.strip("|")]


def printed_names(text: str) -> list[str]:
    """The table columns and summary labels of a command's output (the rules of the module docstring)."""
    lines = text.splitlines()
    labels = {i: m for i, line in enumerate(lines) if (m := LABEL.fullmatch(line))}
    aligned = Counter(m.start(2) for m in labels.values())
    labels = {i: m for i, m in labels.items() if aligned[m.start(2)] > 1}
    names = []
    for i, line in enumerate(lines[:-1]):
        if i in labels or _numbers(line) or not _fixed_width(line):
            continue
        below = lines[i + 1]
        if DASHES.fullmatch(below.strip()) and i + 2 < len(lines):
            below = lines[i + 2]
        if i + 1 not in labels and _numbers(below) >= 2 and _fixed_width(below):
            names += columns(line, below)
    return names + [m.group(1).split(".")[0] for m in labels.values()]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_column_and_label_the_cli_prints_is_in_the_glossary(command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for argv in COMMANDS[command]:
        assert main(argv) == 0, argv
    names = printed_names(capsys.readouterr().out)
    assert names, f"{command}: no table header or label found: the rules of this test no longer read its output"
    missing = sorted({name for name in names if lookup(name) is None})
    assert not missing, f"{command} prints {missing}: define them in moe_place/glossary.py TERMS (or ALIASES)"


def test_the_rules_read_headers_over_their_columns_and_fail_on_a_new_one():
    out = ("layer max/mean    CV zero top8 share     EP8\n"
           "--------------------------------------------\n"
           "    0     2.09  0.33    0      21.8%    1.17\n"
           "\n"
           "solver    mean max/bound   wall_s  status\n"
           "eplb              1.1552     0.11  heuristic (co-located replicas)\n"
           "steps        600 (4 layers)\n"
           "rebalances   4\n")
    assert printed_names(out) == ["layer", "max/mean", "CV", "zero", "top8 share", "EP8",
                                  "solver", "mean max/bound", "wall_s", "status", "steps", "rebalances"]
    assert all(lookup(name) for name in printed_names(out))
    assert [lookup(name) for name in ("RDMA MB", "layer us", "EP32", "(layer)", "even: slots")] == [
        lookup("rdma"), lookup("layer"), lookup("ep8"), lookup("layer"), lookup("even slots")]
    assert lookup("frobnication ms") is None  # a new column without a definition fails the test above


def test_terms_and_aliases_are_defined_once():
    spellings = [normalise(term) for term in TERMS] + [normalise(alias) for alias in ALIASES]
    assert len(spellings) == len(set(spellings)), [s for s, n in Counter(spellings).items() if n > 1]
    assert set(ALIASES.values()) <= set(TERMS), set(ALIASES.values()) - set(TERMS)
    assert all(meaning.strip() and "\n" not in meaning for meaning in TERMS.values())
