"""MkDocs hook: the parts of the site that come from the code and the result files, generated at build time so
that nothing is typed twice.

A page asks for a generated block with a marker on a line of its own:

    <!-- marlhf:config marlhf.trainers.ppo_config:PPOConfig -->   the config's fields: name, type, default, help,
                                                                  grouped by HELP_SECTIONS
    <!-- marlhf:plugins -->                                       every registered plug-in of every kind, with its
                                                                  options and traits
    <!-- marlhf:help ppo -->                                      `marlhf ppo --help`
    <!-- marlhf:include benchmarks/results/x/summary.md -->       a Markdown file of the repository, its headings
                                                                  one level down (a note when it does not exist yet)
    <!-- marlhf:file configs/accelerate/ddp.yaml yaml -->         a file of the repository as a code block
    <!-- marlhf:section benchmarks/README.md#Measured figures -->  the text under a heading of a Markdown file, up
                                                                  to the next heading (links into the repository
                                                                  made to work on the site)
    <!-- marlhf:paragraph README.md#**Reliability.** -->          the paragraph that starts with the given text
    <!-- marlhf:docstring marlhf.checkpoint -->                   a module's docstring as a code block

The figures of the studies (benchmarks/results/<study>/*.png) are served as studies/figures/<study>/<name>.png
without being copied into docs/.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import re
import types
import typing
from importlib import import_module
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^<!-- marlhf:(\w+) (.*?) ?-->$", re.MULTILINE)
HELP_WIDTH = "100"  # argparse reads $COLUMNS: --help text wrapped the same on every machine


def on_files(files, config):
    for png in sorted((ROOT / "benchmarks" / "results").glob("*/*.png")):
        uri = f"studies/figures/{png.parent.name}/{png.name}"
        files.append(File.generated(config, uri, abs_src_path=str(png)))
    return files


def on_page_markdown(markdown, page, config, files):
    return MARKER.sub(lambda match: _expand(match.group(1), match.group(2).strip(), page), markdown)


def _expand(kind: str, argument: str, page) -> str:
    depth = page.file.src_uri.count("/")
    if kind in ("section", "paragraph"):
        path, _, start = argument.partition("#")
        text = (ROOT / path).read_text()
        return repo_links(section(text, start) if kind == "section" else paragraph(text, start), depth,
                          base=os.path.dirname(path))
    if kind == "config":
        return config_reference(_load(argument))
    if kind == "plugins":
        return plugin_reference()
    if kind == "help":
        return command_help(argument)
    if kind == "include":
        return include(argument, depth)
    if kind == "docstring":
        return f"```text\n{inspect.getdoc(import_module(argument)).rstrip()}\n```"
    if kind == "file":
        path, _, language = argument.partition(" ")
        return f"```{language or 'text'}\n{(ROOT / path).read_text().rstrip()}\n```"
    raise ValueError(f"{page.file.src_uri}: unknown marlhf marker {kind!r}")


def _load(spec: str):
    module, _, name = spec.partition(":")
    return getattr(import_module(module), name)


# --- configuration -------------------------------------------------------------------------------------------

def format_type(hint) -> str:
    """A type hint as a user writes it: `int | None`, `"a" | "b"`, `tuple[int, ...]`."""
    origin = typing.get_origin(hint)
    if hint is type(None):
        return "None"
    if origin is typing.Literal:
        return " | ".join(repr(value) for value in typing.get_args(hint))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(format_type(arg) for arg in typing.get_args(hint))
    if origin is not None:
        args = typing.get_args(hint)
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join('...' if a is Ellipsis else format_type(a) for a in args)}]"
    return getattr(hint, "__name__", str(hint).replace("typing.", ""))


def _cell(text: str) -> str:
    """Text for one Markdown table cell: bars outside code spans escaped (inside them they are kept), one line."""
    parts = re.split(r"(`+[^`]*`+)", text.replace("\n", " "))
    return "".join(part if part.startswith("`") else part.replace("|", r"\|") for part in parts)


def _code(text: str) -> str:
    return f"`{text}`" if "`" not in text else f"`` {text} ``"


def _field_rows(cls, names, prefix: str | None = None) -> list[str]:
    """A table of the dataclass `cls`'s fields `names`; each row's anchor is `<prefix>-<name>` (prefix: the class's
    name in lower case)."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    rows = ["| option | type | default | meaning |", "|---|---|---|---|"]
    for name in names:
        f = fields[name]
        default = f.default if f.default is not dataclasses.MISSING else "(required)"
        anchor = f"{prefix or cls.__name__.lower()}-{name}"
        rows.append(f"| <span id=\"{anchor}\"></span>`{name}` | {_cell(_code(format_type(hints[name])))} | "
                    f"{_cell(_code(repr(default)))} | {_cell(f.metadata.get('help', ''))} |")
    return rows


def config_reference(cls) -> str:
    """The fields of a config dataclass as tables, by HELP_SECTIONS (the fields in no section first)."""
    sections = dict(getattr(cls, "HELP_SECTIONS", {}) or {})
    in_sections = {name for names in sections.values() for name in names}
    rest = [f.name for f in dataclasses.fields(cls) if f.name not in in_sections]
    doc = inspect.getdoc(cls) or ""
    lines = [f"`{cls.__module__}.{cls.__name__}`: {doc}", ""]
    groups = ([("general", rest)] if rest else []) + list(sections.items())
    blocks = getattr(import_module(cls.__module__), "BLOCKS", {})  # PPOConfig's option blocks of no plug-in kind
    for title, names in groups:
        if len(groups) > 1:
            lines += [f"**{title}**", ""]
        lines += _field_rows(cls, names) + [""]
        for kind in [name.removesuffix("_options") for name in names if name.removesuffix("_options") in blocks]:
            options = blocks[kind]
            lines += [f"`{kind}_options` (`{options.__module__}.{options.__name__}`; each also a flat flag):", "",
                      *_field_rows(options, [f.name for f in dataclasses.fields(options)], cls.__name__.lower()), ""]
    return "\n".join(lines)


def plugin_reference() -> str:
    """Every registered plug-in of each kind (PPOConfig's PLUGINS) with its traits, then each one's options (the
    one place they are declared: the plug-in's options dataclass), as `--help` lists them."""
    from marlhf.trainers.ppo_config import FLAT_OPTIONS, PLUGINS, PPOConfig

    ppo_fields = {f.name: f for f in dataclasses.fields(PPOConfig)}
    lines = []
    for option, registry in PLUGINS.items():
        lines += [f"### `{option}`: {registry.kind}", "",
                  f"Chosen with `{option}` (`--{option} NAME` or a dotted path `package.module:object`); its options "
                  f"in `{option}_options`, a built-in's also as flat flags (`--NAME VALUE`). Default: "
                  f"`{ppo_fields[option].default}`.", "",
                  "| name | options (default) | traits | what it is |", "|---|---|---|---|"]
        tables = []
        for name in registry.names():
            plugin = registry.get(name)
            anchor = f"plugin-{option}-{name}".replace("_", "-")
            options = [f"[`{f.name}={f.default!r}`](#{anchor}-{f.name})"
                       for f in dataclasses.fields(plugin.options)] if plugin.options is not None else []
            traits = ", ".join(f"`{key}={value!r}`" for key, value in sorted(plugin.traits.items())
                               if not callable(value))
            summary = (inspect.getdoc(plugin.obj) or "").split("\n\n")[0].replace("\n", " ")
            lines.append(f"| `{name}` | {_cell(', '.join(options) or 'none')} | {_cell(traits or '-')} | "
                         f"{_cell(summary or '-')} |")
            if plugin.options is not None:
                flat = " (each also a flat flag)" if all(f.name in FLAT_OPTIONS
                                                       for f in dataclasses.fields(plugin.options)) else ""
                tables += [f"**`{option}: {name}`**{flat}", "",
                           *_field_rows(plugin.options, [f.name for f in dataclasses.fields(plugin.options)], anchor),
                           ""]
        lines += ["", *tables]
    return "\n".join(lines)


# --- command line -------------------------------------------------------------------------------------------

def command_help(command: str) -> str:
    """`marlhf COMMAND --help` as the installed CLI prints it."""
    from marlhf.cli import build_parser

    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_WIDTH
    try:
        parser = build_parser(command)
        subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        text = subparsers.choices[command].format_help()
    finally:
        if previous is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = previous
    return f"```text\n{text.rstrip()}\n```"


# --- result files -------------------------------------------------------------------------------------------

def include(path: str, depth: int) -> str:
    """A result file's Markdown, its headings one level down and each figure it names shown below its mention."""
    file = ROOT / path
    if not file.exists():
        return f"*`{path}` does not exist yet: the study has not written it.*"
    text = re.sub(r"^(#+) ", r"#\1 ", file.read_text(), flags=re.MULTILINE)
    study = file.parent.name
    figure = re.compile(r"^(.*Figure: `([\w.-]+\.png)`.*)$", re.MULTILINE)

    def show(match):
        name = match.group(2)
        if not (file.parent / name).exists():
            return match.group(1)
        return f"{match.group(1)}\n\n![{name}]({'../' * depth}studies/figures/{study}/{name})"

    return figure.sub(show, repo_links(text, depth))


# Where a repository file that a Markdown text links to is on the site (relative to docs/).
SITE_PLACES = {
    "benchmarks/README.md": "performance.md",
    "benchmarks/results/credit_assignment/README.md": "studies/credit-assignment.md",
    "benchmarks/results/credit_assignment_lambda/README.md": "studies/lambda.md",
    "benchmarks/results/credit_assignment/summary.md": "studies/credit-assignment.md#tables",
    "benchmarks/results/credit_assignment_exploratory_lambda/summary.md": "studies/credit-assignment.md#exploratory",
    "benchmarks/results/credit_assignment_lambda/summary.md": "studies/lambda.md#results",
}


def repo_links(text: str, depth: int, base: str = "") -> str:
    """Rewrite links to repository paths (relative to `base`, the folder of the file the text comes from) for a
    page `depth` folders below docs/: pages of docs/ and the studies' figures and summaries to their place on the
    site, any other file to its path in code."""
    prefix = "../" * depth

    def rewrite(match):
        bang, label, target = match.group(1), match.group(2), match.group(3)
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            return match.group(0)
        path, _, anchor = target.partition("#")
        path = os.path.normpath(os.path.join(base, path))
        if path.startswith("docs/") and path.endswith(".md"):
            return f"{bang}[{label}]({prefix}{path[len('docs/'):]}{'#' + anchor if anchor else ''})"
        if path in SITE_PLACES:
            return f"{bang}[{label}]({prefix}{SITE_PLACES[path]})"
        png = re.match(r"^benchmarks/results/([\w-]+)/([\w.-]+\.png)$", path)
        if png:
            return f"{bang}[{label}]({prefix}studies/figures/{png.group(1)}/{png.group(2)})"
        return label if label.strip("`") == path else f"{label} (`{path}`)"

    return re.sub(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)", rewrite, text)


def section(text: str, heading: str) -> str:
    """The lines under the first heading whose title starts with `heading`, up to the next heading (outside code fences)."""
    lines, out, inside, fence = text.split("\n"), [], False, False
    for line in lines:
        if line.startswith("```"):
            fence = not fence
        is_heading = not fence and re.match(r"^#{1,6} ", line)
        if inside and is_heading:
            break
        if inside:
            out.append(line)
        if is_heading and not inside and line.lstrip("#").strip().startswith(heading):
            inside = True
    if not inside:
        raise ValueError(f"no heading {heading!r}")
    return "\n".join(out).strip()


def paragraph(text: str, start: str) -> str:
    for block in text.split("\n\n"):
        if block.startswith(start):
            return block.strip()
    raise ValueError(f"no paragraph starting with {start!r}")
