"""The user documentation agrees with the code and with itself: README's introduction and the
models guide name every ``linattn`` subcommand and every layer kind (and the guide every
``LMConfig`` field), README states pyproject's torch requirement, no two pages of the site share
a title, and no user page speaks the project's internal shorthand (source-document numbers such
as "seed 003", issue numbers)."""

from __future__ import annotations

import argparse
import dataclasses
import re
import tomllib
from pathlib import Path

import pytest

import linattn
from _helpers import SHORTHAND
from linattn.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
MODELS_GUIDE = (ROOT / "docs" / "guide" / "models.md").read_text(encoding="utf-8")
# Committed outputs of runs (tables and reports written by the commands), not the manual.
OUTPUT_FOLDERS = ("docs/results/", "docs/benchmarks/", "docs/mutation/")


def _readme_intro() -> str:
    return README[:README.index("\n## ")]


def _subcommands() -> list[str]:
    [subparsers] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return list(subparsers.choices)


def _user_pages() -> list[Path]:
    pages = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))
    return [p for p in pages if not p.relative_to(ROOT).as_posix().startswith(OUTPUT_FOLDERS)]


@pytest.mark.parametrize("where, text", [("README.md's introduction", _readme_intro()),
                                         ("docs/guide/models.md", MODELS_GUIDE)])
def test_every_subcommand_and_layer_kind_is_named(where, text):
    assert len(_subcommands()) >= 13 and len(linattn.models.layer_kinds()) >= 13
    if where.startswith("README"):
        missing = [name for name in _subcommands() if f"`{name}`" not in text]
        assert missing == [], f"{where} does not name the subcommands {missing}"
    missing = [kind for kind in linattn.models.layer_kinds() if f"`{kind}" not in text]
    assert missing == [], f"{where} does not name the layer kinds {missing}"


def test_the_models_guide_names_every_model_setting():
    missing = [f.name for f in dataclasses.fields(linattn.LMConfig) if f"`{f.name}`" not in MODELS_GUIDE]
    assert missing == []


def test_readme_states_the_torch_requirement_of_pyproject():
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["dependencies"]
    [torch] = [d for d in dependencies if re.match(r"torch\b", d)]
    intro = _readme_intro()
    assert f"`{torch}`" in intro
    assert re.findall(r"`torch[=<>!~][^`]*`", intro) == [f"`{torch}`"]  # no second, different requirement


def test_no_two_pages_share_a_title():
    titles = {}
    for page in _user_pages():
        first = page.read_text(encoding="utf-8").lstrip().splitlines()[0]
        if first.startswith("# "):
            titles.setdefault(first[2:].strip(), []).append(page.relative_to(ROOT).as_posix())
    assert {title: pages for title, pages in titles.items() if len(pages) > 1} == {}


@pytest.mark.parametrize("page", [pytest.param(p, id=p.relative_to(ROOT).as_posix()) for p in _user_pages()])
def test_user_pages_speak_no_internal_shorthand(page):
    found = [(n, m.group(0)) for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
             for m in SHORTHAND.finditer(line)]
    assert found == [], "name the paper, the technique or the result instead"


def test_the_shorthand_pattern_catches_what_it_is_for():
    assert [SHORTHAND.search(text) is not None for text in (
        "(seed 003)", "issue 21's targets", "Issue 38", "seeds 0, 1, 2", "seed 0", "tissue 12", "3 seeds")] == [
        True, True, True, False, False, False, False]
