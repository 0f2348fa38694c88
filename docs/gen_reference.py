"""The reference pages, generated: the CLI from its argparse parsers, the Python API from the docstrings.

    python docs/gen_reference.py [--check]

writes docs/reference/cli.md (every subcommand of `moe_place.cli.main.build_parser`, every option with its
help as `moe-place CMD --help` gives it), docs/reference/formats.md (the file formats, from the docstrings
of the modules that read and write them) and docs/reference/api/*.md (each module's docstring, then its
public classes and functions with their signatures and docstrings, in source order), and docs/glossary.md
(`moe_place.glossary.TERMS`, each term with its other spellings, `ALIASES`). Nothing here is typed by hand:
change the parser, the docstring or the glossary, then rerun this. The one machine-dependent figure in
the help texts, the usable core count of `--jobs`, is written as `N`.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pagegen import DOCS, GENERATED_NOTE, write_or_check  # noqa: E402 - the docs' own helper, beside this file

from moe_place.cli.main import COMMANDS, build_parser  # noqa: E402
from moe_place.cores import usable_cores  # noqa: E402
from moe_place.glossary import ALIASES, TERMS  # noqa: E402

SCRIPT = "docs/gen_reference.py"

# The Python API, one page per part of the package (the layers of docs/develop.md, lowest first).
API_PAGES = {
    "basics": ("Vocabulary, errors, files", ["moe_place", "moe_place.glossary", "moe_place.errors", "moe_place.io",
                                              "moe_place.progress", "moe_place.interrupts", "moe_place.cores",
                                              "moe_place.plotting"]),
    "traces": ("Traces", ["moe_place.traces", "moe_place.traces.model", "moe_place.traces.load",
                          "moe_place.traces.npz", "moe_place.traces.npz_member", "moe_place.traces.count", "moe_place.traces.stream",
                          "moe_place.traces.sample", "moe_place.traces.sglang", "moe_place.traces.vllm",
                          "moe_place.traces.torchfile", "moe_place.traces.text", "moe_place.traces.physical",
                          "moe_place.traces.content", "moe_place.traces.bundled", "moe_place.traces.synthetic",
                          "moe_place.traces.trtllm", "moe_place.traces.safetensors_file",
                          "moe_place.traces.vllm_routed", "moe_place.traces.megatron", "moe_place.traces.jsonl"]),
    "placement": ("Placements and plan files", ["moe_place.placement", "moe_place.planfile", "moe_place.split",
                                                "moe_place.problem"]),
    "analysis": ("Analysis", ["moe_place.analysis", "moe_place.analysis.profile", "moe_place.analysis.balance", "moe_place.analysis.active",
                              "moe_place.analysis.persistence", "moe_place.analysis.coactivation",
                              "moe_place.analysis.windows", "moe_place.analysis.ep_sweep",
                              "moe_place.analysis.out_of_sample", "moe_place.analysis.replicate_hottest",
                              "moe_place.analysis.dispatch",
                              "moe_place.analysis.report", "moe_place.analysis.imbalance", "moe_place.analysis.plot"]),
    "cost": ("Cost model", ["moe_place.cost", "moe_place.cost.units", "moe_place.cost.hardware", "moe_place.cost.models",
                            "moe_place.cost.model_layers", "moe_place.cost.expected_traffic", "moe_place.cost.topology",
                            "moe_place.cost.gemm", "moe_place.cost.gemm_profile",
                            "moe_place.cost.traffic", "moe_place.cost.cluster", "moe_place.cost.comm",
                            "moe_place.cost.replicas", "moe_place.cost.pipeline", "moe_place.cost.migration",
                            "moe_place.cost.payback", "moe_place.cost.offload", "moe_place.cost.scenario",
                            "moe_place.cost.files", "moe_place.cost.report", "moe_place.cost.plot"]),
    "solvers": ("Solvers", ["moe_place.solvers", "moe_place.solvers.base", "moe_place.solvers.deepseek",
                            "moe_place.solvers.hierarchical", "moe_place.solvers.quick", "moe_place.solvers.fast",
                            "moe_place.solvers.cpsat", "moe_place.solvers.bounds",
                            "moe_place.solvers.budget", "moe_place.solvers.evaluate", "moe_place.solvers.comm",
                            "moe_place.solvers.comm.tokens", "moe_place.solvers.comm.node_split",
                            "moe_place.solvers.comm.grouping", "moe_place.solvers.comm.replicas", "moe_place.solvers.comm.gpus",
                            "moe_place.solvers.comm.bounds", "moe_place.solvers.comm.decision", "moe_place.solvers.comm.planner",
                            "moe_place.solvers.sizing", "moe_place.solvers.split_placement", "moe_place.solvers.offload", "moe_place.solvers.offload_rules",
                            "moe_place.solvers.offload_compare", "moe_place.solvers.engine_call",
                            "moe_place.solvers.trtllm", "moe_place.solvers.plot"]),
    "kernels": ("Kernels", ["moe_place.kernels", "moe_place.kernels.align", "moe_place.kernels.grouped_gemm",
                            "moe_place.kernels.dispatch", "moe_place.kernels.combine", "moe_place.kernels.split",
                            "moe_place.kernels.alltoall", "moe_place.kernels.aot", "moe_place.kernels.report"]),
    "online": ("Online", ["moe_place.online", "moe_place.online.window", "moe_place.online.estimate",
                          "moe_place.online.policy", "moe_place.online.policy_cpu", "moe_place.online.engine_default",
                          "moe_place.online.switch", "moe_place.online.splitting", "moe_place.online.controller",
                          "moe_place.online.replay", "moe_place.online.cadence", "moe_place.online.offload",
                          "moe_place.online.plot"]),
    "engines": ("Engines and the EPLB drop-in", ["moe_place.eplb", "moe_place.engines", "moe_place.engines.vllm",
                                                 "moe_place.engines.vllm_policy",
                                                 "moe_place.engines.sglang", "moe_place.engines.sglang_startup",
                                                 "moe_place.engines.sglang_managers", "moe_place.engines.config",
                                                 "moe_place.engines.session", "moe_place.engines.tensors",
                                                 "moe_place.engines.launch", "moe_place.engines.guard",
                                                 "moe_place.engines.batch_split", "moe_place.engines.vllm_split",
                                                 "moe_place.engines.sglang_split",
                                                 "moe_place.engines.export", "moe_place.engines.trtllm", "moe_place.engines.sglang_kt",
                                                 "moe_place.engines.llama_cpp"]),
}


def cell(text: str) -> str:
    """Text for one cell of a markdown table: one line, `|` escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def _machine_free(text: str) -> str:
    """Help text with this machine's usable core count written as N."""
    return text.replace(f"({usable_cores()} here", "(N here")


def _option_cell(action: argparse.Action) -> str:
    names = ", ".join(f"`{name}`" for name in action.option_strings) or f"`{action.metavar or action.dest}`"
    return names


def _value_cell(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    if action.choices is not None and not action.option_strings and action.metavar is None:
        return ""
    if action.choices is not None and action.metavar is None:
        return " \\| ".join(f"`{choice}`" for choice in action.choices)
    if not action.option_strings:
        return ""
    return f"`{action.metavar or action.dest.upper()}`"


def _help_cell(formatter: argparse.HelpFormatter, action: argparse.Action) -> str:
    text = formatter._expand_help(action) if action.help else ""
    if action.required and action.option_strings:
        text = f"**required.** {text}"
    return cell(_machine_free(text))


def _subcommand(name: str) -> argparse.ArgumentParser:
    return build_parser(name)._subparsers._group_actions[0].choices[name]


def _option_tables(parser: argparse.ArgumentParser) -> list[str]:
    formatter = parser._get_formatter()
    lines = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if not isinstance(a, argparse._HelpAction)]
        if not actions:
            continue
        lines += ["", f"**{group.title}**", "", "| option | value | what it does |", "| --- | --- | --- |"]
        lines += [f"| {_option_cell(a)} | {_value_cell(a)} | {_help_cell(formatter, a)} |" for a in actions]
    exclusive = [" / ".join(f"`{a.option_strings[0]}`" for a in g._group_actions) for g in parser._mutually_exclusive_groups]
    if exclusive:
        lines += ["", "Not together: " + "; ".join(exclusive) + "."]
    return lines


def cli_page() -> str:
    top = build_parser()
    choices = top._subparsers._group_actions[0]
    helps = {action.dest: action.help for action in choices._choices_actions}
    lines = [GENERATED_NOTE.format(script=SCRIPT).rstrip("\n"), "", "# Command line: `moe-place`", "",
             cell(top.description), "", "`moe-place --version` prints the version; `moe-place CMD --help` prints what "
             "this page shows for `CMD`. Exit codes and error lines: [Errors and exit codes](../errors.md).", "",
             "| command | what it does |", "| --- | --- |"]
    lines += [f"| [`{name}`](#moe-place-{name}) | {cell(helps[name])} |" for name in COMMANDS]
    for name in COMMANDS:
        parser = _subcommand(name)
        lines += ["", f"## moe-place {name}", "", cell(_machine_free(parser.description or "")) + "."
                  if not (parser.description or "").endswith(".") else cell(parser.description)]
        lines += _option_tables(parser)
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- the API
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")


class _Shown:
    """An annotation or default as the signature should show it: its text, without quotes or an address."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _shown(value):
    if value is inspect.Parameter.empty:
        return value
    if isinstance(value, str):  # an annotation under `from __future__ import annotations`
        return _Shown(value)
    if inspect.isfunction(value) or inspect.isclass(value):  # a default such as a sort order
        return _Shown(value.__qualname__)
    return value


def _signature(obj) -> str:
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):  # a builtin or a class without one
        return "(...)"
    parameters = [p.replace(annotation=_shown(p.annotation),
                            default=p.default if isinstance(p.default, str) else _shown(p.default))
                  for p in signature.parameters.values()]
    returned = inspect.Signature.empty if inspect.isclass(obj) else _shown(signature.return_annotation)
    text = str(signature.replace(parameters=parameters, return_annotation=returned))
    assert not _ADDRESS.search(text), f"{obj.__qualname__}: a default shows a memory address: {text}"
    return text


_ENTRY = re.compile(r"^[\w.*`\[\]]+(?:\s*[/,]\s*[\w.*`\[\]]+)*: ")  # "name: what it is" (or "a / b: ...")
_UNDERLINE = re.compile(r"^(-{3,}|={3,})$")  # a reST-style section title's underline
_ITEM = re.compile(r"^(- |\d+\. )")


def _markdown(doc: str | None) -> str:
    """A docstring as markdown, its lines kept: the project writes them with `code` spans, `name: meaning`
    entries, `- ` lists and indented examples. An entry or list item starts a line of its own (markdown
    would run it into the line before), an indented block after a blank line stays code, and what markdown
    would misread is escaped: a line opening with `#` (a heading) and `<` outside code spans (a tag)."""
    if not doc:
        return "*(no docstring)*"
    out: list[str] = []
    in_code = False
    for line in inspect.cleandoc(doc).splitlines():
        if not line.strip():
            out.append("")
            continue
        if line.startswith("    ") and (in_code or not out or not out[-1]):
            in_code = True
            out.append(line)
            continue
        in_code = False
        if _UNDERLINE.match(line.strip()) and out and out[-1]:  # "Idea\n----": a title, bold (not a page heading)
            out[-1] = f"**{out[-1].rstrip()}**  "
            continue
        parts = line.split("`")
        text = "`".join(part if index % 2 else part.replace("<", "&lt;") for index, part in enumerate(parts))
        text = "\\" + text if text.lstrip().startswith("#") else text
        if out and out[-1] and _ITEM.match(text) and not _ITEM.match(out[-1].lstrip()):
            out.append("")  # a list needs a blank line before it
        elif out and out[-1] and _ENTRY.match(text):
            out[-1] += "  "  # a hard break: the entry starts its own line
        out.append(text)
    return "\n".join(out)


def _own_members(module) -> list[tuple[str, object]]:
    """The classes and functions of the module's declared surface (`__all__`) defined in it."""
    members = []
    for name in module.__all__:
        obj = getattr(module, name, None)   # None: a package's module, documented in its own section
        if (inspect.isclass(obj) or inspect.isfunction(obj)) and getattr(obj, "__module__", None) == module.__name__:
            members.append((name, obj))
    return sorted(members, key=lambda item: inspect.getsourcelines(item[1])[1])


def _methods(cls) -> list[tuple[str, object, str]]:
    found = []
    for name, raw in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(raw, property):
            found.append((name, raw.fget, "property"))
        elif isinstance(raw, (classmethod, staticmethod)):
            found.append((name, raw.__func__, type(raw).__name__))
        elif inspect.isfunction(raw):
            found.append((name, raw, "method"))
    return sorted(found, key=lambda item: inspect.getsourcelines(item[1])[1])


def _module_section(name: str) -> list[str]:
    module = importlib.import_module(name)
    lines = ["", f"## `{name}`", "", _markdown(module.__doc__)]
    for member, obj in _own_members(module):
        kind = "class" if inspect.isclass(obj) else "def"
        lines += ["", f"### `{name}.{member}`", "", f"```python\n{kind} {member}{_signature(obj)}\n```", "",
                  _markdown(obj.__doc__ if inspect.isclass(obj) or obj.__doc__ else None)]
        if inspect.isclass(obj):
            for method, function, how in _methods(obj):
                shown = "" if how == "property" else _signature(function)
                lines += ["", f"#### `{member}.{method}`" + (" *(property)*" if how == "property" else ""), ""]
                if shown:
                    lines += [f"```python\n{'@' + how + chr(10) if how != 'method' else ''}def {method}{shown}\n```", ""]
                lines.append(_markdown(function.__doc__))
    return lines


def api_pages() -> dict[str, str]:
    pages = {}
    index = [GENERATED_NOTE.format(script=SCRIPT).rstrip("\n"), "", "# Python API", "",
             "Every module of the package, with its docstring and its public classes and functions (those "
             "its `__all__` declares), from the code itself. One import root: `moe_place`. The "
             "layers, lowest first (a module imports only from its own layer or lower ones):", "",
             "| page | modules |", "| --- | --- |"]
    for slug, (title, modules) in API_PAGES.items():
        index.append(f"| [{title}]({slug}.md) | {', '.join(f'`{m}`' for m in modules)} |")
        lines = [GENERATED_NOTE.format(script=SCRIPT).rstrip("\n"), "", f"# {title}"]
        for module in modules:
            lines += _module_section(module)
        pages[f"reference/api/{slug}.md"] = "\n".join(lines) + "\n"
    pages["reference/api/index.md"] = "\n".join(index) + "\n"
    return pages


# The file formats: each section is the docstring of the module that owns the format.
FORMATS = [
    ("Plan file", "moe_place.planfile", "What `plan` writes and every engine adapter reads."),
    ("Trace files", "moe_place.traces.load", "What every `TRACE` argument and `load_trace(path)` read."),
    ("Our `.npz` trace", "moe_place.traces.npz", ""),
    ("SGLang recorder dumps", "moe_place.traces.sglang", ""),
    ("vLLM load windows", "moe_place.traces.vllm", ""),
    ("CSV and JSON counts", "moe_place.traces.text", ""),
    ("TensorRT-LLM expert statistics", "moe_place.traces.trtllm", "A folder, read as a trace."),
    ("vLLM routed experts", "moe_place.traces.vllm_routed", "JSON Lines of responses, read as a trace."),
    ("Megatron router trace", "moe_place.traces.megatron", "A rank file or the folder of them, read as a trace."),
    ("The bundled traces", "moe_place.traces.bundled", ""),
    ("TensorRT-LLM load balancer", "moe_place.engines.trtllm", "What `export --engine trtllm` writes."),
    ("Rule settings", "moe_place.engines.config", "The settings of the rule inside vLLM and SGLang."),
    ("Scenario files", "moe_place.cost.scenario", "What `predict` and `payback` read; the keys follow."),
]


def formats_page() -> str:
    lines = [GENERATED_NOTE.format(script=SCRIPT).rstrip("\n"), "", "# Files", "",
             "Each section is the docstring of the module that reads and writes the format, so it says what "
             "the code does. The committed benchmark records are listed, each with the command that wrote "
             "it, on [Results](../results/index.md)."]
    for title, name, intro in FORMATS:
        module = importlib.import_module(name)
        lines += ["", f"## {title}", "", f"`{name}`" + (f": {intro}" if intro else "")]
        lines += ["", _markdown(module.__doc__)]
        if name == "moe_place.cost.scenario":
            lines += ["", "```toml", module.SCHEMA.rstrip("\n"), "```"]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------ the glossary
GLOSSARY = "glossary.md"  # beside the task pages, not in reference/: written by `_write_or_check_glossary`


def glossary_page() -> str:
    """docs/glossary.md: every term of `moe_place.glossary.TERMS`, alphabetically, its aliases beside it."""
    spellings: dict[str, list[str]] = {}
    for alias, term in ALIASES.items():
        spellings.setdefault(term, []).append(f"`{alias}`")
    lines = [GENERATED_NOTE.format(script=SCRIPT).rstrip("\n"), "", "# Glossary", "",
             "The words of the code, the engines and the commands' tables, defined once in "
             "`moe_place/glossary.py` ([API](reference/api/basics.md)). Other spellings follow a term in brackets; "
             "in a printed name `n` stands for a number (`EP8` is EP`n`).", "",
             "| term | meaning |", "| --- | --- |"]
    for term in sorted(TERMS, key=lambda t: t.replace("`", "").lower()):
        shown = term + (f" ({', '.join(spellings[term])})" if term in spellings else "")
        lines.append(f"| {cell(shown)} | {cell(TERMS[term])} |")
    return "\n".join(lines) + "\n"


def reference_pages() -> dict[str, str]:
    return {"reference/cli.md": cli_page(), "reference/formats.md": formats_page(), **api_pages()}


def render() -> dict[str, str]:
    """Every page this script generates, paths under docs/ (tests/test_docs.py checks them all)."""
    return {**reference_pages(), GLOSSARY: glossary_page()}


def _write_or_check_glossary(check: bool) -> int:
    text, path = glossary_page(), DOCS / GLOSSARY
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return 0
    if check:
        print(f"{SCRIPT}: docs/{GLOSSARY} is not what the generator renders: run `python {SCRIPT}`", file=sys.stderr)
        return 1
    path.write_text(text, encoding="utf-8")
    print(f"wrote docs/{GLOSSARY}")
    return 0


if __name__ == "__main__":
    code = write_or_check(SCRIPT, "reference", reference_pages)  # parses --check (and refuses anything else)
    sys.exit(max(code, _write_or_check_glossary("--check" in sys.argv[1:])))
