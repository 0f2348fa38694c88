"""moe-place: place Mixture-of-Experts replicas so the busiest GPU waits less.

Layers (each imports only the ones before it):
    errors, glossary -> traces -> placement -> analysis -> cost -> problem -> solvers
    -> kernels, online -> engines (and the EPLB drop-in) -> cli
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

import os
import sys
from importlib.machinery import PathFinder  # importlib.abc and importlib.util would add ~40 ms to every start

__all__ = ["__version__"]

__version__ = "0.1.0"

MAPPED_FOLDERS = ("kernels", "solvers", "traces")  # top-level folders that install as moe_place.<name>


class _CheckoutFolders:
    """A meta path finder for `moe_place.<name>`, the `MAPPED_FOLDERS`, in a source checkout's top level.

    Asked only after the package's own path gave nothing; answers for those three names alone
    (their submodules then resolve through the package's `__path__`, as for any package).
    """

    def __init__(self, root: str, names: tuple[str, ...]):
        self.root = root
        self.names = names

    def find_spec(self, fullname, path=None, target=None):  # noqa: D102 - importlib's hook
        if fullname not in self.names:
            return None
        return PathFinder.find_spec(fullname, [self.root])  # the folder named like the last part of the name


def _checkout_folders() -> tuple[str, tuple[str, ...]]:
    """(the checkout's top folder, the `moe_place.<name>` it must provide) for a package imported from a
    source checkout (the folder beside a pyproject.toml) whose mapped folders are not inside it;
    no names for an installed package."""
    package = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(package)
    if not os.path.isfile(os.path.join(root, "pyproject.toml")):
        return root, ()
    return root, tuple(f"{__name__}.{name}" for name in MAPPED_FOLDERS
                       if not os.path.isdir(os.path.join(package, name))
                       and os.path.isfile(os.path.join(root, name, "__init__.py")))


def _add_checkout_finder() -> None:
    root, names = _checkout_folders()
    known = any(getattr(finder, "names", None) == names and getattr(finder, "root", None) == root
                for finder in sys.meta_path)
    if names and not known:
        sys.meta_path.append(_CheckoutFolders(root, names))


_add_checkout_finder()
