"""A ProntoQA-like generator: a k-hop chain of fictional concepts with a property at its end, a distractor branch
of the same shape ending in the opposite property, and a true/false query about one entity.

Facts (shuffled in the question): ``E is a C0.``, ``Every C0 is a C1.`` ... ``Every C(k-1) is a Ck.``,
``Every Ck is [not] P.``; the distractor branch ``Every D1 is a D2.`` ... ``Every Dm is [the opposite] P.`` is
reached from nothing ``E`` is, so only following the entity's own chain answers the query
``True or false: E is [not] P.``. Steps are sentences, one a hop: ``E is a C1.`` ... ``E is a Ck.``, then
``E is [not] P.``; the answer is ``True`` or ``False``. ``solve`` answers a row by forward chaining over its
facts (what the entity is, then what those classes are), independently of how it was generated.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, fields
from typing import Any

from pipelines.data.reasoning.prosqa import DEFAULT_INVENTORY, Inventory
from pipelines.data.reasoning.rows import ReasoningError, Row

ADJECTIVES = ("bitter", "blue", "bright", "cold", "dull", "earthy", "feisty", "floral", "fruity", "happy", "hot",
              "kind", "large", "liquid", "luminous", "mean", "metallic", "nervous", "opaque", "red", "shy", "small",
              "sour", "spicy", "sweet", "transparent", "wooden")
"""The properties the queries ask about (ProntoQA's kind of adjectives); anchors drop them."""


@dataclass(frozen=True)
class ProntoQAConfig:
    """The generator's knobs: ``hops`` (the entity's chain length, Coconut's ProntoQA: 5) and the distractor's."""

    hops: int = 5
    distractor_hops: int = 5
    """Length of the distractor branch (0: none)."""

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ProntoQAConfig:
        known = [f.name for f in fields(cls)]
        bad = sorted(set(d) - set(known))
        if bad:
            raise ReasoningError(f"unknown ProntoQA option(s) {', '.join(bad)}; known: {', '.join(known)}")
        cfg = cls(**{k: int(v) for k, v in d.items()})
        if cfg.hops < 1 or cfg.distractor_hops < 0:
            raise ReasoningError("ProntoQA options: hops at least 1, distractor_hops at least 0")
        return cfg


def generate_one(rng: random.Random, cfg: ProntoQAConfig, inventory: Inventory = DEFAULT_INVENTORY) -> Row:
    """One row (module docstring)."""
    need = cfg.hops + 1 + cfg.distractor_hops
    if need > len(inventory.concepts):
        raise ReasoningError(f"{need} concepts needed, the inventory has {len(inventory.concepts)}: lower hops")
    entity = rng.choice(inventory.people)
    names = rng.sample(inventory.concepts, need)
    chain, branch = names[:cfg.hops + 1], names[cfg.hops + 1:]
    prop = rng.choice(ADJECTIVES)
    holds = rng.random() < 0.5  # whether the chain's last class has the property (else its negation)
    negated_query = rng.random() < 0.5
    facts = [f"{entity} is a {chain[0]}."]
    facts += [f"Every {a} is a {b}." for a, b in zip(chain[:-1], chain[1:], strict=True)]
    facts.append(f"Every {chain[-1]} is {'' if holds else 'not '}{prop}.")
    if branch:
        facts += [f"Every {a} is a {b}." for a, b in zip(branch[:-1], branch[1:], strict=True)]
        facts.append(f"Every {branch[-1]} is {'not ' if holds else ''}{prop}.")
    rng.shuffle(facts)
    query = f"{entity} is {'not ' if negated_query else ''}{prop}."
    steps = [f"{entity} is a {c}." for c in chain[1:]] + [f"{entity} is {'' if holds else 'not '}{prop}."]
    answer = "True" if holds != negated_query else "False"
    return {"question": " ".join([*facts, f"True or false: {query}"]), "steps": steps, "answer": answer}


FACT = re.compile(r"(?:(Every) )?(\w+) is (?:a (\w+)|(not )?(\w+))\.")


def solve(row: Row) -> str:
    """``True`` / ``False`` for a row's query by forward chaining over the question's facts."""
    text = row["question"]
    head, _, query = text.rpartition("True or false: ")
    isa: dict[str, set[str]] = {}
    props: dict[str, dict[str, bool]] = {}
    for _every, subj, cls, neg, adj in FACT.findall(head):
        if cls:
            isa.setdefault(subj, set()).add(cls)
        else:
            props.setdefault(subj, {})[adj] = not neg
    m = re.fullmatch(r"(\w+) is (not )?(\w+)\.", query.strip())
    if m is None:
        raise ReasoningError(f"no true/false query in {text[-80:]!r}")
    entity, neg, prop = m.group(1), bool(m.group(2)), m.group(3)
    known, frontier = {entity}, [entity]
    while frontier:
        for c in isa.get(frontier.pop(), ()):
            if c not in known:
                known.add(c)
                frontier.append(c)
    values = {props[c][prop] for c in known if prop in props.get(c, {})}
    if len(values) != 1:
        raise ReasoningError(f"the facts give {len(values)} values of {prop!r} for {entity}")
    return "True" if values.pop() != neg else "False"


def generate(count: int, seed: int, cfg: ProntoQAConfig | None = None,
             inventory: Inventory = DEFAULT_INVENTORY) -> list[Row]:
    """``count`` rows from ``random.Random(seed)``, each answer checked by ``solve``."""
    cfg = cfg or ProntoQAConfig()
    rng = random.Random(seed)
    rows = [generate_one(rng, cfg, inventory) for _ in range(count)]
    for row in rows:
        if solve(row) != row["answer"]:
            raise AssertionError("a generated answer disagrees with forward chaining over its facts")
    return rows
