"""An mkdocs hook: with ``repo_url`` set (``ADLM_REPO_URL``), every repository file or folder a page names in a code
span (`configs/demo.yaml`, `benchmarks/results/...md`, `CONTRIBUTING.md`) links to it in the repository, at the
branch ``ADLM_REPO_BRANCH`` (default ``main``). Without ``repo_url`` the pages are left as they are."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CODE = re.compile(r"(<a [^>]*>)?<code>([A-Za-z0-9_][\w./-]*)</code>")
TOP = {p.name for p in ROOT.iterdir() if not p.name.startswith(".")}


def _link(match: re.Match[str], base: str) -> str:
    path = match.group(2).rstrip("/")
    if match.group(1) or path.split("/")[0] not in TOP or ".." in path or not (ROOT / path).exists():
        return match.group(0)
    kind = "tree" if (ROOT / path).is_dir() else "blob"
    return f'<a href="{base}/{kind}/{os.environ.get("ADLM_REPO_BRANCH", "main")}/{path}"><code>{match.group(2)}</code></a>'


def on_page_content(content: str, config, **_) -> str:
    base = (config.get("repo_url") or "").rstrip("/")
    if not base:
        return content
    return CODE.sub(lambda m: _link(m, base), content)
