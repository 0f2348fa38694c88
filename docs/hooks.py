"""MkDocs hook: the committed records of bench/results/ are part of the site, under records/.

Results pages link to the record each table comes from and show its plots with links relative to the page in
the repository (`../../bench/results/replay_vllm.json` from docs/results/), so that they resolve where the
pages are read on GitHub or in a checkout. The site has no bench/ folder: `on_files` puts those files into it
as they are in the checkout, under records/, and `on_page_markdown` points every link that resolves into
bench/results/ at that copy, so that `mkdocs build --strict` checks them like any other link. Markdown files
there are left out (a record's report is rendered by docs/gen_results.py into a results page instead).
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "bench" / "results"
SITE_FOLDER = "records"
LINK = re.compile(r"(\]\()([^)\s#]+)")  # a Markdown link's or image's target, up to an anchor or a title


def on_files(files, config):  # noqa: D103 - MkDocs' hook
    for path in sorted(RECORDS.iterdir()):
        if path.is_file() and path.suffix != ".md":
            files.append(File.generated(config, f"{SITE_FOLDER}/{path.name}", abs_src_path=str(path)))
    return files


def on_page_markdown(markdown, page, config, files):  # noqa: D103 - MkDocs' hook
    return site_links(markdown, page.file.src_uri)


def site_links(markdown: str, src_uri: str) -> str:
    """`markdown` of the page docs/`src_uri` with each relative link into bench/results/ pointed at records/."""
    folder = posixpath.dirname(src_uri)

    def repoint(match: re.Match) -> str:
        target = match.group(2)
        if "://" in target or target.startswith(("/", "mailto:")):
            return match.group(0)
        in_repo = posixpath.normpath(posixpath.join("docs", folder, target))
        if posixpath.dirname(in_repo) != "bench/results":
            return match.group(0)
        site = posixpath.relpath(f"{SITE_FOLDER}/{posixpath.basename(in_repo)}", folder or ".")
        return match.group(1) + site

    return LINK.sub(repoint, markdown)
