"""The machinery of ``python -m pipelines.export``: a registered version as a Hugging Face-style folder.

``export_model(uri, out)`` writes (``adlm_model.interop.pretrained`` layout):

- ``config.json``: the ``ModelConfig``, the special token ids and the provenance (registered model, version,
  run id, the version's tags, the checkpoint's own meta: step, run name, data manifest hash, training config);
- ``model.safetensors``: the weights the version serves (EMA parameters with the model's buffers);
- ``tokenizer.json``;
- ``README.md``: the model card, with the evaluation figures the registry's version tags hold, each with its
  definition (quoted from docs/design/method.md, sections 1 and 6) and the settings it was measured with.
- the network code ``transformers`` loads (``auto_map``): ``configuration_adlm.py``, ``modeling_adlm.py`` and
  copies of the network's modules, so ``AutoModelForMaskedLM.from_pretrained(out, trust_remote_code=True)``
  gives the same logits from the same ``model.safetensors``.

The folder is written beside ``out`` and moved into place only after ``adlm_model.load_pretrained`` has read
it back with weights equal, tensor for tensor, to the registered model's: an export is complete or absent.
``--force`` over an earlier export replaces the files an export writes (``EXPORT_FILES``), one atomic rename each,
and removes none: any other file in the folder (a ``.git``, the user's notes) is left as it was.
Uploading it to the Hugging Face Hub is one command (docs/usage/generation-and-serving.md):
``huggingface-cli upload <user>/<repo> <out> .``
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import adlm_model
from adlm_model.interop.checkpoint import CheckpointError, load_checkpoint
from adlm_model.interop.pretrained import HF_CODE, MODEL_TYPE, PRETRAINED_FILES, load_pretrained, save_pretrained
from adlm_model.kinds import count_parameters, model_kind
from pipelines.serving.generate import checkpoint_folder, special_tokens_of
from pipelines.tracking.registry import ModelRef, get_version
from pipelines.tracking.runs import client, resolve_tracking_uri

log = logging.getLogger("adlm.export")


class ExportError(ValueError):
    """An export that cannot be written (the output folder is in use, the model lacks a file)."""


# The perplexity's definition for the card, by the kind's (docs/design/method.md, sections 1 and 6); every other figure's is
# the one its suite gives (``pipelines.evaluation.suites``: ``Figure``).
_PPL_BOUND = ("`exp(sum of per-token NELBO / number of tokens)` over the whole evaluation split, one `t` per "
              "sequence (stratified inside the batch), EMA weights, BOS/EOS included. It is an upper bound: "
              "reported as `PPL <= value`.")
_PPL_EXACT = ("`exp(sum of per-token negative log-likelihood / number of tokens)` of the next-token "
              "distribution over the whole evaluation split, EMA weights: an exact perplexity (AR).")


# What ``AutoModelForMaskedLM``'s forward takes, per kind (modeling_adlm's docstring), for the card.
_HF_INPUT = {"mdlm": "z_t (B, L) -> (B, L, width) logits before SUBS; time conditioning off feeds sigma = 0",
             "adlm": "z_t (B, L) -> (B, L, width) denoiser logits of the composed network, before SUBS",
             "ar": "x (B, L) -> (B, L, width) next-token logits",
             "bd3lm": "x_t ++ x_0 (B, 2L) -> (B, L, width) logits of the x_t half; sample_mode=True: one sequence "
                      "under the block-causal mask"}


@dataclass
class ExportResult:
    """What ``export_model`` wrote."""

    out: Path
    figures: dict[str, str] = field(default_factory=dict)
    """The evaluation figures the model card lists (tag name -> value)."""
    parameters: int = 0


@dataclass
class _Source(ModelRef):
    """The model to export: what ``--model`` named, plus its version's tags and aliases (for the card)."""

    tags: dict[str, str] = field(default_factory=dict)
    aliases: list[str] = field(default_factory=list)


def _source(uri: str, tracking_uri: str | None, workdir: str | os.PathLike | None) -> _Source:
    if not uri.startswith("models:/"):
        return _Source(uri, str(checkpoint_folder(uri)))
    turi = tracking_uri or resolve_tracking_uri(workdir)
    mv = get_version(uri, turi)
    aliases = sorted(a for a, v in (client(turi).get_registered_model(mv.name).aliases or {}).items()
                     if str(v) == str(mv.version))
    return _Source(uri, str(checkpoint_folder(uri, tracking_uri=turi, workdir=workdir)), mv.name, str(mv.version),
                   mv.run_id, dict(mv.tags or {}), aliases)


EXPORT_FILES = ("README.md", *PRETRAINED_FILES, *HF_CODE)
"""Every file an export writes: what ``--force`` replaces in an earlier export (and nothing else)."""


def _check_out(dst: Path, force: bool) -> None:
    """ExportError (one line) unless ``dst`` can take an export: new, an empty folder, or (``force``) an earlier
    export; its nearest existing parent must be a folder."""
    parent = dst.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ExportError(f"--out {dst}: {parent} is a file, not a folder: pass a folder path")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        if not _is_export(dst):
            raise ExportError(f"--out {dst} exists and is not an empty folder or an earlier export: pass another folder")
        if not force:
            raise ExportError(f"--out {dst} holds an earlier export: pass --force to replace it, or another folder")


def _move_into(staged: Path, dst: Path) -> None:
    """The staged export in place: a new folder renamed whole; over an earlier export, each file the export wrote
    renamed over its namesake and the earlier export's files this one does not write removed, every other file
    left alone."""
    if not dst.exists():
        os.replace(staged, dst)
        return
    written = {f.name for f in staged.iterdir()}
    for name in sorted(written):
        os.replace(staged / name, dst / name)
    for name in EXPORT_FILES:
        if name not in written and (dst / name).is_file():
            (dst / name).unlink()
    others = sorted(f.name for f in dst.iterdir() if f.name not in EXPORT_FILES)
    if others:
        log.info(f"kept {len(others)} file(s) in {dst} that an export does not write: {', '.join(others[:8])}")


def _is_export(d: Path) -> bool:
    try:
        return d.is_dir() and json.loads((d / "config.json").read_text()).get("model_type") == MODEL_TYPE
    except (OSError, ValueError):
        return False


def figures_of(tags: dict[str, str]) -> dict[str, str]:
    """The evaluation figures among a version's tags (tag -> value), in the suites' order
    (``pipelines.evaluation.suites.figures_of``)."""
    # lazy: keeps pydantic, yaml out of this module's import
    from pipelines.evaluation.suites import figures_of as described

    return {k: tags[k] for k in described(tags)}


def model_card(src: _Source, cfg: Any, meta: dict[str, Any], parameters: int) -> str:
    """The README.md of an export (module docstring)."""
    kind = model_kind(cfg.kind)
    title = f"{src.name} v{src.version}" if src.name else Path(src.uri).name
    ppl_def = _PPL_BOUND if kind.diffusion else _PPL_EXACT
    lines = ["---", "library_name: adlm", f"tags: [text-generation, {'masked-diffusion' if kind.diffusion else 'autoregressive'}, "
             f"{cfg.kind}]", "---", "", f"# {title}: {cfg.kind.upper()} language model", "",
             f"A language model of kind {cfg.kind.upper()}, trained with the ADLM pipeline (the Anchored Diffusion "
             "Language Model and its baselines). Exported from " + (f"`{src.uri}` (registered model `{src.name}`, version {src.version}"
                                              f"{', aliases ' + ', '.join(src.aliases) if src.aliases else ''}, "
                                              f"MLflow run `{src.run_id}`)." if src.name else f"`{src.uri}`."), "",
             "## Model", "", "| field | value |", "|---|---|", f"| kind | {cfg.kind} |",
             f"| parameters | {parameters:,} |", f"| hidden size, heads | {cfg.hidden}, {cfg.heads} |",
             f"| blocks | {cfg.n_blocks}" + (f" (anchor) + {cfg.denoiser_blocks} "
                                             f"({'denoiser' if kind.diffusion else 'AR model'})" if kind.anchored else "")
             + " |", f"| context (training length) | {cfg.seq_len} tokens |",
             f"| vocabulary | {cfg.vocab_size} (mask id {cfg.mask_id}) |",
             f"| default sampler | {kind.default_sampler} |"]
    if kind.anchored:
        lines += [f"| anchor loss gamma, tau | {cfg.gamma}, {cfg.tau} |"]
    data = ((meta.get("train_config") or {}).get("data") or {})
    lines += ["", "## Training", "", "| field | value |", "|---|---|",
              f"| steps | {meta.get('step', src.tags.get('step', 'unknown'))} |",
              f"| run | {meta.get('run_name', src.tags.get('run_name', 'unknown'))} |",
              f"| training data | {data.get('train', 'unknown')} |",
              f"| validation data | {data.get('validation', 'unknown')} |",
              f"| data manifest hash | {meta.get('data_manifest_hash') or src.tags.get('data_manifest_hash', 'unknown')} |",
              "", "## Evaluation", ""]
    # lazy: keeps pydantic, yaml out of this module's import
    from pipelines.evaluation.suites import PPL
    from pipelines.evaluation.suites import figures_of as described

    figures = described(src.tags)
    if figures:
        lines += ["Figures as the model registry records them for this version (its tags).", "",
                  "| figure | value | settings |", "|---|---|---|"]
        for k, (fig, member) in figures.items():
            shown = "; ".join(f"{s}: {src.tags[s]}" for s in fig.settings if s in src.tags) or (
                "training's own validation (not yet evaluated)" if k == "val_ppl" else "not recorded")
            bound = "<= " if fig.definition == PPL and kind.diffusion else ""
            lines.append(f"| {fig.label.format(member)} (`{k}`) | {bound}{src.tags[k]} | {shown} |")
        lines += ["", "Definitions (docs/design/method.md, sections 1 and 6):", ""]
        used = list(dict.fromkeys(fig for fig, _ in figures.values()))
        if any(fig.definition == PPL for fig in used):
            lines.append(f"- **Perplexity** (validation, test, zero-shot): {ppl_def}")
        for fig in used:
            if fig.definition != PPL:
                lines.append(f"- **{fig.label.format('<task>.<metric>') if fig.family else fig.label}**: "
                             f"{fig.definition}")
        status = {k: v for k, v in src.tags.items() if k.startswith("eval.status") or k == "eval.stage"}
        if status:
            lines += ["", "Staged evaluation: " + ", ".join(f"{k} = {v}" for k, v in sorted(status.items())) + "."]
    else:
        lines.append("No evaluation figures are recorded for this version: run `python -m pipelines.evaluate "
                     "--model <uri> --suite ppl,gen_ppl,mauve` on it and export again.")
    lines += ["", "## Use", "", "```python", "from adlm_model import load_pretrained, TextGenerator", "",
              "model, cfg, meta = load_pretrained('.')        # this folder: config.json + model.safetensors",
              "gen = TextGenerator.from_dir('.')", "req = gen.request(prompt='In the beginning', suffix=' the end.', "
              "length=32, seed=0)", "print(gen.generate(req)[0].text)", "```", "",
              "or `python -m pipelines.generate --model . --prompt 'In the beginning' --length 32` from the "
              "ADLM pipeline. With `transformers` alone (the network code ships in this folder):", "",
              "```python", "from transformers import AutoModelForMaskedLM", "",
              "model = AutoModelForMaskedLM.from_pretrained('.', trust_remote_code=True)",
              "logits = model(input_ids).logits   # " + _HF_INPUT.get(cfg.kind, "see modeling_adlm.py"),
              "```", ""]
    return "\n".join(lines)


def export_model(uri: str, out: str | os.PathLike, *, tracking_uri: str | None = None,
                 workdir: str | os.PathLike | None = None, force: bool = False) -> ExportResult:
    """Export the version (or checkpoint folder) ``uri`` into ``out`` (module docstring)."""
    dst = Path(out).expanduser()
    _check_out(dst, force)
    src = _source(uri, tracking_uri, workdir)
    d = Path(src.local_dir)
    specials = special_tokens_of(d)
    if specials is None or not (d / "tokenizer.json").is_file():
        raise ExportError(f"{uri}: the model has no tokenizer.json beside its checkpoint ({d}); re-register it "
                          "from its training run")
    model, cfg, meta = load_checkpoint(d)  # the EMA weights, as the registered model serves them
    provenance = {"source_uri": uri, "registered_model": src.name, "version": src.version, "run_id": src.run_id,
                  "aliases": src.aliases, "tags": src.tags, "checkpoint_meta": meta,
                  "exported_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                  "adlm_model_version": adlm_model.__version__}
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}-", dir=dst.parent))
    try:
        save_pretrained(tmp, model, cfg, tokenizer_json=d / "tokenizer.json", special_tokens=specials.to_dict(),
                        meta=provenance)
        parameters = count_parameters(model)
        (tmp / "README.md").write_text(model_card(src, cfg, meta, parameters), encoding="utf-8")
        back, _, _ = load_pretrained(tmp)
        want, got = model.state_dict(), back.state_dict()
        if want.keys() != got.keys() or any(not want[k].equal(got[k]) for k in want):
            raise CheckpointError(f"the export of {uri} does not read back equal to the registered weights")
        _move_into(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ExportResult(out=dst, figures=figures_of(src.tags), parameters=parameters)
