"""A ProsQA-like generator, rebuilt from Coconut's description of ProsQA (its Appendix A.2): a random DAG of
fictional concepts, the question "Is Tom a A or B?" with A reachable from Tom and B not, the trace a shortest
path as sentences.

The graph is built node by node. Nodes 0 and 1 are the two roots (people), labelled 1 and 2. Each new node gets
``in-degree ~ Poisson(mean_in_degree)`` (redrawn while 0) parents drawn, with replacement, among the last
``parent_window`` nodes of one side (the nodes labelled 1, or those labelled 2); with probability ``cross_prob``
one more parent comes from anywhere, and with probability ``extra_root_prob`` the node is a further root (a
person) with no parent. Labels propagate from the roots: a node's label is the union (bitwise or) of its
parents'. The question is asked of one root: the target is a sink labelled by that root alone (reachable from
it, not from the other) at the largest distance from it, at least ``min_path`` steps away; the negative target
is a sink labelled by the other root alone (not reachable from the asked one). The parent window keeps the
graph deep and the answer far (the released rows' shortest path is 3.8 on average); the two sides keep
labels mostly pure, as the released rows' are (6% of their nodes reach both roots).

Statistics against Coconut's 300 released validation rows (``graph_stats``; measured in
``tests/pipelines/test_reasoning_tasks.py``): those rows have 22.8 nodes, 36.3 edges, a shortest path of 3.75 and 5.1 paths
from the root to the target on average; this generator at its defaults about 23, 32, 3.7 and 6. Names: people
for roots, concepts for the rest, drawn from an ``Inventory`` (Coconut's own names via ``inventory_from_rows``,
or the small built-in one). ``nodes`` is the size knob (``ProsQAConfig(nodes=10, min_path=2)`` for CPU runs).
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, fields
from typing import Any

from pipelines.data.reasoning.rows import ReasoningError, Row


@dataclass(frozen=True)
class Inventory:
    """Names of the generated graphs: people (the roots) and concepts (every other node)."""

    people: tuple[str, ...]
    concepts: tuple[str, ...]


DEFAULT_INVENTORY = Inventory(
    people=("Alex", "Bob", "Carol", "Davis", "Eva", "Fae", "Jack", "Max", "Polly", "Rex", "Sally", "Sam", "Stella",
            "Tom", "Wren"),
    concepts=("brimpus", "boompus", "bompus", "dumpus", "fompus", "gerpus", "gorpus", "grimpus", "gwompus",
              "impus", "jelpus", "jompus", "kerpus", "lempus", "lorpus", "numpus", "rempus", "rompus", "rorpus",
              "scrompus", "shumpus", "sterpus", "storpus", "terpus", "timpus", "tumpus", "vumpus", "worpus",
              "wumpus", "yerpus", "yimpus", "yumpus", "zhorpus", "zumpus", "felpus", "hilpus", "quimpus", "porpus"))
"""A built-in inventory in the style of ProsQA's names, so that the generator runs without Coconut's files."""


def inventory_from_rows(rows: list[Row]) -> Inventory:
    """The names of released rows (their ``idx_to_symbol``): roots' names are people, the rest concepts."""
    people: dict[str, None] = {}
    concepts: dict[str, None] = {}
    for i, row in enumerate(rows):
        names, edges = row.get("idx_to_symbol"), row.get("edges")
        if not isinstance(names, list) or not isinstance(edges, list):
            raise ReasoningError(f"row {i}: a name inventory needs idx_to_symbol and edges (ProsQA's released rows)")
        has_parent = {int(b) for _, b in edges}
        for j, name in enumerate(names):
            (concepts if j in has_parent else people)[str(name)] = None
    for name in people:
        concepts.pop(name, None)
    if len(people) < 2 or len(concepts) < 2:
        raise ReasoningError("the name inventory needs at least two people and two concepts")
    return Inventory(tuple(people), tuple(concepts))


@dataclass(frozen=True)
class ProsQAConfig:
    """The generator's knobs (module docstring); the defaults approximate the released rows' statistics."""

    nodes: float = 23.0
    """Mean number of nodes of a graph (drawn from a normal of sd ``nodes_sd``, at least ``min_nodes``)."""
    nodes_sd: float = 2.0
    min_nodes: int = 6
    mean_in_degree: float = 1.5
    """The mean of the Poisson the number of parents of a new node is drawn from (Coconut: 1.5)."""
    parent_window: int = 5
    cross_prob: float = 0.05
    extra_root_prob: float = 0.025
    min_path: int = 3
    """Shortest path from the asked root to the target, at least (the released rows: 3 to 6)."""

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ProsQAConfig:
        known = {f.name: f.type for f in fields(cls)}
        bad = sorted(set(d) - set(known))
        if bad:
            raise ReasoningError(f"unknown ProsQA option(s) {', '.join(bad)}; known: {', '.join(known)}")
        cfg = cls(**{k: (int(v) if known[k] == "int" else float(v)) for k, v in d.items()})
        if cfg.min_path < 1 or cfg.parent_window < 1 or cfg.nodes < 4 or cfg.mean_in_degree <= 0:
            raise ReasoningError("ProsQA options: min_path and parent_window at least 1, nodes at least 4, "
                                 "mean_in_degree above 0")
        return cfg


@dataclass
class Graph:
    """A generated DAG: ``edges`` as (parent, child) with parent < child, the two roots' labels and the question's
    nodes."""

    n: int
    edges: list[tuple[int, int]]
    labels: list[int]
    roots: list[int]
    root: int
    target: int
    neg_target: int


def poisson(rng: random.Random, lam: float) -> int:
    """A Poisson draw (Knuth's product of uniforms; ``lam`` is small here)."""
    limit, k, p = math.exp(-lam), 0, 1.0
    while True:
        p *= rng.random()
        if p < limit:
            return k
        k += 1


def children_of(n: int, edges: list[tuple[int, int]] | list[list[int]]) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in range(n)]
    for a, b in edges:
        out[int(a)].append(int(b))
    return out


def distances(n: int, edges: list[tuple[int, int]] | list[list[int]], source: int) -> dict[int, int]:
    """Breadth-first distances from ``source`` along the edges (the nodes it reaches)."""
    ch = children_of(n, edges)
    dist, queue = {source: 0}, deque([source])
    while queue:
        u = queue.popleft()
        for v in ch[u]:
            if v not in dist:
                dist[v] = dist[u] + 1
                queue.append(v)
    return dist


def draw_graph(rng: random.Random, cfg: ProsQAConfig) -> Graph | None:
    """One graph (module docstring), or None when it has no valid question (the caller draws again)."""
    n = max(cfg.min_nodes, round(rng.gauss(cfg.nodes, cfg.nodes_sd)))
    parents: list[list[int]] = [[], []]
    labels, side = [1, 2], {1: [0], 2: [1]}
    for i in range(2, n):
        if rng.random() < cfg.extra_root_prob:
            parents.append([])
            labels.append(0)
            continue
        k = poisson(rng, cfg.mean_in_degree)
        while k == 0:
            k = poisson(rng, cfg.mean_in_degree)
        pool = side[rng.choice((1, 2))][-cfg.parent_window:]
        ps = {rng.choice(pool) for _ in range(k)}
        if rng.random() < cfg.cross_prob:
            ps.add(rng.randrange(i))
        label = 0
        for p in ps:
            label |= labels[p]
        parents.append(sorted(ps))
        labels.append(label)
        if label in side:
            side[label].append(i)
    edges = [(p, i) for i in range(n) for p in parents[i]]
    ch = children_of(n, edges)
    root = rng.randrange(2)
    other = 1 - root
    dist = distances(n, edges, root)
    sinks = [i for i in range(n) if not ch[i]]
    targets = [i for i in sinks if labels[i] == labels[root] and dist.get(i, 0) >= cfg.min_path]
    negatives = [i for i in sinks if labels[i] == labels[other]]
    if not targets or not negatives:
        return None
    target = max(targets, key=lambda i: (dist[i], i))
    roots = [i for i in range(n) if not parents[i]]
    return Graph(n, edges, labels, roots, root, target, rng.choice(negatives))


def shortest_path(rng: random.Random, n: int, edges: list[tuple[int, int]], source: int, target: int) -> list[int]:
    """A shortest path from ``source`` to ``target`` (nodes, both ends included), drawn uniformly among the
    shortest at each step back."""
    dist = distances(n, edges, source)
    if target not in dist:
        raise ValueError(f"node {target} is not reachable from {source}")
    preds: list[list[int]] = [[] for _ in range(n)]
    for a, b in edges:
        if a in dist and dist.get(b) == dist[a] + 1:
            preds[b].append(a)
    path = [target]
    while path[-1] != source:
        path.append(rng.choice(sorted(preds[path[-1]])))
    return path[::-1]


def statement(names: list[str], people: set[int], a: int, b: int) -> str:
    """The sentence of edge a -> b: "Tom is a wumpus." from a person, "Every wumpus is a yumpus." otherwise."""
    return f"{names[a]} is a {names[b]}." if a in people else f"Every {names[a]} is a {names[b]}."


def render(rng: random.Random, g: Graph, inventory: Inventory) -> Row:
    """The row of a graph in Coconut's format: the edges as shuffled sentences and the question, the shortest
    path as the steps, the answer sentence, and the graph itself (``idx_to_symbol``, ``edges``, ``root``,
    ``target``, ``neg_target``)."""
    people = set(g.roots)
    if len(people) > len(inventory.people) or g.n - len(people) > len(inventory.concepts):
        raise ReasoningError(f"a graph of {g.n} nodes needs {len(people)} people and {g.n - len(people)} concepts; "
                             f"the inventory has {len(inventory.people)} and {len(inventory.concepts)}: pass more "
                             "names or fewer nodes")
    who = iter(rng.sample(inventory.people, len(people)))
    what = iter(rng.sample(inventory.concepts, g.n - len(people)))
    names = [next(who) if i in people else next(what) for i in range(g.n)]
    facts = [statement(names, people, a, b) for a, b in g.edges]
    rng.shuffle(facts)
    pair = [names[g.target], names[g.neg_target]]
    rng.shuffle(pair)
    path = shortest_path(rng, g.n, g.edges, g.root, g.target)
    steps = [statement(names, people, a, b) for a, b in zip(path[:-1], path[1:], strict=True)]
    return {"question": " ".join([*facts, f"Is {names[g.root]} a {pair[0]} or {pair[1]}?"]),
            "steps": steps, "answer": f"{names[g.root]} is a {names[g.target]}.",
            "idx_to_symbol": names, "edges": [list(e) for e in g.edges], "root": g.root, "target": g.target,
            "neg_target": g.neg_target}


def solve(row: Row) -> str:
    """The answer of a row with a graph, by a search over it: the one of ``target`` / ``neg_target`` reachable
    from ``root`` (ReasoningError when neither or both are: the row asks no question with one answer)."""
    names = row["idx_to_symbol"]
    reach = distances(len(names), row["edges"], int(row["root"]))
    hits = [k for k in (int(row["target"]), int(row["neg_target"])) if k in reach]
    if len(hits) != 1:
        raise ReasoningError(f"{len(hits)} of the two options are reachable from {names[int(row['root'])]}")
    return f"{names[int(row['root'])]} is a {names[hits[0]]}."


def generate(count: int, seed: int, cfg: ProsQAConfig | None = None,
             inventory: Inventory = DEFAULT_INVENTORY) -> list[Row]:
    """``count`` rows from ``random.Random(seed)``, each answer checked by ``solve``."""
    cfg = cfg or ProsQAConfig()
    rng = random.Random(seed)
    rows: list[Row] = []
    tries = 0
    while len(rows) < count:
        tries += 1
        if tries > 200 * count + 1000:
            raise ReasoningError(f"ProsQA options {cfg}: no graph with a valid question in {tries} draws; lower "
                                 "min_path or raise nodes")
        g = draw_graph(rng, cfg)
        if g is None:
            continue
        row = render(rng, g, inventory)
        if solve(row) != row["answer"]:
            raise AssertionError("a generated answer disagrees with the search over its graph")
        rows.append(row)
    return rows


def graph_stats(rows: list[Row]) -> dict[str, float]:
    """Mean nodes, edges, shortest path from root to target and number of paths from root to target over rows
    with a graph (ProsQA's released rows or generated ones)."""
    totals = {"nodes": 0.0, "edges": 0.0, "shortest_path": 0.0, "paths": 0.0}
    for row in rows:
        n, edges, root, target = len(row["idx_to_symbol"]), row["edges"], int(row["root"]), int(row["target"])
        ch = children_of(n, edges)
        count = [0] * n
        count[target] = 1
        for u in range(n - 1, -1, -1):  # parents precede children: a reverse sweep counts paths to the target
            if u != target:
                count[u] = sum(count[v] for v in ch[u])
        totals["nodes"] += n
        totals["edges"] += len(edges)
        totals["shortest_path"] += distances(n, edges, root)[target]
        totals["paths"] += count[root]
    return {k: v / max(1, len(rows)) for k, v in totals.items()}
