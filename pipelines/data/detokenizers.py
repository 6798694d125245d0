"""Detokenizers of the named evaluation sets (docs/design/method.md, section 5), as the MDLM/ADLM reference applies them.

Wikitext, PTB and LM1B ship pre-tokenised text (``don 't`` , ``@-@`` , ``<unk>``); the reference undoes
that before GPT-2 / BERT tokenisation so the models see natural text. The rules below are the
reference's, rule for rule (including its quirks, e.g. PTB's ``<unk>`` becoming ``?`` and Wikitext's
`` N `` becoming `` 1 ``): perplexities are only comparable with the same preprocessing.
"""

from __future__ import annotations

import re
from collections.abc import Callable


def wikitext_detokenizer(string: str) -> str:
    """Wikitext-2/103 (raw): ``@-@`` number separators, spaced punctuation and brackets, ``= =`` headings."""
    # contractions
    string = string.replace("s '", "s'")
    string = re.sub(r"/' [0-9]/", r"/'[0-9]/", string)
    # number separators
    string = string.replace(" @-@ ", "-")
    string = string.replace(" @,@ ", ",")
    string = string.replace(" @.@ ", ".")
    # punctuation
    string = string.replace(" : ", ": ")
    string = string.replace(" ; ", "; ")
    string = string.replace(" . ", ". ")
    string = string.replace(" ! ", "! ")
    string = string.replace(" ? ", "? ")
    string = string.replace(" , ", ", ")
    # double brackets
    string = re.sub(r"\(\s*([^\)]*?)\s*\)", r"(\1)", string)
    string = re.sub(r"\[\s*([^\]]*?)\s*\]", r"[\1]", string)
    string = re.sub(r"{\s*([^}]*?)\s*}", r"{\1}", string)
    string = re.sub(r"\"\s*([^\"]*?)\s*\"", r'"\1"', string)
    string = re.sub(r"'\s*([^']*?)\s*'", r"'\1'", string)
    # miscellaneous
    string = string.replace("= = = =", "====")
    string = string.replace("= = =", "===")
    string = string.replace("= =", "==")
    string = string.replace(" " + chr(176) + " ", chr(176))
    string = string.replace(" \n", "\n")
    string = string.replace("\n ", "\n")
    string = string.replace(" N ", " 1 ")
    string = string.replace(" 's", "'s")
    return string


def ptb_detokenizer(x: str) -> str:
    """Penn Treebank (``ptb_text_only``): contractions, ``\\/``, ``N`` numbers, ``<unk>``."""
    x = x.replace(" 's", "'s")
    x = x.replace("s ' ", "s' ")
    x = x.replace(" n't", "n't")
    x = x.replace(" \n ", "\n")
    x = x.replace("\\/", "/")
    for _ in range(10):
        x = x.replace(" N ", " 1 ")
    x = x.replace("$ 1", "$1")
    x = x.replace("# 1", "#1")
    x = x.replace("<unk>", "?")
    return x


def lm1b_detokenizer(x: str) -> str:
    """One Billion Words: URLs, apostrophes, sentence punctuation, quotes and brackets, currency."""
    x = x.replace("http : / / ", "http://")
    x = x.replace("https : / / ", "https://")
    x = re.sub(r" \'(\w+)", r"'\1", x)
    x = re.sub(r" (\w+) \. ", r" \1. ", x)
    x = re.sub(r" (\w+) \.$", r" \1.", x)
    x = x.replace(" ? ", "? ")
    x = re.sub(r" \?$", "?", x)
    x = x.replace(" ! ", "! ")
    x = re.sub(r" \!$", "!", x)
    x = x.replace(" , ", ", ")
    x = x.replace(" : ", ": ")
    x = x.replace(" ; ", "; ")
    x = x.replace(" / ", "/")
    x = re.sub(r"\" ([^\"]+) \"", r'"\1"', x)
    x = re.sub(r"\' ([^\']+) \'", r"'\1'", x)
    x = re.sub(r"\( ([^\(\)]+) \)", r"(\1)", x)
    x = re.sub(r"\[ ([^\[\]]+) \]", r"[\1]", x)
    x = x.replace("$ ", "$")
    x = x.replace("£ ", "£")
    return x


def lambada_detokenizer(text: str) -> str:
    """LAMBADA: curly double quotes to straight ones, a leading newline (the reference's document separator)."""
    text = text.replace("\u201c", '"')
    text = text.replace("\u201d", '"')
    return "\n" + text.strip()


def scientific_papers_detokenizer(x: str) -> str:
    """arXiv / PubMed (``scientific_papers``): the Wikitext rules, then the LM1B rules."""
    return lm1b_detokenizer(wikitext_detokenizer(x))


DETOKENIZERS: dict[str, Callable[[str], str]] = {
    "wikitext": wikitext_detokenizer,
    "ptb": ptb_detokenizer,
    "lm1b": lm1b_detokenizer,
    "lambada": lambada_detokenizer,
    "scientific_papers": scientific_papers_detokenizer,
}
"""Detokenizers by name (``--detokenizer`` and the named sources use these names)."""


def get_detokenizer(name: str | None) -> Callable[[str], str] | None:
    """The detokenizer called ``name`` (None or ``none``: no detokenisation); ValueError lists the known ones."""
    if name is None or name == "none":
        return None
    try:
        return DETOKENIZERS[name]
    except KeyError:
        raise ValueError(f"unknown detokenizer {name!r}; known: none, {', '.join(sorted(DETOKENIZERS))}") from None
