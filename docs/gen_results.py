"""The results pages, generated: every table of docs/results/ from the committed records in bench/results/.

    python docs/gen_results.py [--check]

Nothing on those pages is typed by hand: each table and each figure in their sentences is computed here
from a record, and each page names the records it reads and the commands that wrote them (`RECORDS`).
After re-measuring (a benchmark's `--out bench/results/... --force`), rerun this and commit both;
tests/test_docs.py fails while a page differs from what this renders. A record whose shape this does not
know is an error naming it: teach the page its new shape. Each page's code is in docs/results_pages/ (a module
per page or close group of pages; what they share, `RECORDS` among it, in common.py); this assembles them.
"""

from __future__ import annotations

import fnmatch
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pagegen import GENERATED_NOTE, write_or_check  # noqa: E402 - the docs' own helper, beside this file
from results_pages import engines, gpu, multinode, offload, planning, split  # noqa: E402 - the pages, beside it
from results_pages.common import RECORD_LINK, RECORDS, RESULTS, SCRIPT, TITLES, RecordError, table  # noqa: E402
from results_pages.figures import figure_regions, render_figures, write_or_check_figures  # noqa: E402, F401

PAGES = {"plan-quality": planning.plan_quality, "sizing": planning.sizing, "scale": planning.scale,
         "dropin": planning.dropin, "windows": planning.windows, "throughput": planning.throughput,
         "engines": engines.engines, "replay": engines.replay, "multinode": multinode.multinode,
         "offload": offload.offload, "gpu": gpu.gpu, "split": split.split, "split-placement": split.split_placement,
         "calibration": multinode.calibration}


def index() -> str:
    rows = []
    for path in sorted(RESULTS.iterdir()):
        if path.suffix == ".md" or not path.is_file():
            continue
        pattern = next((p for p in RECORDS if fnmatch.fnmatch(path.name, p)), None)
        if pattern is None and path.suffix in (".png", ".log"):
            owner = next((p for p in RECORDS if p.endswith("Z.json") and fnmatch.fnmatch(
                re.sub(r"(_[a-z_]+)?\.(png|log)$", ".json", path.name), p)), None)
            pattern = owner
        if pattern is None:
            raise RecordError(f"bench/results/{path.name}: a record no results page reads (add it to RECORDS in "
                              "docs/results_pages/common.py)")
        command, slug = RECORDS[pattern]
        rows.append([f"[`{path.name}`]({RECORD_LINK}{path.name})", f"[{TITLES[slug]}]({slug}.md)", f"`{command}`"])
    return "\n".join([GENERATED_NOTE.format(script=SCRIPT).rstrip("\n"), "", "# Results", "",
                      "Every table on these pages is rendered by `docs/gen_results.py` from a committed record in "
                      "`bench/results/`, and the tests check that each page is what the script renders from the "
                      "records. The commands say `--force` where they overwrite a committed record: without it, "
                      "every benchmark keeps an existing file.", "",
                      table(["record", "page", "written by"], rows)]) + "\n"


def render() -> dict[str, str]:
    pages = {f"results/{slug}.md": build() for slug, build in PAGES.items()}
    pages["results/index.md"] = index()
    return pages


if __name__ == "__main__":
    try:
        code = write_or_check(SCRIPT, "results", render)
        sys.exit(write_or_check_figures() or code)
    except RecordError as exc:
        sys.exit(f"{SCRIPT}: error: {exc}")
