"""moe-place: place Mixture-of-Experts replicas so the busiest GPU waits less.

Layers (each imports only the ones before it):
    errors, glossary -> traces -> placement -> analysis -> cost -> problem -> solvers
    -> kernels, engines, online -> cli
See `moe_place.glossary` for the vocabulary.

The checkout's top-level folders `kernels/`, `solvers/` and `traces/` install as
`moe_place.kernels`, `moe_place.solvers` and `moe_place.traces` (the `package-dir` mapping of
pyproject.toml). Run from a source checkout - Python started in it, where its `moe_place/`
comes first on `sys.path` and shadows any installed copy - there is no such mapping, so this
module adds one finder for those three names, pointing at the checkout's folders. Installed
(pip, editable or not) or linked by `bench/engine_overlay.sh`, the folders are where the mapping
put them and nothing is added.
"""

from __future__ import annotations

import sys
from importlib.abc import MetaPathFinder
from importlib.util import spec_from_file_location
from pathlib import Path

__version__ = "0.1.0"

MAPPED_FOLDERS = ("kernels", "solvers", "traces")  # top-level folders that install as moe_place.<name>


class _CheckoutFolders(MetaPathFinder):
    """Finds `moe_place.<name>` for the `MAPPED_FOLDERS` in a source checkout's top-level folders.

    Asked only after the package's own path gave nothing; answers for those three names alone
    (their submodules then resolve through the package's `__path__`, as for any package).
    """

    def __init__(self, folders: dict[str, Path]):
        self.folders = folders

    def find_spec(self, fullname, path=None, target=None):  # noqa: D102 - importlib's hook
        folder = self.folders.get(fullname)
        if folder is None:
            return None
        return spec_from_file_location(fullname, folder / "__init__.py", submodule_search_locations=[str(folder)])


def _checkout_folders() -> dict[str, Path]:
    """{moe_place.<name>: folder} for a package imported from a source checkout (the folder beside a
    pyproject.toml) whose mapped folders are not inside it; {} for an installed package."""
    package = Path(__file__).parent
    root = package.parent
    if not (root / "pyproject.toml").is_file():
        return {}
    return {f"{__name__}.{name}": root / name for name in MAPPED_FOLDERS
            if not (package / name).is_dir() and (root / name / "__init__.py").is_file()}


def _add_checkout_finder() -> None:
    folders = _checkout_folders()
    if folders and not any(getattr(finder, "folders", None) == folders for finder in sys.meta_path):
        sys.meta_path.append(_CheckoutFolders(folders))


_add_checkout_finder()
