"""Every recipe in configs/ loads, names splits and a tokenizer its data source produces, and runs.

A recipe names its source and mode (``data.source``, ``data.mode``). Offline, the source itself cannot be
downloaded, so the run check prepares tiny data *by the same definition*: the source's split names, its
tokenizer (GPT-2, bert-base-uncased: the real vocabularies, offline), its mode and the recipe's own row length,
from text of the embedded corpus; then the recipe trains two steps with a scaled-down model. A recipe that
names a split, a tokenizer or a setting the pipeline does not produce fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from pipelines.data.sources import EMBEDDED, EMBEDDED_TOKENIZER_VOCAB, NAMED_SOURCES
from pipelines.training.config import load_config

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "configs").glob("*.yaml"))
STUDY_VOCAB = {Path(s["config"]).name: s["data"]["train_tokenizer"]
               for s in (yaml.safe_load(p.read_text()) for p in sorted((ROOT / "studies").glob("*.yaml")))
               if (s.get("data") or {}).get("train_tokenizer")}


def _source(name: str):
    return EMBEDDED if name == "embedded" else NAMED_SOURCES[name]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_names_what_its_source_produces(recipe: Path) -> None:
    from pipelines.data.tokenizer import load_tokenizer

    cfg = load_config(recipe)
    assert cfg.data.source, f"{recipe.name}: name the data source (data.source) it is for"
    if cfg.acot.arm:  # reasoning rows: the word-level vocabulary prepare_data gives the built-in names
        from pipelines.data.reasoning import prosqa
        from pipelines.data.reasoning.source import SPECIALS, SPLITS, word_tokenizer

        vocab = yaml.safe_load(word_tokenizer(prosqa.generate(300, 0, prosqa.ProsQAConfig(nodes=10))))["model"]["vocab"]
        assert (cfg.model.vocab_size, cfg.model.mask_id) == (len(vocab), SPECIALS.index("<mask>")), recipe.name
        assert {Path(cfg.data.train).name, Path(cfg.data.validation).name} <= set(SPLITS)
        return
    if cfg.data.source == "testbed":  # generated: the default language's ids and length
        from adlm_model.testbed.language import MASK_ID, Testbed

        tb = Testbed()
        assert (cfg.model.vocab_size, cfg.model.mask_id, cfg.model.seq_len) == (tb.vocab_size, MASK_ID, tb.length)
        assert {Path(cfg.data.train).name, Path(cfg.data.validation).name} <= {"train", "validation", "test"}
        return
    src = _source(cfg.data.source)
    mode = cfg.data.mode or src.mode
    for split in ("train", "validation"):
        path = getattr(cfg.data, split)
        assert Path(path).name in src.splits, f"{recipe.name}: data.{split} {path} is no split of {src.name}"
    if src is EMBEDDED:
        # The embedded default BPE, or the size a study trains for the recipe (studies/*.yaml, data.train_tokenizer).
        assert cfg.model.vocab_size == STUDY_VOCAB.get(recipe.name, EMBEDDED_TOKENIZER_VOCAB), recipe.name
    else:
        tok = load_tokenizer(src.tokenizer)
        assert (cfg.model.vocab_size, cfg.model.mask_id) == (tok.vocab_size, tok.mask_id), recipe.name
        assert mode in ("wrap", "pad")


def _texts(out: Path, src_mode: str) -> dict[str, Path]:
    """Text of the embedded corpus, one document a line; sentences for the one-sentence-a-row (pad) mode."""
    from pipelines.data.embedded import embedded_slices

    files = embedded_slices(out / "raw", {"train": 40_000, "validation": 24_000, "test": 24_000})  # 1024-token rows
    if src_mode != "pad":
        return {k: Path(v) for k, v in files.items()}
    out_files = {}
    for split, f in files.items():
        sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", Path(f).read_text()) if 20 < len(s.strip()) < 160]
        p = out / f"{split}-sentences.txt"
        p.write_text("\n".join(sentences) + "\n")
        out_files[split] = p
    return out_files


SCALED = ["model.hidden=32", "model.heads=2", "model.n_blocks=1", "model.denoiser_blocks=1", "model.cond_dim=16",
          "run.max_steps=2", "run.val_every=1", "run.ckpt_every=2", "run.log_every=1", "run.val_batches=1",
          "run.clip_search_batches=1", "batch.global_batch=1", "batch.micro_batch=1", "scaling.num_workers=0",
          "scaling.use_gpu=false", "scaling.bf16=false", "optim.warmup_steps=1", "mlflow.register=false"]


class PreparedData:
    """Data prepared once per definition (source and splits, mode, row length, tokenizer): recipes that share a
    definition (a corpus' ADLM, MDLM and AR recipes) train on copies of one prepared folder."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.done: dict[tuple, tuple[Path, dict[str, int]]] = {}
        """Definition -> (prepared folder, each split's vocabulary size)."""
        self.tracking_uri = f"sqlite:///{root / 'mlflow.db'}"
        """One MLflow store for the module's runs (each recipe's run has a name of its own): a new sqlite store is
        a second or two of schema migrations, paid once rather than per recipe."""

    def copy_to(self, data_dir: Path, key: tuple, make) -> dict[str, int]:
        """``make(folder)`` (returns {split: manifest}) the first time ``key`` is seen, then the folder copied to
        ``data_dir``; returns each split's vocabulary size."""
        import shutil

        if key not in self.done:
            folder = self.root / f"def{len(self.done)}"
            self.done[key] = (folder, {k: m.vocab_size for k, m in make(folder).items()})
        folder, vocab = self.done[key]
        shutil.copytree(folder, data_dir)
        return vocab


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> PreparedData:
    return PreparedData(tmp_path_factory.mktemp("prepared"))


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_runs_on_tiny_data_prepared_by_its_own_definition(recipe: Path, tmp_path: Path, ray_session,
                                                                  one_torch_thread, prepared: PreparedData) -> None:
    from pipelines.data.prepare import PrepareConfig, prepare
    from pipelines.training.trainer import train

    raw = yaml.safe_load(recipe.read_text())
    cfg = load_config(recipe)
    if cfg.acot.arm:  # a fine-tuning on reasoning rows: the recipe's rows (its comment's options), one short stage
        from pipelines.prepare_data import main as prepare_main
        from pipelines.training.acot_run import finetune

        out = tmp_path / "work" / Path(cfg.data.train).parent
        assert prepare_main(["--source", cfg.data.source, "--reasoning", "nodes=10", "--reasoning", "min_path=2",
                             "--reasoning", "train_rows=300", "--reasoning", "validation_rows=4", "--split", "train", "--split", "validation", "--out", str(out),
                             "-q"]) == 0
        res = finetune(load_config(recipe, ["model.hidden=16", "model.n_blocks=1", "acot.max_ant=0",
                                            "acot.epochs_per_stage=1", "mlflow.register=false",
                                            f"run.name=recipe-{recipe.stem}"]),
                       workdir=str(tmp_path / "work"), tracking_uri=prepared.tracking_uri)
        assert res.total == 4 and 0 <= res.accuracy <= 1
        return
    if cfg.data.source == "testbed":
        prepared.copy_to(tmp_path / "work" / Path(cfg.data.train).parent, ("testbed",), lambda out: prepare(
            PrepareConfig(source=["testbed"], out=str(out),
                 testbed=dict(train_rows=64, validation_rows=8, test_rows=8, entropy_rows=200))))
        uri = prepared.tracking_uri
        res = train(load_config(recipe, SCALED + [f"run.name=recipe-{recipe.stem}"]), workdir=str(tmp_path / "work"),
                    tracking_uri=uri)
        assert res.step == 2 and res.val_ppl == res.val_ppl
        return
    src = _source(cfg.data.source)
    mode = cfg.data.mode or src.mode
    wd = tmp_path / "work"
    data_dir = wd / Path(cfg.data.train).parent
    splits = sorted({Path(cfg.data.train).name, Path(cfg.data.validation).name})
    tokenizer = {"train_tokenizer": EMBEDDED_TOKENIZER_VOCAB} if src is EMBEDDED else {"tokenizer": src.tokenizer}

    def make(out: Path) -> dict:
        texts = _texts(out.parent / f"{out.name}-text", mode)
        return prepare(PrepareConfig(source=[f"{s}={texts['train' if s == 'train' else 'validation']}" for s in splits],
                                  out=str(out), mode=mode, length=cfg.model.seq_len, **tokenizer))

    key = (cfg.data.source, tuple(splits), mode, cfg.model.seq_len, tuple(sorted(tokenizer.items())))
    vocab = prepared.copy_to(data_dir, key, make)
    sets = SCALED + [f"run.name=recipe-{recipe.stem}"]
    if src is EMBEDDED:
        # 40k characters cannot fill an 8,192-entry BPE (the static test checks the recipe's size against the
        # source's): the model takes the tiny tokenizer's size, everything else is the recipe's.
        sets.append(f"model.vocab_size={vocab['train']}")
    uri = prepared.tracking_uri
    res = train(load_config(recipe, sets), workdir=str(wd), tracking_uri=uri)
    assert res.step == 2 and res.val_ppl is not None and res.val_ppl == res.val_ppl  # finite, not NaN
    assert raw["model"].get("kind", "adlm") == cfg.model.kind
