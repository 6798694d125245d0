"""The machinery of ``python -m pipelines.generate``: find the model, load it once, generate with a progress bar.

``open_generator`` accepts what users have at hand:

- ``models:/NAME@ALIAS`` or ``models:/NAME/VERSION``: the version is downloaded once into the cache that
  evaluation uses (``pipelines.tracking.registry.resolve_model_ref``) and its checkpoint loaded;
- a checkpoint folder written by training, a downloaded MLflow Model folder (holds ``MLmodel``), or a folder
  written by ``python -m pipelines.export``.

The special ids come from the folder (``special_tokens.json`` of a registered version, ``*_token_id`` of an
export) or, for a bare training checkpoint, from its ``tokenizer.json`` through ``pipelines.data.tokenizer``
(the same resolution the registered model recorded). Generation itself is ``adlm_model.inference.textgen``: the
served model runs the same code, so the same request and seed give the same text.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from adlm_model.inference.textgen import (
    Generation,
    GenerationRequest,
    SpecialTokens,
    TextGenerator,
    read_special_tokens,
)
from pipelines.core.storage import cache_dir, is_uri, resolve_workdir
from pipelines.data.tokenizer import load_tokenizer
from pipelines.tracking.registry import RegistryError, checkpoint_of, resolve_model_ref
from pipelines.tracking.runs import resolve_tracking_uri


@dataclass(frozen=True)
class LoadedModel:
    """A generator and where it came from."""

    generator: TextGenerator
    uri: str
    """What the user passed (a models:/ URI or a folder)."""
    checkpoint_dir: str
    """The local folder the weights were loaded from."""


def checkpoint_folder(model: str, *, tracking_uri: str | None = None,
                      workdir: str | os.PathLike | None = None) -> Path:
    """The local checkpoint folder of a ``models:/`` URI or a folder (module docstring), or a one-line error."""
    if model.startswith("models:/"):
        wd = resolve_workdir(workdir)  # once: the tracking store's default and the cache of downloaded versions
        uri = tracking_uri or resolve_tracking_uri(wd)
        cache = None if is_uri(wd) else cache_dir(wd)
        return Path(resolve_model_ref(model, uri, cache).local_dir)
    p = Path(model).expanduser()
    if not p.is_dir():
        raise RegistryError(f"--model {model}: neither a models:/ URI nor a folder; pass models:/NAME@ALIAS, "
                            "a checkpoint folder or an exported model folder")
    return checkpoint_of(p)


def special_tokens_of(d: Path) -> SpecialTokens | None:
    """The folder's recorded special ids, else those ``pipelines.data.tokenizer`` finds in its tokenizer.json."""
    specials = read_special_tokens(d)
    if specials is None and (d / "tokenizer.json").is_file():
        tok = load_tokenizer(str(d / "tokenizer.json"))
        specials = SpecialTokens(bos_id=tok.bos_id, eos_id=tok.eos_id, pad_id=tok.pad_id, mask_id=tok.mask_id)
    return specials


def open_generator(model: str, *, tracking_uri: str | None = None, workdir: str | os.PathLike | None = None,
                   device: str = "auto") -> LoadedModel:
    """Load the model ``model`` names for generation (module docstring)."""
    d = checkpoint_folder(model, tracking_uri=tracking_uri, workdir=workdir)
    return LoadedModel(TextGenerator.from_dir(d, specials=special_tokens_of(d), device=device), model, str(d))


def progress_bar(enabled: bool) -> tuple[Callable[[int, int], None], Callable[[], None]]:
    """A tqdm bar over sampling steps (diffusion steps, AR tokens or BD3-LM blocks) as ``(update, close)``."""
    # lazy: keeps tqdm out of this module's import
    from tqdm.auto import tqdm

    bar: dict[str, Any] = {}

    def update(step: int, total: int) -> None:
        if "bar" not in bar:
            bar["bar"] = tqdm(total=total, desc="sampling", unit="step", disable=not enabled, leave=False)
        b = bar["bar"]
        b.update(step - b.n)

    def close() -> None:
        if "bar" in bar:
            bar["bar"].close()

    return update, close


def run_generation(loaded: LoadedModel, request: GenerationRequest, *, progress: bool = True,
                   limits: bool = True) -> list[Generation]:
    """Check ``request`` (one line on bad input, before any network call) and, with ``limits``, its cost against
    the served model's limits (``adlm_model.inference.limits``: ``LimitError``), then generate."""
    gen = loaded.generator
    if limits:
        gen.limits().check_text(None, len(request.prompt) + len(request.suffix))  # before the text is tokenized
    checked = gen.check(request)
    if limits:
        bounds = gen.limits()
        bounds.check_request(request.num_samples, 0.0, what="samples")
        bounds.check_row(None, request.steps, request.length)
        bounds.check_request(request.num_samples, gen.cost(checked)[1], what="samples")
    update, close = progress_bar(progress)
    try:
        return loaded.generator.generate(checked, progress=update)
    finally:
        close()


def as_json_rows(loaded: LoadedModel, generations: list[Generation]) -> list[dict[str, Any]]:
    """What ``--json`` prints: one object per sample."""
    return [{**asdict(g), "model": loaded.uri} for g in generations]
