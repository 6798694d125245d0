"""A stand-in for a Hugging Face Hub dataset served as Parquet files: real documents (King James
chapters) in several Parquet files with small row groups, laid out as a hub mirror
(``<mirror>/<dataset id>/<path>``), and a named source that reads them (``data.hub``). And a stand-in for the
Hub's model API on loopback (``hub_models``), which ``huggingface_hub.snapshot_download`` downloads from."""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote, urlparse

import pyarrow as pa
import pyarrow.parquet as pq

from pipelines.data.sources import NamedSource

REPO = "standin/corpus"
PATTERN = "plain_text/train-*.parquet"


def stand_in_source(holdout: int = 0) -> NamedSource:
    """A named source shaped like OpenWebText (one hub split ``train``; ``holdout`` documents of its tail form
    ``validation``) whose Parquet files the mirror holds."""
    splits = {"train": "train", "validation": "train"} if holdout else {"train": "train"}
    return NamedSource("standin", REPO, None, splits, "text", None, "gpt2", "wrap", 64, tuple(splits),
                       holdout_last=holdout, hub_files={"train": PATTERN})


def write_stand_in(mirror: Path | str, docs: list[str], files: int = 3, row_group: int = 7) -> list[str]:
    """``docs`` in ``files`` Parquet files (row groups of ``row_group`` rows, an extra column as the hub's have)
    under ``<mirror>/<REPO>/plain_text/``; a local folder or an object-store URI. Returns the files in order."""
    from pipelines.core.storage import get_fs, join

    per = -(-len(docs) // files)
    out = []
    for i in range(files):
        part = docs[i * per:(i + 1) * per]
        path = join(str(mirror), REPO, "plain_text", f"train-{i:05d}-of-{files:05d}.parquet")
        fs, inner = get_fs(path)
        fs.create_dir(inner.rsplit("/", 1)[0], recursive=True)
        with fs.open_output_stream(inner) as f:
            pq.write_table(pa.table({"text": part, "id": list(range(i * per, i * per + len(part)))}), f,
                           row_group_size=row_group)
        out.append(path)
    return out


class _HubModels(http.server.BaseHTTPRequestHandler):
    """The Hub's model API as ``huggingface_hub.snapshot_download`` reads it: a revision's commit, its file tree,
    and each file by commit (``/api/models/<id>/revision/<rev>``, ``/api/models/<id>/tree/<sha>``,
    ``/<id>/resolve/<sha>/<file>``). Every file request is recorded in ``served``."""

    repos: dict[str, dict[str, bytes]] = {}
    served: list[str] = []

    def log_message(self, *args: object) -> None:
        pass

    def _send(self, code: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        parts = unquote(urlparse(self.path).path).strip("/").split("/")
        api = parts[:2] == ["api", "models"]
        repo = "/".join(parts[2:4] if api else parts[:2])
        files = self.repos.get(repo)
        if files is None:
            self._send(404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"})
            return
        sha = hashlib.sha1(repo.encode()).hexdigest()
        if api and parts[4] == "revision":
            body = {"id": repo, "sha": sha, "siblings": [{"rfilename": f} for f in files]}
        elif api and parts[4] == "tree":
            body = [{"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                    for f, b in files.items()]
        else:  # <repo>/resolve/<sha>/<file>
            name = "/".join(parts[4:])
            if self.command == "GET":
                self.served.append(f"{repo}/{name}")
            data = files[name]
            self._send(200, data, {"X-Repo-Commit": sha, "ETag": f'"{hashlib.sha1(data).hexdigest()}"'})
            return
        self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"})


@contextlib.contextmanager
def hub_models(repos: dict[str, dict[str, bytes]], cache: Path) -> Iterator[list[str]]:
    """A stand-in for the Hugging Face Hub on loopback serving ``repos`` (id -> file name -> bytes), with
    ``huggingface_hub`` pointed at it and at the cache folder ``cache`` (the settings ``HF_ENDPOINT`` and
    ``HF_HOME`` make, read by the library when it is imported) and online; yields the files downloaded."""
    from huggingface_hub import constants

    handler = type("Handler", (_HubModels,), {"repos": repos, "served": []})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    saved = {k: getattr(constants, k) for k in ("ENDPOINT", "HUGGINGFACE_CO_URL_TEMPLATE", "HF_HUB_OFFLINE",
                                                 "HF_HUB_CACHE")}
    constants.ENDPOINT, constants.HF_HUB_OFFLINE, constants.HF_HUB_CACHE = url, False, str(cache)
    constants.HUGGINGFACE_CO_URL_TEMPLATE = url + "/{repo_id}/resolve/{revision}/{filename}"
    try:
        yield handler.served
    finally:
        for k, v in saved.items():
            setattr(constants, k, v)
        srv.shutdown()
        srv.server_close()
