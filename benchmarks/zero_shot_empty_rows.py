"""What the references' zero-shot convention (an EOS for every row, empty rows included) does to a WikiText PPL.

WikiText itself cannot be downloaded here, so the embedded Wikipedia sample is laid out as WikiText's raw
rows are (an empty row, `` = Title = ``, an empty row, then each paragraph followed by an empty row: about
half the rows empty, as in WikiText-103), prepared twice with the model's own tokenizer and the WikiText
detokenizer (``keep_empty`` on, the reference and our default for the named zero-shot sets; and off), and
the model's perplexity bound measured on both. Each kept empty row is one extra EOS in the stream, a token
that a model which has seen the pattern predicts almost for free.

    python benchmarks/zero_shot_empty_rows.py [--model models:/adlm@champion] [--workdir work]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _record import add_argument, recording
from _util import result


def wikitext_rows() -> list[str]:
    from pipelines.data.embedded import wikipedia_documents

    rows: list[str] = []
    for doc in wikipedia_documents():
        title, _, body = doc.partition("\n\n")
        rows += ["", f" = {title.strip()} = ", ""]
        for para in body.split("\n\n"):
            para = " ".join(para.split())
            if para:
                rows += [f" {para} ", ""]
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models:/adlm@champion",
                   help="models:/NAME@ALIAS or a checkpoint folder (default: the demo's champion)")
    p.add_argument("--workdir", default=None, help="work directory of the model's registry (default ./work)")
    add_argument(p)
    args = p.parse_args(argv)
    with recording("zero_shot_empty_rows", args.record):
        return measure(args)


def measure(args: argparse.Namespace) -> int:
    from adlm_model.interop.checkpoint import read_config
    from pipelines.core.runtime import init_ray
    from pipelines.core.storage import cache_dir, resolve_workdir
    from pipelines.data.prepare import PrepareConfig, prepare
    from pipelines.evaluation.config import EvalConfig
    from pipelines.evaluation.run import evaluate_model
    from pipelines.tracking.registry import resolve_model_ref
    from pipelines.tracking.runs import resolve_tracking_uri

    wd = resolve_workdir(args.workdir)
    uri = resolve_tracking_uri(wd)
    try:
        ref = resolve_model_ref(args.model, uri, cache_dir(wd))
    except Exception as e:  # noqa: BLE001 - nothing to measure yet: say how to get a model
        print(f"skipped: {args.model} does not resolve in {uri} ({type(e).__name__}); run `make demo` first or "
              "pass --model", flush=True)
        return 0
    model_cfg, _ = read_config(ref.local_dir)
    tokenizer = Path(ref.local_dir) / "tokenizer.json"
    rows = wikitext_rows()
    empty = sum(not r.strip() for r in rows)
    print(f"{len(rows)} WikiText-style rows, {empty} empty ({100 * empty / len(rows):.0f}%)", flush=True)
    init_ray()
    ppl = {}
    with tempfile.TemporaryDirectory(prefix="wikitext-layout-") as tmp:
        src = Path(tmp) / "wiki.txt"
        src.write_text("\n".join(rows) + "\n", encoding="utf-8")
        for keep in (True, False):
            out = Path(tmp) / ("keep" if keep else "drop")
            m = prepare(PrepareConfig(source=[f"test={src}"], out=str(out), tokenizer=str(tokenizer), length=model_cfg.seq_len,
                             mode="wrap", detokenizer="wikitext", keep_empty=keep))["test"]
            res = evaluate_model(args.model, "ppl", EvalConfig(data=str(out)), workdir=wd, tracking_uri=uri,
                                 in_process=True, log=False)
            key = next(k for k in res.metrics if k.endswith("ppl") and "test" in k)
            ppl[keep] = res.metrics[key]
            print(f"keep_empty={keep}: {m.rows} rows, {m.tokens} tokens, {m.documents_used} documents used, "
                  f"PPL bound {ppl[keep]:.2f}", flush=True)
    print(json.dumps({"keep_empty": ppl[True], "drop_empty": ppl[False]}))
    result("wikitext_layout_ppl_keep_empty", ppl[True])
    result("wikitext_layout_ppl_drop_empty", ppl[False])
    result("keep_over_drop_ppl_ratio", ppl[True] / ppl[False])
    return 0


if __name__ == "__main__":
    sys.exit(main())
