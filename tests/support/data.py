"""Shared helpers of the training and tuning tests: tiny real data made by ``pipelines.prepare_data``
(real text from the embedded corpus, a real trained BPE) and a tiny model config that fits it."""

from __future__ import annotations

from pathlib import Path

TINY_MODEL = ["model.hidden=32", "model.heads=2", "model.n_blocks=1", "model.denoiser_blocks=1", "model.cond_dim=16",
              "model.dropout=0.1"]


def make_tiny_data(root: Path, train_chars: int = 120_000, val_chars: int = 12_000, length: int = 32) -> Path:
    """Slices of the embedded corpus' train/validation text, tokenised by the real prepare_data with a
    512-entry BPE trained on the slice, rows of ``length``. Returns the output folder."""
    from pipelines.data.embedded import embedded_slices
    from pipelines.data.prepare import PrepareConfig, prepare

    files = embedded_slices(root, {"train": train_chars, "validation": val_chars})
    out_dir = root / "data"
    prepare(PrepareConfig(source=[f"{split}={p}" for split, p in files.items()], out=str(out_dir), train_tokenizer=512,
                 length=length))
    return out_dir


def data_overrides(data_dir: Path) -> list[str]:
    """--set assignments that point a recipe at ``data_dir`` and size the model to its manifest."""
    from pipelines.data.manifest import read_manifest

    m = read_manifest(data_dir / "train")
    return [f"data.train={data_dir / 'train'}", f"data.validation={data_dir / 'validation'}",
            *(f"model.{k}={v}" for k, v in m.model_overrides().items())]


def set_args(assignments: list[str]) -> list[str]:
    """``--set`` before each assignment: the command-line form of a list of overrides."""
    return [a for s in assignments for a in ("--set", s)]
