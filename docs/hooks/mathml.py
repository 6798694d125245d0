"""An mkdocs hook: the site's formulas as MathML, written at build time, so that a browser shows them with no
script and no network (MathML Core: Chrome, Edge, Firefox, Safari).

``pymdownx.arithmatex`` (generic mode) keeps each formula's TeX from Markdown, as ``<span class="arithmatex">\\(
... \\)</span>`` inline and ``<div class="arithmatex">\\[ ... \\]</div>`` displayed; this hook replaces each by
``latex2mathml``'s ``<math>`` element. A formula it cannot convert fails the build, naming the page and the TeX.
"""

from __future__ import annotations

import html
import re

from latex2mathml.converter import convert

FORMULA = re.compile(r'<(span|div) class="arithmatex">(.*?)</\1>', re.S)


def _mathml(match: re.Match[str], page: str) -> str:
    tag, tex = match.group(1), html.unescape(match.group(2)).strip()
    inner = tex[2:-2] if tex[:2] in ("\\(", "\\[") else tex
    try:
        math = convert(inner.strip(), display="block" if tag == "div" else "inline")
    except Exception as e:
        raise ValueError(f"{page}: the formula {tex!r} does not convert to MathML: {e}") from e
    if "<merror" in math:
        raise ValueError(f"{page}: the formula {tex!r} does not convert to MathML")
    return f'<{tag} class="arithmatex">{math}</{tag}>'


def on_page_content(content: str, page, **_) -> str:
    return FORMULA.sub(lambda m: _mathml(m, page.file.src_uri), content)
