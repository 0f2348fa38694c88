"""The documentation cannot rot: README.md and the site in docs/ are checked here, in CI's test command.

- the site builds with `mkdocs build --strict` (broken links, anchors and nav entries fail), and
  README's links into it point at pages and headings that exist;
- every block marked runnable runs on the bundled data and prints what its page shows (docs/runblocks.py);
- the generated pages (docs/reference/, docs/results/) are what their scripts render now;
- README is a front page: at most 15 KB, its four kinds of user in its first screen, its two commands,
  its headline figures on the pages it links;
- the task pages (README's "Tasks", the site's "Tasks" section) are how-tos of at most 1,500 words: history
  and measurement notes live in docs/design/, tables on docs/results/.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
sys.path.insert(0, str(DOCS))

import gen_reference  # noqa: E402 - docs/, put on the path above
import gen_results  # noqa: E402
import runblocks  # noqa: E402
from pagegen import stale_pages  # noqa: E402

MKDOCS = importlib.util.find_spec("mkdocs") is not None and importlib.util.find_spec("material") is not None
needs_mkdocs = pytest.mark.skipif(not MKDOCS and not os.environ.get("CI"),
                                  reason="the docs extra is not installed (pip install -e '.[docs]'); CI installs it")
PAGES = runblocks.pages()
RUNNABLE_PAGES = [page for page in PAGES if runblocks.blocks(page)]


# -------------------------------------------------------------------------------------------- the site
@pytest.fixture(scope="module")
def site(tmp_path_factory):
    assert MKDOCS, "mkdocs and mkdocs-material are not installed: CI installs the docs extra"
    folder = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(folder)], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return folder


@needs_mkdocs
def test_the_site_builds_in_strict_mode(site):
    for page in ("index.html", "plan/index.html", "reference/cli/index.html", "results/replay/index.html",
                 "records/replay_vllm.json"):
        assert (site / page).is_file(), page


def _readme_links() -> list[str]:
    text = README.read_text()
    return [link for link in re.findall(r"\]\(([^)]+)\)", text) if "://" not in link]


def test_readme_links_point_at_files_of_the_repository():
    missing = [link for link in _readme_links() if not (ROOT / link.split("#")[0]).exists()]
    assert not missing, missing


# ------------------------------------------------------------------- links readable where the pages live
# A page is read in the repository (GitHub, an editor) as well as on the site: its relative links and images must
# name files the repository has. Code is no link: fenced and indented blocks and inline code are dropped first.
FENCED = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INDENTED = re.compile(r"(?:^\n)((?:(?: {4}|\t).*\n|\n)+)", re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
INLINE_LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+[\"'][^)]*)?\)")  # [text](target "title")
REFERENCE = re.compile(r"^ {0,3}\[[^\]\n]+\]:[ \t]*(\S+)[ \t]*(?:[\"'(].*)?$", re.M)  # [label]: target
HTML_LINK = re.compile(r"<(?:a|img)\s[^>]*?(?:href|src)=\"([^\"]+)\"")


def relative_links(text: str) -> list[str]:
    """The relative targets of a Markdown page's links and images (no scheme, no bare #anchor), as written."""
    text = INLINE_CODE.sub("", INDENTED.sub("\n", FENCED.sub("", text)))
    targets = INLINE_LINK.findall(text) + REFERENCE.findall(text) + HTML_LINK.findall(text)
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def test_the_link_finder_reads_links_and_images_but_not_code():
    text = ("See [the plan](plan.md#flags) and ![a plot](../../bench/results/a.png \"title\"), [site](https://x.org),\n"
            "[top](#top), `[not](code.md)`.\n\n```\n[nor](fenced.md)\n```\n\n    [nor](indented.md)\n\n"
            "[ref]: ../README.md\n<img src=\"pic.png\">\n")
    assert relative_links(text) == ["plan.md#flags", "../../bench/results/a.png", "../README.md", "pic.png"]


def test_every_relative_link_and_image_names_a_file_of_the_repository():
    missing, count = [], 0
    for page in sorted(DOCS.rglob("*.md")) + [README]:
        for target in relative_links(page.read_text()):
            count += 1
            if not (page.parent / target.split("#")[0]).exists():
                missing.append(f"{page.relative_to(ROOT)}: {target}")
    assert count > 300 and not missing, missing  # (the results pages alone link about 100 records)


def test_the_site_points_record_links_at_its_copy_of_the_records():
    import hooks  # docs/hooks.py, on the path above; it imports mkdocs
    text = "[`r.json`](../../bench/results/r.json), ![p](../../bench/results/p.png), [x](../plan.md), [y](https://a/b)"
    assert hooks.site_links(text, "results/replay.md") == (
        "[`r.json`](../records/r.json), ![p](../records/p.png), [x](../plan.md), [y](https://a/b)")
    assert hooks.site_links("[r](../bench/results/r.json#top)", "index.md") == "[r](records/r.json#top)"


# ------------------------------------------------------------------- no internal issue numbers for users
INTERNAL_ISSUE = re.compile(r"\bissue \d+")  # ours; an upstream one is cited with its project and #, e.g. vLLM #30075


def _printed_strings(path: Path) -> list[str]:
    """The string constants of a module that can reach a user: all but docstrings, and of a bench script the
    module docstring where its --help prints it (the first line; all of it as an epilog)."""
    import ast

    source = path.read_text()
    tree = ast.parse(source)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    strings = [node.value for node in ast.walk(tree)
               if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]
    module_doc = ast.get_docstring(tree, clean=False) or ""
    if path.parts[-2] == "bench" and "__doc__" in source:
        strings.append(module_doc if "epilog=" in source else module_doc.split("\n")[0])
    return strings


def test_no_output_names_an_internal_issue():
    found = [f"{path.relative_to(ROOT)}: {text[:80]!r}"
             for folder in ("moe_place", "solvers", "traces", "kernels", "bench") for path in sorted((ROOT / folder).rglob("*.py"))
             for text in _printed_strings(path) if INTERNAL_ISSUE.search(text)]
    assert not found, found


def test_the_split_microbenchmark_names_no_internal_issue(capsys):
    from moe_place.cli.main import main
    assert main(["bench", "split", "--dry-run"]) == 0  # the section that named one; `all` takes 3x as long
    out = capsys.readouterr()
    assert "Per-batch split kernels" in out.out and not INTERNAL_ISSUE.search(out.out + out.err)


@needs_mkdocs
def test_readme_links_into_the_site_name_headings_it_has(site):
    missing = []
    for link in _readme_links():
        path, _, anchor = link.partition("#")
        if not anchor:
            continue
        assert path.startswith("docs/") and path.endswith(".md"), link
        name = path[len("docs/"):-len(".md")]
        html = (site / ("index.html" if name == "index" else f"{name}/index.html")).read_text()
        if f'id="{anchor}"' not in html:
            missing.append(link)
    assert not missing, missing


# ------------------------------------------------------------------------------------- runnable blocks
@pytest.mark.parametrize("page", RUNNABLE_PAGES, ids=[str(p.relative_to(ROOT)) for p in RUNNABLE_PAGES])
def test_runnable_blocks_print_what_the_page_shows(page, tmp_path):
    problems = runblocks.check_page(page, tmp_path)
    assert not problems, "\n\n".join(problems)


def test_the_task_pages_and_readme_have_runnable_blocks():
    expected = {"README.md", "docs/plan.md", "docs/traces.md", "docs/dropin.md", "docs/offload.md", "docs/multinode.md",
                "docs/replay.md", "docs/predict.md", "docs/errors.md"}
    assert expected <= {str(p.relative_to(ROOT)) for p in RUNNABLE_PAGES}


def test_every_marker_is_spelled_as_the_checker_reads_it():
    bad = [f"{page.relative_to(ROOT)}:{number}" for page in PAGES
           for number, line in enumerate(page.read_text().splitlines(), 1)
           if re.match(r"\s*<!--\s*(runnable|not run)", line)
           and not (runblocks.MARKER.match(line) or runblocks.NOT_RUN.match(line))]
    assert not bad, bad


def test_every_console_block_runs_or_says_why_not():
    unmarked = [f"{page.relative_to(ROOT)}:{line}" for page in PAGES for line in runblocks.unmarked_console_blocks(page)]
    assert not unmarked, f"console blocks neither runnable nor 'not run: REASON': {unmarked}"


def test_the_comparison_keeps_every_digit_but_times():
    shown = ["plan x.npz: 48 layers", "...", "mean gap 0.39%, worst gap 0.62%, status heuristic, 0.96 s"]
    assert runblocks.matches(shown, "plan x.npz: 48 layers\na\nb\nmean gap 0.39%, worst gap 0.62%, status heuristic, 12.50 s\n")
    assert runblocks.matches(shown, "plan x.npz: 48 layers\nmean gap 0.39%, worst gap 0.62%, status heuristic, 1.00 s\n")
    assert not runblocks.matches(shown, "plan x.npz: 48 layers\nmean gap 0.39%, worst gap 0.63%, status heuristic, 0.96 s\n")
    assert not runblocks.matches(shown, "plan x.npz: 47 layers\nmean gap 0.39%, worst gap 0.62%, status heuristic, 0.96 s\n")
    assert not runblocks.matches(shown, "plan x.npz: 48 layers\n")  # `...` is lines, not the end of the output
    table = ["solver    balancedness   wall_s  status", "eplb            0.8661     0.06  heuristic", "",
             "took 0.06"]
    assert runblocks.matches(table, "solver    balancedness   wall_s  status\neplb            0.8661    10.06  heuristic\n\n"
                                    "took 0.06\n")
    assert not runblocks.matches(table, "solver    balancedness   wall_s  status\neplb            0.8662     0.06  heuristic\n"
                                        "\ntook 0.06\n")
    assert not runblocks.matches(table, "solver    balancedness   wall_s  status\neplb            0.8661     0.06  heuristic\n"
                                        "\ntook 0.07\n")  # a number outside the column is no time


def test_a_page_that_shows_the_wrong_number_fails(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- runnable -->\n```console\n$ echo 'mean balancedness 0.9961'\nmean balancedness 0.9962\n```\n"
                    "<!-- runnable exit=2 -->\n```console\n$ exit 3\n```\n")
    problems = runblocks.check_page(page, tmp_path)
    assert len(problems) == 2 and "0.9962" in problems[0] and "exited 3, the page says 2" in problems[1]


# ------------------------------------------------------------------------------------- generated pages
@pytest.mark.parametrize("generator", [gen_results, gen_reference], ids=["results", "reference"])
def test_generated_pages_are_what_their_script_renders(generator):
    folder = "results" if generator is gen_results else "reference"
    differ, left = stale_pages(generator.render(), folder)
    assert not differ and not left, (f"run `python {generator.SCRIPT}`: {differ} differ, {left} are no longer "
                                     f"generated")


def test_every_record_has_a_results_page():
    pages = gen_results.render()
    for path in sorted((ROOT / "bench" / "results").iterdir()):
        if path.suffix != ".md":
            assert any(f"{gen_results.RECORD_LINK}{path.name})" in text for text in pages.values()), path.name


def test_the_api_reference_covers_every_module():
    from test_layout import _module_names

    documented = {name for _title, modules in gen_reference.API_PAGES.values() for name in modules}
    missing = {name for name in _module_names() if not name.startswith("moe_place.cli")} - documented
    assert not missing, f"add to docs/gen_reference.py API_PAGES: {sorted(missing)}"


def test_every_documented_module_declares_its_public_surface():
    """`__all__` on every module of the API reference: names that exist, and every public class and function
    the module defines among them (a new one is declared, or named with `_`); the pages show what it declares."""
    import inspect

    for name in sorted({name for _title, modules in gen_reference.API_PAGES.values() for name in modules}):
        module = importlib.import_module(name)
        assert hasattr(module, "__all__"), f"{name} declares no __all__"
        assert not [n for n in module.__all__ if not hasattr(module, n)
                    and importlib.util.find_spec(f"{name}.{n}") is None], name   # a name, or a package's module
        defined = {key for key, obj in vars(module).items() if not key.startswith("_")
                   and (inspect.isclass(obj) or inspect.isfunction(obj)) and obj.__module__ == name}
        undeclared = sorted(defined - set(module.__all__))
        assert not undeclared, f"{name}: public but not in __all__: {undeclared}"


def test_the_cli_reference_has_every_option_of_every_subcommand():
    from moe_place.cli.main import COMMANDS

    text = (DOCS / "reference" / "cli.md").read_text()
    for name in COMMANDS:
        section = text.split(f"## moe-place {name}\n", 1)[1].split("\n## ", 1)[0]
        for action in gen_reference._subcommand(name)._actions:
            for option in [] if action.dest == "help" else action.option_strings:
                assert f"`{option}`" in section, f"{name} {option}"


# ------------------------------------------------------------------------------------------ the README
def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)\n```", text, flags=re.S | re.M)


def test_readme_is_a_front_page():
    text = README.read_text()
    assert len(text.encode()) <= 15 * 1024, f"README.md is {len(text.encode())} bytes"
    first_screen = "\n".join(text.splitlines()[:24]).lower()
    for use in ("offline replica planning", "vllm and sglang plugins", "deepseek eplb drop-in",
                "offloaded serving with sglang-kt and llama.cpp", "gpu microbenchmark reports"):
        assert use in first_screen, use
    assert "![" in text and "bench/results/" in text.split("![", 1)[1].split(")", 1)[0]


def test_readme_has_its_two_commands_and_the_site_the_same():
    install, tests = _bash_blocks(README.read_text())
    assert "\n" not in install and "\n" not in tests
    assert "pip install -q torch==2.13.0 '.[solver]'" in install  # offload --stats-out and .pt files need torch
    assert "moe-place analyze traces/data/" in install and "moe-place plan traces/data/" in install
    assert tests.endswith("&& pytest -q") and "[kernels,test,solver,docs]" in tests
    assert tests in (ROOT / ".ci" / "run").read_text()
    assert _bash_blocks((DOCS / "index.md").read_text())[:2] == [install, tests]


def test_readme_headline_figures_are_on_the_pages_it_links():
    text = README.read_text()
    rows = text.split("## Headline results", 1)[1].split("\n## ", 1)[0]
    checked = 0
    for line in rows.splitlines():
        link = re.search(r"\[[^]]+\]\((docs/results/[\w-]+\.md)\)\s*\|$", line)
        if not link:
            continue
        result = line.split("|")[1]
        shown = (ROOT / link[1]).read_text()
        numbers = re.findall(r"-?\d+(?:\.\d+)?%?", re.sub(r"`[^`]*`|EP\d+(\+\d+)?|Kimi-K2|Qwen3|\d+\.\d+\.\d+|H200", "",
                                                          result))
        missing = [n for n in numbers if n not in shown]
        assert not missing, f"{link[1]} does not show {missing} ({result.strip()})"
        checked += 1
    assert checked >= 6


# ------------------------------------------------------------------------------------ task pages are how-tos
TASK_PAGE_WORDS = 1500


def words(text: str) -> int:
    """The words a reader reads on a page: every run of non-space characters that holds a letter or a digit, in
    prose, headings, table cells, commands and the blocks that show what a command prints (a reader reads those
    to recognise their own screen, so they count). Not counted: HTML comments (the runnable and figures markers,
    which the site does not show), code fences, link targets (the reader sees a link's text) and marks with no
    letter or digit (`|`, `---`, `...`, `$`, `#`)."""
    text = re.sub(r"<!--.*?-->", " ", text, flags=re.S)
    text = re.sub(r"^```.*$", " ", text, flags=re.M)
    text = re.sub(r"\]\([^)\s]*\)", "]", text)
    return sum(1 for token in text.split() if re.search(r"\w", token))


def _task_pages() -> list[Path]:
    """The pages README's "Documentation" section lists as tasks."""
    line = README.read_text().split("\n- Tasks:", 1)[1].split("\n- ", 1)[0]
    return [ROOT / link for link in re.findall(r"\]\((docs/[\w-]+\.md)\)", line)]


def test_the_word_count_reads_as_a_reader_does():
    page = ("# Plan\n\n<!-- runnable -->\n```console\n$ moe-place plan x.npz --out p.json\nwrote plan p.json\n"
            "...\n```\n| a | b |\n| --- | --- |\n| 0.97 | x |\n\nSee [the results](results/multinode.md#plan-time).\n")
    # Plan | moe-place plan x.npz --out p.json | wrote plan p.json | a b 0.97 x | See the results
    assert words(page) == 16


def test_readme_lists_every_task_page_of_the_site():
    nav = (ROOT / "mkdocs.yml").read_text().split("\n  - Tasks:\n", 1)[1].split("\n  - ", 1)[0]
    assert sorted(DOCS / name for name in re.findall(r": (\S+\.md)$", nav, flags=re.M)) == sorted(_task_pages())


@pytest.mark.parametrize("page", _task_pages(), ids=lambda page: page.name)
def test_task_pages_are_how_tos_of_at_most_1500_words(page):
    """A task page says what a thing is, the commands, what they print, the options that matter and its numbers
    in one table linked to its results page; history and long measurement notes go to docs/design/."""
    count = words(page.read_text())
    assert count <= TASK_PAGE_WORDS, (f"{page.relative_to(ROOT)} has {count} words (at most {TASK_PAGE_WORDS}): move "
                                      f"history and measurement notes to docs/design/, tables to docs/results/")


# --------------------------------------------------------------------------------- facts on every page
def _commands(text: str):
    """(line number, command) of each command line of a page: a line of a fenced block (with its backslash
    continuations), or an inline code span (which may wrap onto the next line)."""
    lines = text.splitlines()
    fenced, index = False, 0
    while index < len(lines):
        start, line = index, lines[index]
        if line.startswith("```"):
            fenced = not fenced
        elif fenced:
            while line.endswith("\\") and index + 1 < len(lines):
                index += 1
                line = line[:-1] + lines[index]
            yield start + 1, line
        index += 1
    for match in re.finditer(r"`([^`]+)`", "\n".join(line for line in lines if not line.startswith("```"))):
        yield 0, match[1].replace("\n", " ")


def test_commands_that_overwrite_a_committed_record_say_force():
    for page in PAGES:
        for number, command in _commands(page.read_text()):
            if re.search(r"--(out|output-json|plot|parts-out)\s+bench/results/", command):
                assert "--force" in command, f"{page.relative_to(ROOT)}:{number}: {command.strip()}"


def test_the_force_check_reads_wrapped_and_continued_commands():
    text = "see `python b.py --out bench/results/r.json\n--force` and\n```bash\npython b.py --out \\\n  bench/results/r.json\n```\n"
    assert [c for _, c in _commands(text) if "bench/results" in c] == [
        "python b.py --out   bench/results/r.json", "python b.py --out bench/results/r.json --force"]


def test_no_page_cites_a_file_the_repository_does_not_have():
    for page in PAGES:
        text = page.read_text()
        assert "SPEC.md" not in text, page  # the model is docs/MODEL.md
        for path in re.findall(r"`((?:bench|tests|traces|moe_place|solvers|kernels|docs)/[\w./-]+\.(?:py|sh|md|json|toml|png))`",
                               text):
            assert (ROOT / path).exists() or "<" in path, f"{page.relative_to(ROOT)}: {path}"


def test_the_task_pages_figures_are_rendered_from_the_records():
    # docs/vllm.md, sglang.md and online.md show their figures between markers; docs/gen_results.py renders them
    for name, text in gen_results.render_figures().items():
        assert (DOCS / name).read_text() == text, f"docs/{name}: its figures differ; run `python docs/gen_results.py`"
