"""GSM8K (``openai/gsm8k``, config ``main``) as reasoning rows: the steps are the solution's calculator
annotations (``<<16-3-4=9>>``, Coconut's format of the trace), the answer the text after ``####``.

``load_gsm8k`` loads a split through Hugging Face ``datasets`` exactly as an online user does, or local files
in GSM8K's own format (``{"question", "answer"}`` with the annotations and ``#### 18`` in the answer) through
``load_dataset("json", data_files=...)``.
"""

from __future__ import annotations

import re
from typing import Any

from pipelines.core.storage import hub_errors
from pipelines.data.reasoning.rows import ReasoningError, Row

HF_PATH = "openai/gsm8k"
HF_NAME = "main"
SPLITS = {"train": "train", "test": "test"}
"""Our split -> the hub's (GSM8K has no validation split; Coconut holds out part of train for it)."""

ANNOTATION = re.compile(r"<<([^<>]*)>>")


def parse_solution(solution: str, where: str = "GSM8K row") -> tuple[list[str], str]:
    """(steps, answer) of a GSM8K solution text: every ``<<...>>`` annotation in order, and the text after the
    last ``####`` with thousands separators dropped."""
    if "####" not in solution:
        raise ReasoningError(f"{where}: the answer has no '#### <number>' line (GSM8K's format)")
    body, _, final = solution.rpartition("####")
    answer = final.strip().replace(",", "")
    if not answer:
        raise ReasoningError(f"{where}: nothing after '####'")
    return [f"<<{a}>>" for a in ANNOTATION.findall(body)], answer


def parse_example(rec: dict[str, Any], where: str = "GSM8K row") -> Row:
    """A GSM8K record ``{question, answer}`` as a row ``{question, steps, answer}``."""
    if not isinstance(rec.get("question"), str) or not isinstance(rec.get("answer"), str):
        raise ReasoningError(f"{where}: GSM8K rows need question and answer texts")
    steps, answer = parse_solution(rec["answer"], where)
    return {"question": rec["question"].strip(), "steps": steps, "answer": answer}


def load_gsm8k(split: str, data_files: str | list[str] | None = None) -> list[Row]:
    """A split of GSM8K from the hub (``data_files`` None), or local JSON/JSONL files in its format."""
    # lazy: keeps datasets out of this module's import
    import datasets

    if data_files is None and split not in SPLITS:
        raise ReasoningError(f"gsm8k has no split {split!r}; it has {', '.join(SPLITS)}")
    try:
        if data_files is None:
            ds = datasets.load_dataset(HF_PATH, HF_NAME, split=SPLITS[split])
        else:
            ds = datasets.load_dataset("json", data_files=data_files, split="train")
    except hub_errors() as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ReasoningError(f"could not load {HF_PATH} from the Hugging Face Hub: {msg}; with no network pass "
                             "local files in GSM8K's format (--source train=PATH --reasoning task=gsm8k)") from e
    return [parse_example(rec, f"{HF_PATH} {split} row {i}") for i, rec in enumerate(ds)]
