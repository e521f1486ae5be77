"""MkDocs hooks of the documentation site (``mkdocs.yml``: ``hooks``).

The home page is README.md: its links are written for GitHub, relative to the repository root
(``docs/guide/training.md``), and the site's pages live in ``docs/``, so the text of README.md
replaces ``docs/index.md`` with every ``docs/`` prefix dropped. A README link to anything outside
``docs/`` has no page on the site and is an error.

Search covers the manual, the pages of the navigation: the committed outputs of benchmarks,
reproductions and mutation runs (``not_in_nav`` in mkdocs.yml) stay reachable through links
but are left out of the search index.

Math (``pymdownx.arithmatex``) is typeset in the browser by MathJax, served with the site: its
``tex-svg.js`` (one file, fonts included) comes from the Python package ``django-static-mathjax``
(requirements.lock), so the site needs no network.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, InclusionLevel

_README = Path(__file__).resolve().parent.parent / "README.md"
_LINK = re.compile(r"\]\(([^)\s]+)\)")
MATHJAX_URI = "assets/mathjax/tex-svg.js"  # the site's copy, listed in mkdocs.yml's extra_javascript


def readme_for_site(text: str) -> str:
    """README.md's text with its ``](docs/X)`` links rewritten to ``](X)``."""

    def rewrite(match: re.Match) -> str:
        target = match.group(1)
        if target.startswith(("http://", "https://", "#", "mailto:")):
            return match.group(0)
        if not target.startswith("docs/"):
            raise PluginError(
                f"README.md links to {target!r}, outside docs/: the site has no page for it "
                "(link to a page under docs/ or to an absolute URL)"
            )
        return "](" + target.removeprefix("docs/") + ")"

    return _LINK.sub(rewrite, text)


def mathjax_script() -> Path:
    """MathJax's ``tex-svg.js`` in the installed ``django-static-mathjax``; a PluginError naming
    the package when it is not installed."""
    spec = importlib.util.find_spec("mathjax")
    script = None if spec is None or spec.origin is None else Path(spec.origin).parent / "static/mathjax/es5/tex-svg.js"
    if script is None or not script.is_file():
        raise PluginError("the site's math needs MathJax from the package django-static-mathjax (requirements.lock), "
                          "which is not installed: run make docs, or pip install django-static-mathjax==3.2.2.1")
    return script


def is_searched(page) -> bool:  # noqa: ANN001 (a MkDocs Page)
    """Whether ``page`` belongs in the search index: a page of the navigation, not one of the
    result, benchmark or mutation pages that ``not_in_nav`` names."""
    return page.file.inclusion != InclusionLevel.NOT_IN_NAV


def on_files(files, config):  # noqa: ANN001, ANN201 (MkDocs objects)
    files.append(File.generated(config, MATHJAX_URI, abs_src_path=str(mathjax_script())))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ANN001 (MkDocs objects)
    if not is_searched(page):
        page.meta["search"] = {**(page.meta.get("search") or {}), "exclude": True}
    if page.file.src_uri == "index.md":
        return readme_for_site(_README.read_text(encoding="utf-8"))
    return markdown
