"""MkDocs hooks of the documentation site (``mkdocs.yml``: ``hooks``).

The home page is README.md: its links are written for GitHub, relative to the repository root
(``docs/guide/training.md``), and the site's pages live in ``docs/``, so the text of README.md
replaces ``docs/index.md`` with every ``docs/`` prefix dropped. A README link to anything outside
``docs/`` has no page on the site and is an error.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.exceptions import PluginError

_README = Path(__file__).resolve().parent.parent / "README.md"
_LINK = re.compile(r"\]\(([^)\s]+)\)")


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


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ANN001 (MkDocs objects)
    if page.file.src_uri == "index.md":
        return readme_for_site(_README.read_text(encoding="utf-8"))
    return markdown
