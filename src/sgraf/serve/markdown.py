"""The little Markdown of the API descriptions, as HTML for `/docs` (no library, no script).

Descriptions (route docstrings, `Query(description=...)`) use inline code, bold, emphasis,
links and `-` lists; everything else is text. The input is escaped first, so a description can
never inject markup.
"""

from __future__ import annotations

import html
import re

_CODE = re.compile(r"`([^`]+)`")
_BOLD = re.compile(r"\*\*(.+?)\*\*")
_EMPHASIS = re.compile(r"(?<![\w*])\*(?!\s)([^*]+?)(?<!\s)\*(?![\w*])")
_LINK = re.compile(r"\[([^\]]+)\]\(((?:https?://|/)[^)\s]*)\)")


def inline(text: str) -> str:
    """One paragraph's Markdown as HTML: `code`, **bold**, *emphasis*, [links](/path or http(s))."""
    parts = _CODE.split(text)   # odd parts are code spans: escaped, never formatted
    out = []
    for number, part in enumerate(parts):
        if number % 2:
            out.append(f"<code>{html.escape(part)}</code>")
            continue
        part = html.escape(part, quote=False)
        part = _LINK.sub(lambda m: f'<a href="{html.escape(m.group(2))}">{m.group(1)}</a>', part)
        part = _BOLD.sub(r"<b>\1</b>", part)
        out.append(_EMPHASIS.sub(r"<em>\1</em>", part))
    return "".join(out)


def block(text: str) -> str:
    """Paragraphs (split at blank lines) and `-` lists as HTML."""
    html_parts = []
    for paragraph in re.split(r"\n\s*\n", text.strip()):
        lines = [line.strip() for line in paragraph.splitlines() if line.strip()]
        if not lines:
            continue
        if all(line.startswith("- ") for line in lines):
            items = "".join(f"<li>{inline(line[2:])}</li>" for line in lines)
            html_parts.append(f"<ul>{items}</ul>")
        else:
            html_parts.append(f"<p>{inline(' '.join(lines))}</p>")
    return "\n".join(html_parts)
