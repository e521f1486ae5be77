"""The documentation site (mkdocs.yml, docs/, README.md as the home page) builds with
``mkdocs build --strict``: no broken link, anchor or API reference, and every public name of
``linattn`` has a generated reference entry."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import linattn

ROOT = Path(__file__).resolve().parent.parent


def _build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")  # no banner about MkDocs 2 in the output
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config), "--site-dir", str(site)],
        capture_output=True, text=True, env=env, timeout=300,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("docs") / "site"
    result = _build(ROOT / "mkdocs.yml", out)
    assert result.returncode == 0, result.stdout + result.stderr
    return out


def test_the_site_builds_strict_with_readme_as_its_home_page(site):
    home = (site / "index.html").read_text(encoding="utf-8")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    # the home page is README.md: its first section title and its first command are there
    assert "Quick start: train a language model" in home and "make demo" in home
    # README's links into docs/ point at the site's pages, relative to the home page
    for target in re.findall(r"\]\(docs/([^)#]+\.md)", readme):
        page = target.removesuffix(".md").removesuffix("index")
        assert f'href="{page}' in home, target
    assert 'href="docs/' not in home
    # the getting-started page includes README's first-model example, without the markers
    start = (site / "getting-started" / "index.html").read_text(encoding="utf-8")
    assert "update_codebooks" in start and "--8&lt;--" not in start and "[start:" not in start


def test_every_public_name_has_an_api_reference_entry(site):
    documented = set()
    for page in (ROOT / "docs" / "api").glob("*.md"):
        documented |= set(re.findall(r"^::: linattn\.(\w+)\s*$", page.read_text(encoding="utf-8"), re.M))
    public = set(linattn.__all__) - {"__version__"}  # a string, named on docs/api/index.md
    assert public - documented == set(), "add a '::: linattn.NAME' entry under docs/api/"
    assert "`linattn.__version__`" in (ROOT / "docs" / "api" / "index.md").read_text(encoding="utf-8")
    html = "".join(p.read_text(encoding="utf-8") for p in (site / "api").rglob("index.html"))
    for name in sorted(public):
        assert f'id="linattn.{name}"' in html, name  # rendered, not only listed


def test_no_list_of_the_manual_renders_as_one_paragraph(site):
    """A Markdown or docstring list needs a blank line before it (and a loose item's blocks four
    spaces), or its items run into the paragraph above."""
    for page in site.rglob("index.html"):
        url = page.parent.relative_to(site).as_posix() + "/"
        if url.startswith(("mutation/", "results/", "benchmarks/")) and url.count("/") > 1:
            continue  # the committed outputs of runs
        text = page.read_text(encoding="utf-8")
        flattened = [p[:80] for p in re.findall(r"<p>(.*?)</p>", text, re.S) if re.search(r"\n\s*- ", p)]
        assert flattened == [], url


def test_api_pages_show_signatures_and_no_private_names(site):
    html = {page.parent.name: page.read_text(encoding="utf-8") for page in (site / "api").glob("*/index.html")}
    # a class is rendered with its constructor's signature and a table of its parameters
    gau = html["nn"].split('id="linattn.nn.GAU"')[1].split('class="doc doc-object doc-class"')[0]
    assert 'class="doc-signature' in gau and "rotary_base" in gau and "Parameters:" in gau
    for page, text in html.items():
        leaked = re.findall(r'id="(linattn[\w.]*\._\w*)"', text)  # _private and __dunder__ members
        assert leaked == [], page


def _tiny_site(tmp_path: Path, page_b: str) -> Path:
    """A two-page site under the validation settings of the project's mkdocs.yml."""
    ours = yaml.load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=yaml.BaseLoader)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# A\n\n## Section\n\nSee [B](b.md).\n", encoding="utf-8")
    (docs / "b.md").write_text(page_b, encoding="utf-8")
    config = {"site_name": "t", "docs_dir": str(docs), "strict": True, "validation": ours["validation"],
              "nav": ["index.md", "b.md"]}
    path = tmp_path / "mkdocs.yml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def test_a_broken_link_or_anchor_fails_the_strict_build(tmp_path):
    links = ["missing.md", "index.md#no-such-section", "folder/"]
    page = "# B\n\n" + "\n\n".join(f"[there]({link})" for link in links) + "\n"
    result = _build(_tiny_site(tmp_path, page), tmp_path / "site")
    assert result.returncode != 0
    for link in links:
        assert link.split("#")[-1] in result.stdout + result.stderr, link
    # the contrasting case: the same site with a good link and anchor builds
    good = tmp_path / "good"
    good.mkdir()
    assert _build(_tiny_site(good, "# B\n\n[there](index.md#section)\n"), good / "site").returncode == 0


def _hooks():
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "tools" / "mkdocs_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_links_are_made_relative_to_the_docs_folder():
    hooks = _hooks()
    text = "[a](docs/guide/training.md) [b](docs/benchmarks.md#long-context) [c](#quick) [d](https://x.org/docs/y)"
    assert hooks.readme_for_site(text) == (
        "[a](guide/training.md) [b](benchmarks.md#long-context) [c](#quick) [d](https://x.org/docs/y)"
    )
    from mkdocs.exceptions import PluginError

    with pytest.raises(PluginError, match="'configs/demo.toml', outside docs/"):
        hooks.readme_for_site("[run file](configs/demo.toml)")


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250
    lines = [line for line in lines if not line.startswith("<!-- snippet:")]  # tools/doc_snippets.py's, unseen
    assert lines[:5] == [
        "# linattn",
        "",
        "```bash",
        "make demo   # creates .venv, installs, fetches Shakespeare, trains a small Transformer-VQ LM into runs/demo "
        "(replaced), samples from it",
        "make test   # creates .venv, installs, runs the whole test suite",
    ]


def _nav_pages() -> list[str]:
    """The source files of mkdocs.yml's navigation, e.g. ``guide/models.md``."""
    config = yaml.load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=yaml.BaseLoader)

    def walk(entries):
        for entry in entries:
            value = entry if isinstance(entry, str) else next(iter(entry.values()))
            yield from [value] if isinstance(value, str) else walk(value)

    return list(walk(config["nav"]))


def _url(source: str) -> str:
    """The site URL of a page's source file: ``guide/models.md`` -> ``guide/models/``; a folder's
    ``index.md`` or ``README.md`` is the folder's page."""
    folder, _, name = source.removesuffix(".md").rpartition("/")
    folder = folder + "/" if folder else ""
    return folder if name in ("index", "README") else f"{folder}{name}/"


def test_search_covers_the_manual_and_not_the_result_pages(site):
    docs = json.loads((site / "search" / "search_index.json").read_text(encoding="utf-8"))["docs"]
    searched = {doc["location"].split("#")[0] for doc in docs}
    manual = {_url(source) for source in _nav_pages()}
    assert manual - searched == set(), "a page of the navigation is missing from the search index"
    outputs = [page for folder in ("mutation", "results", "benchmarks")
               for page in (ROOT / "docs" / folder).rglob("*.md")]
    assert len(outputs) > 20  # the committed reports and result tables
    for page in outputs:
        url = _url(page.relative_to(ROOT / "docs").as_posix())
        assert (site / url / "index.html").is_file(), url  # still built, reached through links
        assert url not in searched, url


def test_a_missing_mathjax_is_named_with_its_package(monkeypatch):
    hooks = _hooks()
    monkeypatch.setattr(hooks.importlib.util, "find_spec", lambda name: None)
    from mkdocs.exceptions import PluginError

    with pytest.raises(PluginError, match="django-static-mathjax==3.2.2.1"):
        hooks.mathjax_script()


def test_math_is_typeset_by_a_mathjax_served_with_the_site(site):
    script = "assets/mathjax/tex-svg.js"
    assert (site / script).stat().st_size > 1_000_000  # MathJax itself, fonts included
    math_pages = ["mechanisms/kernel", "mechanisms/delta", "mechanisms/gated", "mechanisms/vq", "mechanisms/softmax"]
    for page in math_pages:
        html = (site / page / "index.html").read_text(encoding="utf-8")
        assert html.count('<span class="arithmatex">') + html.count('<div class="arithmatex">') >= 3, page
        # the settings first, then MathJax, from the site itself
        settings, mathjax = html.find('javascripts/mathjax.js"'), html.find(script + '"')
        assert 0 < settings < mathjax, page
    for page in site.rglob("*.html"):
        assert not re.search(r'<script[^>]+src="(https?:)?//', page.read_text(encoding="utf-8")), page
