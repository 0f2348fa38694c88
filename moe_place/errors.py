"""User-facing errors.

`InputError` is raised for anything a user can get wrong (a file, a field, an option).
The CLI prints it as one line on stderr and exits with status 2. Internal invariants use
`assert`; a failed assert is a bug in moe-place, not in the input.
"""

from __future__ import annotations

import difflib

__all__ = ["InfeasibleError", "InputError", "MoePlaceError", "ParameterError", "check_keys", "check_registry"]


class MoePlaceError(Exception):
    """Base class of the errors moe-place reports to users."""


class InputError(MoePlaceError, ValueError):
    """Bad input: names where it is (file, field or option) and what was expected.

    >>> str(InputError("trace.npz: topk_ids", "expert ids in [0, 128)", "255"))
    'trace.npz: topk_ids: expected expert ids in [0, 128), got 255'
    """

    def __init__(self, where: str, expected: str, got: object | None = None):
        self.where = where
        self.expected = expected
        self.got = got
        message = f"{where}: expected {expected}"
        if got is not None:
            message += f", got {got}"
        super().__init__(message)

    def __reduce__(self):
        # an error raised in a worker process (solve(jobs=N), the benches' --jobs) must unpickle in the parent
        return type(self), (self.where, self.expected, self.got)


class ParameterError(InputError, AssertionError):
    """A bad argument of an engine-compatible signature (DeepSeek EPLB's `rebalance_experts`, a vLLM
    EPLB policy): an `InputError` with the same one-line text, that is also an `AssertionError`.

    The originals check these arguments with `assert`, and engine code catches `AssertionError`
    (vLLM's `test_parameter_validation` expects it for `num_replicas` not a multiple of the GPUs),
    so a drop-in must raise one; the CLI and library callers still catch it as an `InputError`.
    """


class InfeasibleError(MoePlaceError):
    """The request cannot be met (a budget too small, a replica that does not fit)."""


def check_keys(table: dict, known, where: str) -> None:
    """InputError for the first key of `table` (sorted) not in `known`, naming the closest known one:
    a misspelled key (`micro_batchez`) must not leave its default in force silently. The error names
    `where.key`, or `where key` when `where` ends with a colon (a file's top level: "f.toml:").

    >>> try:
    ...     check_keys({"micro_batchez": 4}, ("micro_batches", "breakeven"), "s.toml: pipeline")
    ... except InputError as exc:
    ...     print(exc)
    s.toml: pipeline.micro_batchez: expected one of the keys breakeven, micro_batches (did you mean micro_batches?), got an unknown key
    """
    unknown = sorted(str(key) for key in table if key not in known)
    if unknown:
        closest = difflib.get_close_matches(unknown[0], [str(k) for k in known], n=1, cutoff=0.6)
        hint = f" (did you mean {closest[0]}?)" if closest else ""
        field = f"{where} {unknown[0]}" if where.endswith(":") else f"{where}.{unknown[0]}"
        raise InputError(field, f"one of the keys {', '.join(sorted(known))}{hint}", "an unknown key")


def check_registry(what: str, registered, offered) -> None:
    """ImportError unless the names a registry holds and the option list that offers them agree (the CLI
    declares its lists without importing the library, for a fast `--help`; the modules that join the two
    check them at import, as vLLM checks its policy registry)."""
    if sorted(registered) != sorted(offered):
        raise ImportError(f"{what}: the registry holds {sorted(registered)}, the options offer {sorted(offered)}")
