"""Text in, text out: the one generator behind ``python -m pipelines.generate`` and the served MLflow model.

``TextGenerator`` holds a model (EMA weights, as ``checkpoint.load_checkpoint`` loads them by default), its
``tokenizers`` tokenizer (from ``tokenizer.json``) and its special ids. ``check`` validates a
``GenerationRequest`` and encodes it (cheap, before any network runs: one ``GenerationError`` line naming
the fix); ``generate`` samples with ``infill.infill`` and decodes. Both callers go through these two
methods, so the same request and seed give the same text from either.

Decoding: the new tokens are decoded in context (prompt + new + suffix ids together, then the decoded
prompt and suffix cut off), and the text is ``prompt + completion + suffix`` with the caller's own strings,
so it always starts with the prompt and ends with the suffix. For a byte-level BPE (GPT-2's, the demo's)
this is exactly the decoding of the whole row. The completion stops at the first EOS the model generated
(``stop_at_eos``, default on; off: the tokens after it are kept) and never shows a special token (BOS, EOS,
pad, mask, or any token the tokenizer marks special).

Sampler settings (``sampler``, ``threshold``, ``block``, ``refresh``, ``kv_cache``: ``confidence.py``) are
request fields like the others, validated by ``check``; every ``Generation`` reports the settings it used
(``settings``) and its network calls. ``cost`` bounds what a request may cost before it runs
(``limits.RequestLimits``: what the served model enforces).

The only dependencies are ``torch``, ``safetensors`` and ``tokenizers`` (imported lazily): the served model
ships this package and nothing of ``pipelines``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import numbers
import os
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..config import ConfigError, ModelConfig
from ..interop.checkpoint import CheckpointError, load_checkpoint
from ..kinds import count_parameters, get_sampler, model_kind
from ..sampling.confidence import OPTIONS as CONFIDENCE_OPTIONS
from ..sampling.confidence import check_options
from ..sampling.samplers import Progress, SamplerError, check_sample_args
from .infill import infill, plan_infill
from .limits import RequestLimits

SPECIAL_TOKENS_FILE = "special_tokens.json"
"""``{"bos_id", "eos_id", "pad_id", "mask_id"}`` beside the checkpoint of a registered model."""

DEFAULT_LENGTH = 64
DEFAULT_STEPS = 128
DEFAULT_NUCLEUS_P = 0.9
"""Defaults of a request: docs/design/method.md, section 4's reference nucleus; T kept small enough for a CPU."""


MAX_SEED = 2 ** 53
"""Seeds lie below 2**53: exact in a JSON number (a double), so a reported seed sent back reproduces the text."""


class GenerationError(ValueError):
    """A request that cannot be served (bad length, steps, sampler, text); the message says the fix."""


@dataclass(frozen=True)
class SpecialTokens:
    """The tokenizer's special ids that generation needs."""

    bos_id: int | None
    """Opens every row (training rows are BOS ... EOS); None: the rows have no BOS."""
    eos_id: int | None
    """Ends a document; kept visible in completions."""
    pad_id: int | None
    """Padding; dropped from completions (unless it is EOS)."""
    mask_id: int
    """The absorbing mask id; never part of a completion."""

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpecialTokens:
        def opt(k: str) -> int | None:
            return None if d.get(k) is None else int(d[k])

        return cls(bos_id=opt("bos_id"), eos_id=opt("eos_id"), pad_id=opt("pad_id"), mask_id=int(d["mask_id"]))

    def to_dict(self) -> dict[str, int | None]:
        return {"bos_id": self.bos_id, "eos_id": self.eos_id, "pad_id": self.pad_id, "mask_id": self.mask_id}


@dataclass(frozen=True)
class GenerationRequest:
    """What a caller asks for (one row of a served request, one ``pipelines.generate`` call)."""

    prompt: str = ""
    """Text the output starts with."""
    suffix: str = ""
    """Text the output ends with (infilling; not for AR)."""
    length: int = DEFAULT_LENGTH
    """Tokens generated between prompt and suffix."""
    steps: int | None = None
    """Diffusion steps T (per block for bd3lm; ignored by ar); None: the model's default (``TextGenerator.
    default_steps``: a distilled version's ``sampler_steps``, else ``DEFAULT_STEPS``)."""
    sampler: str | None = None
    """A sampler of ``adlm_model.SAMPLERS``; None: the model kind's default."""
    nucleus_p: float = DEFAULT_NUCLEUS_P
    """Top-p at every draw (1 = off)."""
    seed: int | None = None
    """Seed of the sampling generator; None: a fresh random one (reported in the result)."""
    num_samples: int = 1
    """Samples drawn together (one batch, one generator)."""
    threshold: float | None = None
    """``confidence`` sampler: unmask every position whose top probability exceeds it (default 0.9)."""
    block: int | None = None
    """``confidence`` sampler: semi-autoregressive block size, dividing ``length`` (default: one block); a block-wise
    sampler with a ``block_size`` option (``ssdlm``, ``bd3lm``): its block size."""
    refresh: int | None = None
    """``confidence`` sampler: steps between full passes of the approximate KV cache (1 = exact; default: the
    cache is off, or refreshed only when the block changes if ``kv_cache`` is set)."""
    kv_cache: str | None = None
    """``confidence`` sampler: ``off``, ``prefix`` or ``dual`` (default: ``dual`` when ``refresh`` is set)."""
    stop_at_eos: bool = True
    """Cut the completion at the first EOS the model generated (False: keep going; EOS never shows)."""


@dataclass(frozen=True)
class Generation:
    """One generated text and how it was made."""

    text: str
    """``prompt + completion + suffix``."""
    completion: str
    """The generated part alone."""
    new_tokens: int
    """Tokens generated (the request's length)."""
    seconds: float
    """Wall-clock seconds of the call that produced it (encoding, sampling, decoding)."""
    seed: int
    sampler: str
    steps: int
    """Diffusion steps T of the sampler's grid (per block for bd3lm); for a sampler without one (ar: one per
    token; confidence: until every position is decided) the iterations it ran, its network calls."""
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Every setting the sample was drawn with (sampler and its options, steps where the sampler takes them,
    nucleus, length, seed, EOS rule)."""
    network_calls: int = 0
    """Forward passes of the batch that produced it (AR with its KV cache: one per generated token)."""


@dataclass(frozen=True)
class _Checked:
    request: GenerationRequest
    sampler: str
    seed: int
    prompt_ids: list[int]
    suffix_ids: list[int]
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The sampler's options (the confidence settings, resolved)."""
    row: int = 0
    """Tokens of the whole row: BOS (when the kind puts it there), prompt, new tokens, suffix."""


def _number(name: str, value: Any) -> float | int:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise GenerationError(f"{name} must be a number, got {value!r}")
    return value


def _as_int(name: str, value: Any) -> int:
    v = _number(name, value)
    if isinstance(v, numbers.Integral):
        return int(v)
    if not math.isfinite(v) or v != int(v):
        raise GenerationError(f"{name} must be an integer, got {value!r}")
    return int(v)


def _load_tokenizer(path: Path) -> Any:
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception on a file it cannot read
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path} is not a readable tokenizer.json ({first}): restore the folder (export or "
                              "download it again)") from None
    tok.no_truncation()
    tok.no_padding()
    return tok


class TextGenerator:
    """A model, its tokenizer and special ids; ``check`` and ``generate`` requests (module docstring)."""

    def __init__(self, model: nn.Module, cfg: ModelConfig, tokenizer: Any, specials: SpecialTokens,
                 default_steps: int = DEFAULT_STEPS) -> None:
        if specials.mask_id != cfg.mask_id:
            raise CheckpointError(f"tokenizer mask id {specials.mask_id} differs from the model's {cfg.mask_id}: "
                                  "the tokenizer.json does not belong to this checkpoint")
        self.model, self.cfg, self.tokenizer, self.specials = model.eval(), cfg, tokenizer, specials
        self.default_steps = default_steps
        """The steps of a request that names none: a distilled version's ``sampler_steps``, else DEFAULT_STEPS."""
        self.device = next(model.parameters()).device
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.parameters = count_parameters(model)
        added = getattr(tokenizer, "get_added_tokens_decoder", lambda: {})()
        self.special_ids = {i for i, t in added.items() if getattr(t, "special", False)} | {
            i for i in (specials.bos_id, specials.eos_id, specials.pad_id, specials.mask_id, cfg.mask_id)
            if i is not None}

    @classmethod
    def from_dir(cls, directory: str | os.PathLike, *, specials: SpecialTokens | None = None,
                 device: str | torch.device = "auto") -> TextGenerator:
        """Load a checkpoint folder (``checkpoint`` layout, EMA weights when present) or an exported one
        (``pretrained``). Special ids: ``specials``, else ``special_tokens.json``, else the ``*_token_id``
        keys of an export's config.json."""
        d = Path(directory)
        if not (d / "tokenizer.json").is_file():
            raise CheckpointError(f"{d} has no tokenizer.json: generation needs the tokenizer the model was trained "
                                  "with (a registered version or a training checkpoint carries it)")
        specials = specials or read_special_tokens(d)
        if specials is None:
            raise CheckpointError(f"{d} names no special tokens ({SPECIAL_TOKENS_FILE} or config.json "
                                  "*_token_id): pass specials=SpecialTokens(...)")
        dev = resolve_device(device)
        tokenizer = _load_tokenizer(d / "tokenizer.json")  # before the weights: a bad file fails cheaply
        model, cfg, meta = load_checkpoint(d, map_location=dev)
        return cls(model, cfg, tokenizer, specials, cls.default_steps_of(meta))

    @staticmethod
    def default_steps_of(meta: dict[str, Any]) -> int:
        """The sampler's default step count a checkpoint's meta names (``sampler_steps``: a distilled student's,
        ``pipelines/training/distill.py``), else ``DEFAULT_STEPS``."""
        steps = meta.get("sampler_steps")
        return int(steps) if isinstance(steps, int) and steps >= 1 else DEFAULT_STEPS

    # -- requests -------------------------------------------------------------------------------------
    def request(self, *, exclude: tuple[str, ...] = (), **fields: Any) -> GenerationRequest:
        """A request from loose fields (a served row: missing or None fields take their defaults); a field
        ``GenerationRequest`` does not have (or one of ``exclude``) is refused with the known ones listed."""
        return parse_request(fields, exclude)

    def check(self, req: GenerationRequest) -> _Checked:
        """Validate and encode ``req`` (no network call); GenerationError names the problem and the fix."""
        validate_request(req)
        if req.steps is None:
            req = dataclasses.replace(req, steps=self.default_steps)
        sampler = req.sampler or model_kind(self.cfg.kind).default_sampler
        options = sampler_settings(req, sampler)
        prompt = req.prompt
        if prompt and model_kind(self.cfg.kind).prompt_space and not prompt.startswith(" "):
            prompt = " " + prompt  # the reference's convention (SSD-LM); the text still starts with the prompt given
        prompt_ids, suffix_ids = self._encode(prompt, "prompt"), self._encode(req.suffix, "suffix")
        try:
            layout = plan_infill(self.cfg, sampler, len(prompt_ids), req.length, len(suffix_ids), self.specials.bos_id,
                                 options)
        except (SamplerError, ConfigError) as e:
            raise GenerationError(str(e)) from e
        seed = req.seed if req.seed is not None else secrets.randbits(53)
        return _Checked(req, sampler, seed, prompt_ids, suffix_ids, options, layout.total)

    def cost(self, checked: _Checked) -> tuple[int, float]:
        """``(network calls, FLOPs)`` a checked request may cost at most: calls bound the sampler's forward
        passes (diffusion ``T + 1``, confidence one per new token, AR one per token), FLOPs are
        ``2 x parameters x rows x row length x calls`` (a KV cache only makes it cheaper)."""
        r = checked.request
        row = checked.row
        bound = get_sampler(checked.sampler).calls
        if bound is not None:  # the sampler's own bound (ssdlm: T a block), each pass over at most the context
            calls = bound(r.length, r.steps, checked.options)
            return calls, 2.0 * self.parameters * r.num_samples * min(row, self.cfg.seq_len) * calls
        calls = {"confidence": r.length, "ar": 1}.get(checked.sampler, r.steps + 1)
        return (r.length if checked.sampler == "ar" else calls), 2.0 * self.parameters * r.num_samples * row * calls

    def _encode(self, text: str, what: str) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids if text else []
        if self.cfg.mask_id in ids:
            raise GenerationError(f"the {what} contains the mask token "
                                  f"{self.tokenizer.id_to_token(self.cfg.mask_id)!r}: remove it")
        return ids

    def generate(self, req: GenerationRequest | _Checked, progress: Progress | None = None) -> list[Generation]:
        """``req.num_samples`` generations (seeded by ``req.seed``); see the module docstring."""
        t0 = time.perf_counter()
        c = req if isinstance(req, _Checked) else self.check(req)
        r = c.request
        g = torch.Generator(device=self.device).manual_seed(c.seed)
        stats: dict[str, Any] = {}
        ids = infill(self.model, self.cfg, c.prompt_ids, c.suffix_ids, new_tokens=r.length, steps=r.steps,
                     sampler=c.sampler, nucleus_p=r.nucleus_p, generator=g, num_samples=r.num_samples,
                     bos_id=self.specials.bos_id, progress=progress, stats=stats, **c.options)
        completions = [self.decode_between(c.prompt_ids, self.until_eos(row, r.stop_at_eos), c.suffix_ids)
                       for row in ids.cpu().tolist()]
        seconds = time.perf_counter() - t0
        calls = int(stats["network_calls"])
        # A sampler without a diffusion grid (ar, confidence) takes no ``steps``: it reports the iterations it
        # ran, and its settings do not list a T it never used.
        takes_steps = get_sampler(c.sampler).steps
        settings = {"sampler": c.sampler, **({"steps": r.steps} if takes_steps else {}), "nucleus_p": r.nucleus_p,
                    "length": r.length, "seed": c.seed, "stop_at_eos": r.stop_at_eos, **c.options}
        return [Generation(text=r.prompt + comp + r.suffix, completion=comp, new_tokens=r.length, seconds=seconds,
                           seed=c.seed, sampler=c.sampler, steps=r.steps if takes_steps else calls, settings=settings,
                           network_calls=calls) for comp in completions]

    def limits(self, environ: Mapping[str, str] | None = None) -> RequestLimits:
        """What one request to this model may cost (``adlm_model.inference.limits``; ``ADLM_MAX_*`` from ``environ``,
        default the process environment): the served model's limits and, unless lifted, the CLI's."""
        any_length = get_sampler(model_kind(self.cfg.kind).default_sampler).any_length
        return RequestLimits.for_model(self.cfg.seq_len, any_length=any_length, environ=environ)

    def until_eos(self, new_ids: list[int], stop: bool = True) -> list[int]:
        """``new_ids`` up to (without) the first EOS when ``stop``; all of them otherwise."""
        eos = self.specials.eos_id
        if stop and eos is not None and eos in new_ids:
            return new_ids[:new_ids.index(eos)]
        return new_ids

    def decode_between(self, prompt_ids: list[int], new_ids: list[int], suffix_ids: list[int]) -> str:
        """Text of ``new_ids`` as it reads between the prompt and the suffix, special tokens left out (module
        docstring)."""
        new = [i for i in new_ids if i not in self.special_ids and 0 <= i < self.vocab_size]

        def dec(ids: list[int]) -> str:
            return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""

        whole, head, tail = dec(prompt_ids + new + suffix_ids), dec(prompt_ids), dec(suffix_ids)
        if whole.startswith(head) and whole.endswith(tail) and len(whole) >= len(head) + len(tail):
            return whole[len(head):len(whole) - len(tail)]
        return dec(new)  # a decoder that merges across the boundaries: the new tokens alone


def parse_request(fields: dict[str, Any], exclude: tuple[str, ...] = ()) -> GenerationRequest:
    """``GenerationRequest`` from loose fields (``TextGenerator.request``): types checked, NaN/None = default."""
    known = [f.name for f in dataclasses.fields(GenerationRequest) if f.name not in exclude]
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise GenerationError(f"unknown field(s) {', '.join(unknown)}; known: {', '.join(known)}")
    given = {k: v for k, v in fields.items() if v is not None and not (isinstance(v, float) and math.isnan(v))}
    for k in ("length", "steps", "seed", "num_samples", "block", "refresh"):
        if k in given:
            given[k] = _as_int(k, given[k])
    for k in ("prompt", "suffix", "sampler", "kv_cache"):
        if k in given and not isinstance(given[k], str):
            raise GenerationError(f"{k} must be a string, got {type(given[k]).__name__}")
    for k in ("nucleus_p", "threshold"):
        if k in given:
            given[k] = float(_number(k, given[k]))
    if "stop_at_eos" in given:
        v = given["stop_at_eos"]
        if not isinstance(v, bool | int) or v not in (0, 1):  # numpy bools from a DataFrame compare equal too
            raise GenerationError(f"stop_at_eos must be true or false, got {v!r}")
        given["stop_at_eos"] = bool(v)
    return GenerationRequest(**given)


def sampler_settings(req: GenerationRequest, sampler: str) -> dict[str, Any]:
    """The sampler options a request sets (the confidence settings, resolved), or GenerationError when it sets
    them for a sampler that does not take them."""
    given = {k: getattr(req, k) for k in CONFIDENCE_OPTIONS if getattr(req, k) is not None}
    if sampler != "confidence" and set(given) == {"block"} and "block_size" in get_sampler(sampler).options:
        if req.block < 1:  # a block-wise sampler (ssdlm, bd3lm) takes ``block`` as its block size
            raise GenerationError(f"block must be >= 1, got {req.block}")
        return {"block_size": req.block}
    if sampler != "confidence":
        if given:
            raise GenerationError(f"{', '.join(given)} {'is a setting' if len(given) == 1 else 'are settings'} "
                                  f"of the confidence sampler, not of {sampler!r}: add sampler='confidence'")
        return {}
    try:
        return check_options(**given, span=req.length)
    except SamplerError as e:
        raise GenerationError(str(e)) from e


def validate_request(req: GenerationRequest) -> GenerationRequest:
    """The checks that need no model (counts, ranges, a known sampler, text that is text): run before loading one."""
    for what, text in (("prompt", req.prompt), ("suffix", req.suffix)):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # bytes a shell passed undecoded (surrogate escapes), or a lone surrogate
            raise GenerationError(f"the {what} is not valid UTF-8 text (character {e.start} cannot be encoded): "
                                  "pass UTF-8 text") from None
        except AttributeError:
            raise GenerationError(f"{what} must be a string, got {type(text).__name__}") from None
    if req.num_samples < 1:
        raise GenerationError(f"num_samples must be >= 1, got {req.num_samples}")
    if req.seed is not None and not 0 <= req.seed < MAX_SEED:
        raise GenerationError(f"seed must lie in [0, 2**53), got {req.seed}")
    try:
        check_sample_args(ModelConfig(), req.num_samples, req.length,
                          DEFAULT_STEPS if req.steps is None else req.steps, req.nucleus_p, torch.Generator())
        if req.sampler is not None:
            get_sampler(req.sampler)
    except SamplerError as e:
        raise GenerationError(str(e)) from e
    if req.sampler is not None:
        sampler_settings(req, req.sampler)
    return req


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``auto``: the GPU when there is one, else the CPU; ``cpu``, ``cuda`` or ``cuda:N`` when this machine has it,
    else GenerationError (one line, before any model is loaded)."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise GenerationError(f"device {str(device)[:40]!r} is not a device: use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise GenerationError(f"device {str(device)!r}: this machine has no CUDA device; use cpu (or auto)")
        if dev.index is not None and dev.index >= count:
            raise GenerationError(f"device {str(device)!r}: this machine has {count} CUDA device(s), cuda:0 to "
                                  f"cuda:{count - 1}")
    elif dev.type != "cpu":
        raise GenerationError(f"device {str(device)[:40]!r}: generation runs on cpu or cuda[:N] (or auto)")
    return dev


def read_special_tokens(directory: str | os.PathLike) -> SpecialTokens | None:
    """``special_tokens.json`` (a registered model) or an export's config.json ``*_token_id`` keys."""
    d = Path(directory)

    def read(f: Path) -> Any:
        try:
            return json.loads(f.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
            raise CheckpointError(f"{f} is not readable JSON ({type(e).__name__}): restore the folder (export or "
                                  "download it again)") from None

    def ids(values: Any, f: Path) -> SpecialTokens:
        try:
            return SpecialTokens.from_dict(values)
        except (KeyError, TypeError, ValueError, OverflowError):
            raise CheckpointError(f"{f} names no valid special token ids (bos, eos, pad: an integer or null; mask: "
                                  "an integer)") from None

    if (d / SPECIAL_TOKENS_FILE).is_file():
        return ids(read(d / SPECIAL_TOKENS_FILE), d / SPECIAL_TOKENS_FILE)
    cfg = read(d / "config.json") if (d / "config.json").is_file() else {}
    if isinstance(cfg, dict) and "mask_token_id" in cfg:
        return ids({k: cfg.get(f"{k[:-3]}_token_id") for k in ("bos_id", "eos_id", "pad_id", "mask_id")},
                   d / "config.json")
    return None


@functools.lru_cache(maxsize=4)
def _cached(path: str, device: str) -> TextGenerator:
    return TextGenerator.from_dir(path, device=device)


def load_generator(directory: str | os.PathLike, device: str = "auto") -> TextGenerator:
    """``TextGenerator.from_dir``, loaded once per process and folder (the served model loads on its first
    request and keeps the weights)."""
    return _cached(str(Path(directory).resolve()), str(resolve_device(device)))


__all__ = ["DEFAULT_LENGTH", "DEFAULT_NUCLEUS_P", "DEFAULT_STEPS", "MAX_SEED", "SPECIAL_TOKENS_FILE", "Generation",
           "GenerationError", "GenerationRequest", "SpecialTokens", "TextGenerator", "load_generator",
           "parse_request", "read_special_tokens", "resolve_device", "sampler_settings", "validate_request"]
