"""The docs keep up with the code (fast: no MPI, no pool, nothing started).

1. Every option is declared once, in hvd_magic/runner/options.py; the option tables of
   docs/*.md (between ``<!-- options: COMMAND, ... -->`` and ``<!-- end of options -->``)
   are made from it and must equal what it makes now (``python -m hvd_magic.runner.options
   docs/*.md`` rewrites them), every command that takes options has a table, and
   docs/magics.md names every ``%hvd`` command and shows ``%%hvd``'s usage line.
2. Every environment variable declared in hvd_magic/config.py appears in
   docs/environment.md, and every ``HOROVOD_*``/``HVD_MAGIC_*`` name that README.md or a page
   of docs/ mentions is declared there (no documented variable that the code does not read).
3. Convention for quoted messages: in docs/troubleshooting.md, a fenced block whose info
   string is ``text`` (```` ```text ````) quotes, verbatim, what a user sees. Each such block
   must share a run of at least ``MIN_FRAGMENT`` characters with the source of the tests
   (every ``*.py`` under tests/, the worker scripts in tests/mpi/ included), i.e. a
   distinctive part of the message is produced and asserted by a test. Other fences
   (```` ```python ````, ```` ```bash ````) are not checked; do not use ``text`` for anything
   but quoted messages on that page.
4. Relative links in README.md and docs/*.md point at files that exist, and ``#anchors`` into
   a Markdown page at one of its headings.
5. The examples in docstrings (``>>>``) of hvd_magic's modules and of tests/conftest.py hold.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from hvd_magic import config
from hvd_magic.magics import args
from hvd_magic.runner import options

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
MIN_FRAGMENT = 12


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


# ---------------------------------------------------------------- 1. magics options

def test_the_option_tables_are_made_from_the_declaration():
    pages = {p.name: _read(p) for p in sorted(DOCS.glob("*.md"))}
    stale = [name for name, text in pages.items() if options.with_tables(text) != text]
    assert not stale, (f"the option tables of {stale} differ from hvd_magic/runner/options.py; "
                       "run: python -m hvd_magic.runner.options docs/*.md")
    tabled = {c.strip() for text in pages.values()
              for m in options.MARKED.finditer(text) for c in m.group(2).split(",")}
    commands = {c for o in options.OPTIONS for c in o.commands}
    assert commands <= tabled, f"give these commands an option table: {commands - tabled}"


def test_magics_md_names_every_command_and_the_usage():
    page = _read(DOCS / "magics.md")
    commands = [c for c in args.SUBCOMMANDS if f"%hvd {c}" not in page]
    assert not commands, f"document these %hvd commands in docs/magics.md: {commands}"
    for magic in ("%autohvd", "%autohvd off", "%%hvd scale", "%hvd scale"):
        assert magic in page, magic
    assert f"usage: {args.CELL_USAGE}\n" in page


def test_a_new_option_without_its_table_fails(monkeypatch):
    """What the first test catches: an option added to the declaration changes the table."""
    page = _read(DOCS / "magics.md")
    extra = options.Option(("--stacks",), "stacks", "show the ranks' stacks", (options.CELL,),
                           action="store_true")
    monkeypatch.setattr(options, "OPTIONS", options.OPTIONS + (extra,))
    assert options.with_tables(page) != page and "`--stacks`" in options.with_tables(page)


# ---------------------------------------------------------------- 2. environment variables

VAR_NAME = re.compile(r"\b(?:HOROVOD|HVD_MAGIC)_[A-Z0-9_]*[A-Z0-9]\b")


def test_every_declared_variable_is_in_environment_md():
    page = _read(DOCS / "environment.md")
    missing = [name for name in config.VARS if f"`{name}`" not in page]
    assert not missing, f"docs/environment.md lacks {missing}: regenerate its table " \
                        "from hvd_magic.config.markdown_table()"


def test_the_docs_name_only_declared_variables():
    pages = [ROOT / "README.md"] + sorted(DOCS.glob("*.md"))
    unknown = {(p.relative_to(ROOT).as_posix(), name) for p in pages
               for name in VAR_NAME.findall(_read(p)) if name not in config.VARS}
    assert not unknown, f"not declared in hvd_magic/config.py: {sorted(unknown)}"


# ---------------------------------------------------------------- 3. quoted messages

FENCE = re.compile(r"^```text[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)


def _tests_source() -> str:
    here = Path(__file__).resolve()
    return "\n".join(_read(p) for p in sorted((ROOT / "tests").rglob("*.py")) if p != here)


def longest_shared_run(message: str, source: str) -> str:
    """The longest substring of ``message`` that occurs in ``source``."""
    best = ""
    for start in range(len(message)):
        lo, hi = len(best), len(message) - start   # is there a match longer than best?
        if hi <= lo or message[start:start + lo + 1] not in source:
            continue
        while lo < hi:                         # binary search on the length from `start`
            mid = (lo + hi + 1) // 2
            if message[start:start + mid] in source:
                lo = mid
            else:
                hi = mid - 1
        best = message[start:start + lo]
    return best


def _quoted_messages() -> list:
    return [m.group(1).strip("\n") for m in FENCE.finditer(_read(DOCS / "troubleshooting.md"))]


def test_troubleshooting_quotes_messages():
    assert len(_quoted_messages()) >= 10


@pytest.mark.parametrize("message", _quoted_messages(),
                         ids=lambda m: re.sub(r"\W+", "_", m[:40]).strip("_"))
def test_each_quoted_message_is_asserted_by_a_test(message):
    found = longest_shared_run(message, _tests_source())
    assert len(found.strip()) >= MIN_FRAGMENT, (
        f"this message in docs/troubleshooting.md shares only {found!r} with tests/: quote "
        f"a message that a test asserts (at least {MIN_FRAGMENT} characters of it), or add "
        f"the assertion:\n{message}")


# ---------------------------------------------------------------- 4. links

LINK = re.compile(r"\]\(([^)#\s]*\.(?:md|png))?(?:#([^)\s]*))?\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*$", re.M)


def _anchors(page: Path) -> set:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to -."""
    text = re.sub(r"^```.*?^```", "", _read(page), flags=re.S | re.M)   # not # in code
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-")
            for h in HEADING.findall(text)}


def test_relative_links_resolve():
    broken = []
    for page in [ROOT / "README.md"] + sorted(DOCS.glob("*.md")):
        for target, anchor in LINK.findall(_read(page)):
            if not target and not anchor:
                continue
            path = (page.parent / target) if target else page
            where = (page.relative_to(ROOT).as_posix(), f"{target}#{anchor}")
            if not path.exists():
                broken.append(where)
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(where)
    assert not broken, f"links to missing files or headings: {broken}"


# ---------------------------------------------------------------- 5. docstring examples

EXAMPLES = sorted(str(p.relative_to(ROOT).with_suffix("")).replace("/", ".")
                  for p in (ROOT / "hvd_magic").rglob("*.py")
                  if re.search(r"^\s*>>> ", p.read_text(), re.M)) + ["conftest"]


@pytest.mark.parametrize("module", EXAMPLES)
def test_docstring_examples_hold(module):
    import doctest
    import importlib
    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted and not result.failed, result
