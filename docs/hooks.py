"""MkDocs hook: the committed records of bench/results/ are part of the site, under records/.

Results pages link to the record each table comes from (`records/replay_vllm.json`) and show its plots
(`records/replay.png`); this puts those files into the site as they are in the checkout, so that the
links are checked by `mkdocs build --strict` like any other. Markdown files there are left out (a
record's report is rendered by docs/gen_results.py into a results page instead).
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

RECORDS = Path(__file__).resolve().parents[1] / "bench" / "results"


def on_files(files, config):  # noqa: D103 - MkDocs' hook
    for path in sorted(RECORDS.iterdir()):
        if path.is_file() and path.suffix != ".md":
            files.append(File.generated(config, f"records/{path.name}", abs_src_path=str(path)))
    return files
