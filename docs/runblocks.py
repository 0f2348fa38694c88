"""The documentation's runnable blocks: find them, run them on the bundled data, compare with the page.

A block is runnable when the line right before its opening fence is `<!-- runnable -->` (or
`<!-- runnable exit=2 -->`: every command of the block must then exit with 2 instead of 0):

- a `console` block: each line starting with `$ ` is a command (a line ending in a backslash goes on
  on the next one); the lines after it, up to the next `$ `, are what it prints, stdout and stderr
  together as a terminal shows them;
- a `python` block: the code, run by the Python that runs the check; the next fenced block of the page
  is what it prints.

What a block shows must be what the command prints, numbers to the digit, except that
- a line `...` stands for any number of lines, none included (a long table shown in part);
- wall-clock times may differ: the numbers that `TIME_PATTERNS` finds, and those under a column
  headed `wall_s`; where one is of another width, a run of spaces matches any run of spaces;
- trailing spaces do not count;
- progress lines (`moe_place.progress.LINE`, printed every few seconds of long work where stderr is not a
  terminal) are left out: a terminal redraws its bar in their place.

A `console` block that shows output and cannot run here (it needs a GPU or an engine) says why on the
line before it: `<!-- not run: REASON -->`; tests/test_docs.py refuses a `console` block with neither.

Each page's blocks run in order in one fresh folder holding copies of the checkout's `traces/` and
`bench/`, with the `moe-place` and `python` of the running interpreter first on PATH and no
`MOE_PLACE_*` variable set. `python docs/runblocks.py PAGE.md...` runs them and prints what differs
(`--show`: every command's output as it is; `--fill`: write it where a command shows nothing yet,
to write a page from).
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from moe_place.progress import LINE as PROGRESS_LINE

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^<!-- runnable(?: exit=(?P<exit>\d+))? -->$")
NOT_RUN = re.compile(r"^<!-- not run: \S.* -->$")
FENCE = re.compile(r"^```(?P<lang>[\w-]*)")
COPIED = ("traces", "bench")  # what the commands read, copied into the folder they run in
COMMAND_TIMEOUT_S = 120

# Wall-clock times in what the subcommands print (group `t`); every other number must match to the digit.
TIME_PATTERNS = [
    re.compile(r", (?P<t>\d+\.\d+) s$"),  # the summary line of plan and evaluate: "..., status heuristic, 0.96 s"
    re.compile(r"done in (?P<t>\d+\.\d+) s"),  # compare's progress line per solver
    re.compile(r"\((?P<t>\d+\.\d+) ms CPU measured"),  # replay: the policy's CPU time, measured
]
TIME_COLUMNS = ("wall_s",)  # table headers whose column holds times
_NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")
_TIME_REGEX = r"\d[\d,]*(?:\.\d+)?"


@dataclass
class Command:
    text: str  # the shell command, continuation lines joined
    expected: list[str]  # the lines the page shows for it
    exit_code: int
    line: int  # where it is on the page (1-based)
    output_at: int  # the index of the page's line where its output starts


@dataclass
class Block:
    page: Path
    line: int
    language: str
    commands: list[Command]


def _fences(lines: list[str]):
    """(start index, language, body lines, end index) of each top-level fenced block."""
    index = 0
    while index < len(lines):
        match = FENCE.match(lines[index])
        if not match:
            index += 1
            continue
        end = index + 1
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        yield index, match["lang"], lines[index + 1:end], end
        index = end + 1


def _console_commands(body: list[str], first_line: int, exit_code: int) -> list[Command]:
    commands: list[Command] = []
    index = 0
    while index < len(body):
        line = body[index]
        if not line.startswith("$ "):
            raise ValueError(f"line {first_line + index}: a runnable console block starts each command with '$ '")
        text, start = line[2:], index
        while text.endswith("\\") and index + 1 < len(body):
            index += 1
            text = text[:-1] + "\n" + body[index]
        index += 1
        output = []
        while index < len(body) and not body[index].startswith("$ "):
            output.append(body[index])
            index += 1
        commands.append(Command(text, output, exit_code, first_line + start, first_line - 1 + index - len(output)))
    return commands


def blocks(page: Path) -> list[Block]:
    """The runnable blocks of a page, in order."""
    lines = page.read_text(encoding="utf-8").splitlines()
    fences = list(_fences(lines))
    found = []
    for number, (start, language, body, _end) in enumerate(fences):
        marker = MARKER.match(lines[start - 1]) if start else None
        if not marker:
            continue
        exit_code = int(marker["exit"] or 0)
        if language == "console":
            commands = _console_commands(body, start + 2, exit_code)
        elif language == "python":
            if number + 1 >= len(fences):
                raise ValueError(f"{page}:{start + 1}: a runnable python block needs the block of its output after it")
            code = "\n".join(body)
            commands = [Command(f"python - <<'MOE_PLACE_DOCS_EOF'\n{code}\nMOE_PLACE_DOCS_EOF", fences[number + 1][2],
                                exit_code, start + 1, fences[number + 1][0] + 1)]
        else:
            raise ValueError(f"{page}:{start + 1}: runnable blocks are console or python blocks, not {language!r}")
        found.append(Block(page, start + 1, language, commands))
    return found


def unmarked_console_blocks(page: Path) -> list[int]:
    """Lines (1-based) of the page's console blocks marked neither runnable nor `not run: REASON`."""
    lines = page.read_text(encoding="utf-8").splitlines()
    return [start + 1 for start, language, _body, _end in _fences(lines) if language == "console"
            and not (start and (MARKER.match(lines[start - 1]) or NOT_RUN.match(lines[start - 1])))]


# ------------------------------------------------------------------------------------------- matching
def _time_spans(line: str, columns: list[tuple[int, int]]) -> list[tuple[int, int]]:
    spans = [match.span("t") for pattern in TIME_PATTERNS for match in pattern.finditer(line)]
    for number in _NUMBER.finditer(line):
        if any(number.start() < end and start < number.end() for start, end in columns):
            spans.append(number.span())
    return sorted(set(spans))


def _literal(text: str, at_start: bool) -> str:
    pieces = re.split(r"( +)", text)
    out = []
    for index, piece in enumerate(pieces):
        if piece.startswith(" "):
            out.append(" *" if at_start and index == 0 else " +")
        elif piece:
            out.append(re.escape(piece))
    return "".join(out)


def line_pattern(line: str, columns: list[tuple[int, int]]) -> str:
    """The regular expression one shown line stands for."""
    out, position = [], 0
    for start, end in _time_spans(line, columns):
        if start < position:
            continue
        out.append(_literal(line[position:start], position == 0))
        out.append(_TIME_REGEX)
        position = end
    out.append(_literal(line[position:], position == 0))
    return "".join(out)


def block_pattern(expected: list[str]) -> re.Pattern:
    """The regular expression a command's shown output stands for (see the module's docstring)."""
    parts, columns = [], []
    for line in (raw.rstrip() for raw in expected):
        if line == "...":
            parts.append(r"(?:[^\n]*\n)*?")
            continue
        if not line:
            columns = []
        header = [match.span() for name in TIME_COLUMNS for match in re.finditer(rf"\b{name}\b", line)]
        if header:
            columns = header
        parts.append(line_pattern(line, columns) + r"\n")
    return re.compile("".join(parts))


def normalised(output: str) -> str:
    lines = [line.rstrip() for line in output.splitlines()]
    return "".join(line + "\n" for line in lines)


def matches(expected: list[str], output: str) -> bool:
    return block_pattern(expected).fullmatch(normalised(output)) is not None


# -------------------------------------------------------------------------------------------- running
def workdir(parent: Path) -> Path:
    """A fresh folder for one page's commands: copies of what they read."""
    folder = Path(tempfile.mkdtemp(prefix="docs-", dir=parent))
    for name in COPIED:
        shutil.copytree(ROOT / name, folder / name, ignore=shutil.ignore_patterns("__pycache__"))
    return folder


def environment() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("MOE_PLACE_")}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["PYTHONUNBUFFERED"] = "1"  # stdout and stderr in the order they were written, as in a terminal
    return env


def run(command: Command, folder: Path, env: dict[str, str]) -> tuple[int, str]:
    done = subprocess.run(["bash", "-c", command.text], cwd=folder, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=COMMAND_TIMEOUT_S)
    # progress lines (a pipe gets one every few seconds of long work) are what a terminal redraws: no page shows them
    return done.returncode, "".join(line for line in done.stdout.splitlines(keepends=True)
                                    if not PROGRESS_LINE.fullmatch(line.rstrip("\n")))


def check_page(page: Path, parent: Path, show: bool = False, fill: bool = False) -> list[str]:
    """Run a page's runnable blocks; one message per command whose exit code or output differs from the page
    (`fill`: a console command that shows nothing gets its output written under it instead)."""
    problems, filled = [], []
    found = blocks(page)
    if not found:
        return problems
    folder, env = workdir(parent), environment()
    try:
        for block in found:
            for command in block.commands:
                code, output = run(command, folder, env)
                where = f"{os.path.relpath(page, ROOT)}:{command.line}"
                if show:
                    print(f"--- {where} $ {command.text} (exit {code})\n{output}", end="")
                if fill and not command.expected:
                    filled.append((command.output_at, normalised(output).splitlines()))
                    continue
                if code != command.exit_code:
                    problems.append(f"{where}: `{command.text}` exited {code}, the page says {command.exit_code}:\n"
                                    f"{output}")
                elif not matches(command.expected, output):
                    diff = "\n".join(difflib.unified_diff(command.expected, normalised(output).splitlines(),
                                                          "the page", "the command", lineterm=""))
                    problems.append(f"{where}: `{command.text}` prints what the page does not show:\n{diff}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if filled:
        lines = page.read_text(encoding="utf-8").splitlines()
        for after, output in sorted(filled, reverse=True):
            lines[after:after] = output
        page.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return problems


def pages() -> list[Path]:
    """Every page the checks read: README.md and docs/**/*.md."""
    return [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="docs/runblocks.py", description=__doc__.splitlines()[0])
    parser.add_argument("pages", nargs="*", type=Path, help="pages to check (default: README.md and docs/**/*.md)")
    parser.add_argument("--show", action="store_true", help="print every command's output as it is")
    parser.add_argument("--fill", action="store_true", help="write the output of commands that show none")
    args = parser.parse_args(argv)
    problems = []
    with tempfile.TemporaryDirectory() as parent:
        for page in [p.resolve() for p in args.pages] or pages():
            problems += check_page(page, Path(parent), args.show, args.fill)
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
