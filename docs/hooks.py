"""MkDocs hooks for the rcdl site (mkdocs.yml, ``hooks:``); not part of the library.

The pages and docstrings are written to read well as plain text in the repository, so they
cite one another as ``docs/theory.md`` and name objects with Sphinx roles
(``:class:`rcdl.optim.grower.Grower```). On the site both become links:

- a citation ``docs/NAME.md`` outside code blocks links to that page. A citation of a page
  that is not in docs/ is a warning, so ``mkdocs build --strict`` fails on it as it does on a
  broken Markdown link.
- a role ``:class:`X``` (also ``:func:``, ``:meth:``, ``:mod:``, ``:attr:``, ``:data:``,
  ``:exc:``, ``:obj:``) loses its role prefix and links to the API entry of ``X`` where the
  reference has one (resolved by mkdocs-autorefs; unresolved names stay plain code).
  ``~a.b.C`` shows as ``C``, as in Sphinx.
- a paragraph ending in the reST literal-block marker ``::`` before a code block ends in
  ``:`` (or in nothing after a space), as Sphinx shows it.
"""

from __future__ import annotations

import logging
import re
from html import escape

from mkdocs.structure.files import Files
from mkdocs.structure.pages import Page
from mkdocs.utils import get_relative_url

log = logging.getLogger("mkdocs.hooks.rcdl")

# Code blocks are left alone. Headings are checked but get no links (a heading's text is
# also its table-of-contents entry).
_PRE = re.compile(r"<pre\b.*?</pre>|<h([1-6])\b.*?</h\1>", re.DOTALL)
# An <a> element's text is already a link.
_ANCHOR = re.compile(r"<a\b.*?</a>", re.DOTALL)
_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):<code>(~?)([\w.]+)(\(\))?</code>")
_LITERAL = re.compile(r"( ?)::(</p>\s*(?:<div class=\"highlight\">)?<pre\b)")
_CITE = re.compile(r"(<code>)?\bdocs/([\w-]+\.md)\b(</code>)?")


def _outside(pattern: re.Pattern[str], html: str, fn, on_match=None) -> str:
    """Apply ``fn`` to the parts of ``html`` that ``pattern`` does not match (and
    ``on_match``, if given, to each match)."""
    out, pos = [], 0
    for m in pattern.finditer(html):
        out += [fn(html[pos:m.start()]), on_match(m) if on_match else m.group(0)]
        pos = m.end()
    out.append(fn(html[pos:]))
    return "".join(out)


def _roles(html: str) -> str:
    def sub(m: re.Match[str]) -> str:
        short, name, call = m.group(1), m.group(2), m.group(3) or ""
        shown = (name.rsplit(".", 1)[-1] if short else name) + call
        code = f"<code>{escape(shown)}</code>"
        return f'<autoref identifier="{escape(name)}" optional>{code}</autoref>'

    return _ROLE.sub(sub, html)


def _citations(html: str, page: Page, files: Files, link: bool = True) -> str:
    def sub(m: re.Match[str]) -> str:
        open_code, name, close_code = m.group(1) or "", m.group(2), m.group(3) or ""
        if bool(open_code) != bool(close_code):  # part of a longer code span: leave it
            return m.group(0)
        target = files.get_file_from_path(name)
        if target is None or target.page is None:
            log.warning("%s cites docs/%s, which is not a page of the site",
                        page.file.src_path, name)
            return m.group(0)
        if not link:
            return m.group(0)
        href = get_relative_url(target.url, page.url)
        return f'<a href="{escape(href)}">{open_code}docs/{name}{close_code}</a>'

    return _CITE.sub(sub, html)


def on_page_content(html: str, page: Page, config, files: Files) -> str:
    def outside_pre(part: str) -> str:
        return _outside(_ANCHOR, part, lambda s: _citations(_roles(s), page, files))

    def heading_or_pre(m: re.Match[str]) -> str:
        if m.group(1):  # a heading: check its citations, link nothing
            _citations(m.group(0), page, files, link=False)
        return m.group(0)

    html = _LITERAL.sub(lambda m: ("" if m.group(1) else ":") + m.group(2), html)
    return _outside(_PRE, html, outside_pre, heading_or_pre)
