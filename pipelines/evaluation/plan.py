"""Planning an evaluation: every check that can fail on bad input, before weights are loaded or Ray starts.

``plan_evaluation`` resolves the model (a ``models:/`` URI, downloaded once into the cache, or a checkpoint
folder), the prepared splits and zero-shot sets (each must fit the model), the sampler and its options,
the evaluation LM and the MAUVE featurizer.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipelines.evaluation.config import EvalConfig, EvalError, parse_suite, resolve_sampler, sampler_options
from pipelines.storage import (
    cache_dir,
    download_dir,
    exists,
    is_uri,
    join,
    list_dir,
    name_of,
    parent_of,
    resolve_workdir,
)


@dataclass
class ModelRef:
    """What ``--model`` named: a URI and the local checkpoint directory it resolves to."""

    uri: str
    local_dir: str
    name: str | None = None
    version: str | None = None
    run_id: str | None = None
    """Training run of a registered version."""

    @property
    def pinned(self) -> str:
        """The URI that names exactly this model on any node: ``models:/NAME/VERSION`` (an alias could move
        while an evaluation runs) or the checkpoint location as given."""
        return f"models:/{self.name}/{self.version}" if self.version else self.uri


@dataclass
class Dataset:
    """One split scored by ``ppl`` / ``zero_shot``."""

    label: str
    """``validation``, ``test`` or ``zero_shot/NAME``."""
    split_dir: str
    rows: int
    tokens: int
    manifest_hash: str
    source: str


@dataclass
class Plan:
    """Everything checked before the expensive work."""

    ref: ModelRef
    model_cfg: Any
    meta: dict[str, Any]
    suite: tuple[str, ...]
    cfg: EvalConfig
    datasets: list[Dataset]
    tokenizer: Any = None
    sampler: str = ""
    sampler_kwargs: dict[str, Any] = field(default_factory=dict)
    length: int = 0
    steps: int = 0
    """Sampling steps T for this model's kind (``steps_by_kind``, else ``steps``)."""
    reference_split: str | None = None
    tracking_uri: str | None = None
    workdir: str | None = None


def resolve_model_ref(model: str, tracking_uri: str | None, cache: str | os.PathLike | None = None) -> ModelRef:
    """A local folder of ``model`` on this node: a ``models:/`` URI or a checkpoint in an object store is
    downloaded once into the node's cache (``cache``, default ``storage.cache_dir()``); a local checkpoint
    folder is used as it is. Every node resolves for itself: the driver plans with it, and each evaluation
    task loads its model with it where it runs. A registered version is an MLflow Model whose checkpoint is a
    folder inside it (``registry.checkpoint_of``)."""
    from pipelines.registry import RegistryError, checkpoint_of, download_version, get_version, resolve_model

    models = Path(cache) / "models" if cache else cache_dir(None, "models")
    if is_uri(model):
        dst = models / ("ckpt-" + hashlib.sha256(model.encode()).hexdigest()[:16])
        if not (dst / "config.json").is_file():
            tmp = Path(tempfile.mkdtemp(prefix=".ckpt-", dir=models))
            try:
                download_dir(model, tmp)
                if not (tmp / "config.json").is_file():
                    raise EvalError(f"{model} is not a checkpoint: no config.json (pass a checkpoint folder or a "
                                    "models:/ URI)")
                _settle(tmp, dst)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return ModelRef(uri=model, local_dir=str(dst))
    if not model.startswith("models:/"):
        return ModelRef(uri=model, local_dir=str(resolve_model(model, tracking_uri)))
    mv = get_version(model, tracking_uri)

    def cached() -> Path | None:
        try:
            return checkpoint_of(dst) if dst.is_dir() else None
        except RegistryError:
            return None

    # Keyed by the version's identity, not only its number: the cache (ADLM_CACHE) may be shared by several
    # tracking stores, and a recreated registry numbers its versions from 1 again.
    ident = hashlib.sha256(f"{tracking_uri}|{mv.source}|{mv.run_id}".encode()).hexdigest()[:12]
    dst = models / f"{mv.name}-v{mv.version}-{ident}"
    if cached() is None:
        uri = f"models:/{mv.name}/{mv.version}"
        # Downloaded beside its final place, so the rename is atomic (same filesystem) and nothing is left in /tmp.
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{mv.name}-v{mv.version}-", dir=dst.parent))
        try:
            local = download_version(uri, tracking_uri, dst=tmp)
            checkpoint_of(local)  # a version without a checkpoint fails here, not as a half-filled cache entry
            try:
                os.replace(local, dst)
            except OSError:
                if cached() is None:  # not a concurrent download that won: a real failure
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return ModelRef(uri=model, local_dir=str(checkpoint_of(dst)), name=mv.name, version=str(mv.version),
                    run_id=mv.run_id)


def _settle(local: str | os.PathLike, dst: Path) -> None:
    """Move a downloaded folder into its cache entry (same filesystem: atomic); a concurrent download that
    won is fine, any other failure is raised."""
    try:
        os.replace(local, dst)
    except OSError:
        if not (dst / "config.json").is_file():
            raise


def _under_workdir(path: str, workdir: str | os.PathLike | None) -> str:

    if is_uri(path) or path.startswith("file://") or Path(path).is_absolute():
        return path
    p = Path(path).expanduser()
    return str(p.resolve()) if p.exists() else join(resolve_workdir(workdir), path)


def _has_manifest(d: str) -> bool:
    from pipelines.data.manifest import MANIFEST_NAME

    return exists(join(d, MANIFEST_NAME))


def data_dir_for(cfg: EvalConfig, meta: dict[str, Any], workdir: str | os.PathLike | None) -> str | None:
    """The prepared data folder: ``data=`` or the checkpoint's training data."""
    if cfg.data:
        return _under_workdir(cfg.data, workdir)
    val = ((meta.get("train_config") or {}).get("data") or {}).get("validation")
    if val:
        return parent_of(_under_workdir(val, workdir))
    return None


def discover_zero_shot(entries: Sequence[str], workdir: str | os.PathLike | None) -> list[tuple[str, str]]:
    """(name, split_dir) of every zero-shot set named by ``entries`` (see ``EvalConfig.zero_shot``).

    An entry is ``NAME=DIR`` or ``DIR``; DIR is a split folder (holds ``manifest.json``), a prepared data
    folder (its ``test`` split, else ``validation``, else its only split) or a folder of data folders.
    """
    found: list[tuple[str, str]] = []

    def split_of(d: str) -> str | None:
        for split in ("test", "validation"):
            if _has_manifest(join(d, split)):
                return join(d, split)
        splits = [join(d, c) for c in list_dir(d) if _has_manifest(join(d, c))]
        return splits[0] if len(splits) == 1 else None

    for entry in entries:
        name, path = entry.split("=", 1) if "=" in entry else ("", entry)
        d = _under_workdir(path, workdir)
        if _has_manifest(d):
            base = name_of(parent_of(d)) if name_of(d) in ("train", "validation", "test") else name_of(d)
            found.append((name or base, d))
            continue
        one = split_of(d)
        if one:
            found.append((name or name_of(d), one))
            continue
        many = [(c, split_of(join(d, c))) for c in list_dir(d)]
        many = [(n, sd) for n, sd in many if sd]
        if not many:
            raise EvalError(f"zero-shot set {entry!r}: no prepared split under {d}; prepare it with "
                            "python -m pipelines.prepare_data --source NAME --out DIR and pass DIR")
        found.extend(((f"{name}.{n}" if name else n), sd) for n, sd in many)
    names = [n for n, _ in found]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise EvalError(f"zero-shot sets named twice: {', '.join(dup)}; name them with NAME=DIR")
    return found


def plan_evaluation(model: str, suite: str | Sequence[str], cfg: EvalConfig, *, workdir: str | os.PathLike | None = None,
                    tracking_uri: str | None = None) -> Plan:
    """Every check that can fail on bad input, before any weights are loaded or Ray starts."""
    from adlm_model.checkpoint import read_config
    from pipelines.data.manifest import read_manifest
    from pipelines.tracking import resolve_tracking_uri

    cfg.validate()
    suite = parse_suite(suite)
    if tracking_uri is None and (model.startswith("models:/") or cfg.eval_lm.startswith("models:/")):
        tracking_uri = resolve_tracking_uri(workdir)
    wd = resolve_workdir(workdir)
    ref = resolve_model_ref(model, tracking_uri, None if is_uri(wd) else cache_dir(wd))
    model_cfg, meta = read_config(ref.local_dir)
    datasets: list[Dataset] = []
    data = data_dir_for(cfg, meta, workdir)

    def add(label: str, split_dir: str) -> None:
        m = read_manifest(split_dir)
        m.check_fits(model_cfg, meta.get("tokenizer_hash"))
        datasets.append(Dataset(label=label, split_dir=m.split_dir, rows=m.rows, tokens=m.tokens,
                                manifest_hash=m.content_hash(), source=m.source))

    needs_data = "ppl" in suite or "mauve" in suite
    if needs_data and not data:
        raise EvalError(f"no data: checkpoint {ref.local_dir} does not name its training data; pass "
                        "--set data=DIR (a folder written by python -m pipelines.prepare_data)")
    if "ppl" in suite:
        splits = list(cfg.splits)
        if splits == ["auto"]:
            splits = [s for s in ("validation", "test") if _has_manifest(join(data, s))]
            if not splits:
                raise EvalError(f"no validation or test split under {data}; pass --set data=DIR of prepared data")
        for s in splits:
            add(s, join(data, s) if not _has_manifest(s) else s)
    if "zero_shot" in suite:
        if not cfg.zero_shot:
            raise EvalError("suite zero_shot needs the prepared zero-shot sets: --set zero_shot=NAME=DIR,... "
                            "(python -m pipelines.prepare_data --source wikitext2 ... --out DIR)")
        for name, split_dir in discover_zero_shot(cfg.zero_shot, workdir):
            add(f"zero_shot/{name}", split_dir)
    plan = Plan(ref=ref, model_cfg=model_cfg, meta=meta, suite=suite, cfg=cfg, datasets=datasets,
                tracking_uri=tracking_uri, workdir=resolve_workdir(workdir))
    if "generate" in suite:
        from adlm_model.kinds import check_sampler_options
        from adlm_model.samplers import SamplerError
        from pipelines.evaluation.eval_lm import checkpoint_tokenizer

        plan.tokenizer = checkpoint_tokenizer(ref.local_dir, meta)
        plan.sampler = resolve_sampler(cfg.sampler, model_cfg.kind)
        plan.length = cfg.sample_length or model_cfg.seq_len
        try:  # the confidence sampler's block must divide the length
            sampler = check_sampler_options(plan.sampler, cfg.sampler_kwargs, length=plan.length)
        except SamplerError as e:
            raise EvalError(f"{e} (sampler=auto picks the model kind's default)") from e
        plan.sampler_kwargs = sampler_options(plan.sampler, cfg.sampler_kwargs, plan.tokenizer)
        plan.steps = int(cfg.steps_by_kind.get(model_cfg.kind, cfg.steps))
        if not sampler.any_length and plan.length > model_cfg.seq_len:
            raise EvalError(f"sample_length {plan.length} exceeds the model's seq_len {model_cfg.seq_len}; only the "
                            "bd3lm sampler generates beyond it")
    if "gen_ppl" in suite:
        from pipelines.evaluation.eval_lm import check_eval_lm

        check_eval_lm(cfg.eval_lm, tracking_uri=tracking_uri)
    if "mauve" in suite:
        from pipelines.evaluation.eval_lm import check_featurizer
        from pipelines.evaluation.metrics import check_mauve_inputs

        ref_dir = cfg.mauve_reference_split
        ref_dir = ref_dir if _has_manifest(ref_dir) else join(data, ref_dir)
        m = read_manifest(ref_dir)
        m.check_fits(model_cfg, meta.get("tokenizer_hash"))
        check_mauve_inputs(cfg.num_samples, m.rows, cfg.mauve_min_samples)
        check_featurizer(cfg.mauve_featurizer)
        plan.reference_split = m.split_dir
    return plan


def ppl_key(dataset: Dataset, cfg: EvalConfig) -> str:
    """Identity of a perplexity figure: same key, same number (data, rows, batch size, draws, seed, EMA)."""
    rows = min(cfg.max_rows, dataset.rows) if cfg.max_rows else dataset.rows
    # "spread": a subset is spread over the split (reader.spread_indices), not its first rows as before.
    return (f"{dataset.manifest_hash[:16]}:rows={rows}{'-spread' if rows < dataset.rows else ''}:bs={cfg.batch_size}:draws={cfg.t_draws}:seed={cfg.seed}"
            f":ema={int(cfg.use_ema)}")
