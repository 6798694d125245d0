"""Each named set's detokenizer on known strings (the reference's rules)."""

from __future__ import annotations

import pytest

from pipelines.data.detokenizers import (
    get_detokenizer,
    lambada_detokenizer,
    lm1b_detokenizer,
    ptb_detokenizer,
    scientific_papers_detokenizer,
    wikitext_detokenizer,
)


def test_wikitext() -> None:
    s = " = = Early life = = \n The population was 1 @,@ 234 in 2 @.@ 5 km ( 1 mile ) , a well @-@ known town . \n"
    assert wikitext_detokenizer(s) == \
        " == Early life ==\nThe population was 1,234 in 2.5 km (1 mile), a well-known town.\n"
    assert wikitext_detokenizer('He said " hello " to the king \'s men') == "He said \"hello\" to the king's men"


def test_ptb() -> None:
    assert ptb_detokenizer("the company 's shares rose N N to $ N and it did n't <unk> a\\/b") == \
        "the company's shares rose 1 1 to $1 and it didn't ? a/b"


def test_lm1b() -> None:
    assert lm1b_detokenizer('He said " it is n \'t fair , really " ( see http : / / example.com ) .') == \
        "He said \"it is n't fair, really\" (see http://example.com) ."  # the reference joins " ." only after a word
    assert lm1b_detokenizer("Prices rose to $ 5 and £ 3 ; why ?") == "Prices rose to $5 and £3; why?"


def test_lambada() -> None:
    assert lambada_detokenizer("  \u201cYes,\u201d she said.  ") == '\n"Yes," she said.'


def test_scientific_papers() -> None:
    assert scientific_papers_detokenizer("we use a 3 @-@ layer network ( see fig . 1 ) , as in [ 2 ] .") == \
        "we use a 3-layer network (see fig. 1), as in [2] ."


def test_lookup() -> None:
    assert get_detokenizer("none") is None and get_detokenizer(None) is None
    assert get_detokenizer("ptb") is ptb_detokenizer
    with pytest.raises(ValueError, match="unknown detokenizer 'xx'; known: none, lambada, lm1b, ptb"):
        get_detokenizer("xx")
