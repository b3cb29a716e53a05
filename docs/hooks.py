"""mkdocs hooks (mkdocs.yml: hooks): the docstrings use reST roles (``:class:`Adam```), which
``help()`` shows as they are; on the site they become plain code."""

from __future__ import annotations

import re
from typing import Any

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj):<code>(~?)([^<]*)</code>")


def _name(m: re.Match[str]) -> str:
    name = m.group(2)
    return f"<code>{name.rsplit('.', 1)[-1] if m.group(1) else name}</code>"


def on_page_content(html: str, **kwargs: Any) -> str:
    html = ROLE.sub(_name, html)
    return html.replace("::</p>", ":</p>")  # a reST literal block's marker
