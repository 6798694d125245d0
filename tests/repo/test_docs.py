"""The documentation: README.md as the front door, the mkdocs site under ``docs/`` built strictly (a dead link, a
missing page or anchor fails), every figure-bearing record the docs name present, and no tracked file narrating
how the project was built (who worked on it, in which session or round, first-person remarks)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

# ---- the project speaks of itself only ----------------------------------------------------------------------

_ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
             "fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|last|previous|next")
NARRATION: dict[str, re.Pattern[str]] = {
    "a numbered or dated session": re.compile(r"\b(sessions?|session's) ([0-9]+|of this|before)\b", re.I),
    "this round / this session": re.compile(r"\bthis (round|session|turn)\b", re.I),
    "an issue or stop number": re.compile(r"\b(issues?|stops?) #?[0-9]{1,3}\b", re.I),
    "whoever": re.compile(r"\bwhoever\b", re.I),
    "an ordinal session": re.compile(rf"\b(the|a|an|its|this) ({_ORDINALS}) (session|turn)s?\b", re.I),
    "a session or round of this round": re.compile(r"\b(session|round)s? of this\b", re.I),
    "a session in time": re.compile(r"\bsessions? (ago|earlier|later)\b", re.I),
    "first person": re.compile(r"\bI (did|chose|measured|left|ran|found|changed|added|fixed|used|kept|think|tried|"
                               r"saw|wrote|removed|made|decided|believe|noticed)\b"),
    "first-person possessive": re.compile(r"\b[Mm]y [a-z]\w*"),
}
"""What narration looks like. Each pattern names a slip found in this repository's history, not a style rule."""

ALLOWED: tuple[tuple[str, re.Pattern[str]], ...] = (
    # Ray's and pytest's own session notions, named as their APIs name them.
    ("*", re.compile(r"scope=\"session\"|ray session|session Ray|Ray session")),
    # SDTT's rounds are the method's own (distillation rounds), as is ``rounds x steps_per_round``.
    ("*", re.compile(r"SDTT rounds?|distillation rounds?|rounds x steps_per_round")),
)
"""(file glob, line pattern): a line of a file matching both is not narration."""

BINARY = {".json", ".csv", ".parquet", ".png", ".safetensors", ".ckpt", ".pt", ".jsonl", ".bin", ".log", ".gz",
          ".tgz", ".zip", ".gguf", ".pkl", ".npy", ".npz", ".jpg", ".svg", ".ico"}
"""Data and binary files: measured output, not the project's prose."""


def _text_files() -> list[Path]:
    """Every file git tracks or would track (untracked but not ignored), minus data and binaries, and minus this
    file, whose examples of narration are the check's own fixtures."""
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                         capture_output=True, text=True, check=True).stdout
    files = []
    for name in sorted(set(filter(None, out.split("\0")))):
        path = ROOT / name
        if path.suffix.lower() in BINARY or not path.is_file() or path == Path(__file__).resolve():
            continue
        files.append(path)
    return files


def narration(path: Path, text: str) -> list[str]:
    """``path:line: what -- the line`` for each line of ``text`` that narrates."""
    from fnmatch import fnmatch

    rel = path.relative_to(ROOT).as_posix() if path.is_absolute() else path.as_posix()
    allowed = [pattern for glob, pattern in ALLOWED if fnmatch(rel, glob)]
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for what, pattern in NARRATION.items():
            m = pattern.search(line)
            if m and not any(a.search(line) for a in allowed):
                found.append(f"{rel}:{n}: {what} ({m.group(0)!r}) -- {line.strip()[:140]}")
                break
    return found


def test_no_tracked_file_narrates_the_project_s_history() -> None:
    """Code, comments, docstrings, tests, configs, scripts and docs say what a thing is and why, never who built it
    when: no session or round numbers, no issue or stop numbers, no "whoever", no first-person remarks."""
    found = []
    for path in _text_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        found += narration(path, text)
    assert not found, f"{len(found)} line(s) narrate the project's history; say what the thing is instead:\n" + \
        "\n".join(found)


@pytest.mark.parametrize("line", [
    "Measured at the eleventh session (load 20).",
    "Since session 13 a model whose bound is farther ...",
    "Before this round the demo read 4,914.",
    "a question for the issue's owner; I did not change it",
    "after my deletion of old clones",
    "a choice for whoever files the issues",
    "the sweep waited until killed (issue 38)",
    "CI for the final code (stop 46)",
])
def test_the_narration_check_sees_each_known_slip(line: str) -> None:
    assert narration(Path("x.py"), line), line


@pytest.mark.parametrize("line", [
    '@pytest.fixture(scope="session")',
    "each of distill.rounds SDTT rounds is rounds x steps_per_round optimiser steps",
    "steps = int(round((1.0 - w) / delta))",
    "the Ray session logs",
    "Issues and pull requests are welcome.",
])
def test_the_narration_check_leaves_plain_words_alone(line: str) -> None:
    assert not narration(Path("x.py"), line), line


# ---- the site ------------------------------------------------------------------------------------------------

def _nav_pages(nav: list) -> list[str]:
    pages = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def _mkdocs_config() -> dict:
    class Loader(yaml.SafeLoader):  # mkdocs.yml may carry !!python/name tags (extensions): read them as text
        pass

    Loader.add_multi_constructor("", lambda loader, suffix, node: None)
    return yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)


NAV = _nav_pages(_mkdocs_config()["nav"])


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    """``mkdocs build --strict``: a link to a missing page or anchor, a page left out of the nav or a nav entry
    without its page is a warning, and strict mode makes it an error (not with ``--quiet``, which drops the
    warnings before strict mode counts them)."""
    import os

    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                        "-d", str(tmp_path / "site")], capture_output=True, text=True, env=env, cwd=ROOT)
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout}\n{r.stderr}"
    for page in NAV:
        html = tmp_path / "site" / (page[:-3] + "/index.html" if page != "index.md" else "index.html")
        assert html.is_file(), f"{page}: no page built at {html}"
    _formulas_render_offline(tmp_path / "site")


def _formulas_render_offline(site: Path) -> None:
    """The method page's formulas are in the built HTML as MathML (docs/hooks/mathml.py), which browsers render with
    no script: every formula of the page's source is a ``<math>`` element, none is left as raw TeX, and no page of
    the site loads a script, a style or a font from the network."""
    source = (DOCS / "design" / "method.md").read_text()
    inline = re.findall(r"(?<![\\$])\$(?!\$)[^$\n]+\$", source)
    display = re.findall(r"^\$\$", source, re.M)
    html = (site / "design" / "method" / "index.html").read_text()
    maths = re.findall(r"<math [^>]*display=\"(inline|block)\"", html)
    assert len(maths) == len(inline) + len(display) // 2 and len(maths) >= 90, (len(maths), len(inline), len(display))
    assert maths.count("block") == len(display) // 2
    assert "\\(" not in html and "\\[" not in html and "$$" not in html, "raw TeX left on the method page"
    for page in site.rglob("*.html"):
        remote = re.findall(r"<(?:script|link)[^>]+(?:src|href)=\"(https?://[^\"]+)\"", page.read_text())
        assert not [u for u in remote if not u.startswith(("https://squidfunk", "https://github.com"))], (page, remote)


def test_the_strict_build_catches_a_dead_link(tmp_path: Path) -> None:
    """The control: a site with this configuration's validation rules and one page linking a page that does not
    exist fails the strict build (a small site with the default theme, to keep it cheap)."""
    import os

    cfg = {"site_name": "control", "docs_dir": "docs", "strict": True,
           "validation": _mkdocs_config()["validation"], "nav": [{"Home": "index.md"}]}
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(cfg))
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# Home\n\n[gone](usage/no-such-page.md)\n")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(tmp_path / "mkdocs.yml"),
                        "-d", str(tmp_path / "site")], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode != 0 and "no-such-page.md" in r.stdout + r.stderr, r.stdout + r.stderr


def test_every_page_in_docs_is_in_the_nav() -> None:
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert sorted(NAV) == pages, f"nav and docs/ differ: {set(NAV) ^ set(pages)}"


# ---- README.md: the front door -------------------------------------------------------------------------------

def _readme() -> str:
    return README.read_text()


def _relative_links(text: str) -> list[str]:
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    return [link for link in links if not re.match(r"[a-z]+:|#|<", link)]


def test_the_readme_is_a_front_door() -> None:
    """At most 300 lines; the two commands; the demo's summary between the markers its script fills; a license."""
    text = _readme()
    assert len(text.splitlines()) <= 300, f"README.md has {len(text.splitlines())} lines: move detail into docs/"
    assert "make demo" in text and "make test" in text
    begin, end = "<!-- demo-summary:begin -->", "<!-- demo-summary:end -->"
    assert text.count(begin) == 1 and text.count(end) == 1 and text.index(begin) < text.index(end)
    block = text[text.index(begin) + len(begin):text.index(end)]
    assert block.strip(), "the demo's summary belongs between its markers (its script fills them from a run)"
    assert "Python 3.11" in text and "[LICENSE](LICENSE)" in text


def test_every_readme_link_resolves() -> None:
    """Every relative link of README.md (docs pages, records, LICENSE) names a file or folder that exists, and an
    anchor into a docs page names one of its headings."""
    missing = []
    for link in _relative_links(_readme()):
        path, _, anchor = link.partition("#")
        target = ROOT / path
        if not target.exists():
            missing.append(link)
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            missing.append(link)
    assert not missing, f"README.md links to what does not exist: {missing}"


def _anchors(page: Path) -> set[str]:
    """The ids mkdocs' toc extension gives the page's headings (its default slugify)."""
    from markdown.extensions.toc import slugify

    return {slugify(re.sub(r"`", "", m), "-") for m in re.findall(r"^#+ (.+?)\s*$", page.read_text(), re.M)}


def test_every_docs_page_is_one_click_from_the_readme() -> None:
    """Any topic within two clicks: the README links every page of the site (one), whose sections are the topics."""
    linked = {link.partition("#")[0] for link in _relative_links(_readme())}
    unlinked = [page for page in NAV if f"docs/{page}" not in linked]
    assert not unlinked, f"docs pages README.md does not link: {unlinked}"


# ---- what the docs cite exists -------------------------------------------------------------------------------

REPO_PATH = re.compile(r"`((?:adlm_model|pipelines|benchmarks|tests|configs|studies|tune_spaces|schemas|deploy|mlflow)"
                       r"/[\w./-]*)`")
"""A repository path in a code span: how docs pages name files (strict mkdocs cannot link outside docs/)."""
CHECKED = {"", ".py", ".md", ".yaml", ".yml", ".json", ".png", ".sh", ".toml"}
"""Suffixes whose files must exist when named (data written at run time, such as CSVs, is left out)."""


def test_every_file_the_docs_name_exists() -> None:
    """A docs page or README naming `benchmarks/results/...md`, a module or a recipe names something that exists:
    a renamed file or a record that was never written fails here instead of leaving the reader a dead end."""
    missing = []
    for page in [README, ROOT / "CONTRIBUTING.md", *sorted(DOCS.rglob("*.md"))]:
        for path in REPO_PATH.findall(page.read_text()):
            if any(c in path for c in "*<>{}$") or "..." in path or Path(path).suffix not in CHECKED:
                continue
            if not (ROOT / path.rstrip("/")).exists():
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, "named but missing:\n" + "\n".join(missing)


CITED_NAME = re.compile(r"(?<![\w/.-])([A-Z][A-Z0-9_]*(?:[-_][A-Z0-9]+)*\.(?:md|txt|cff|rst))\b")
"""A document named as the project names its own (README.md, CONTRIBUTING.md, CHANGELOG.md)."""
CITED_PATH = re.compile(r"(?<![\w/.-])((?:adlm_model|pipelines|benchmarks|tests|configs|studies|tune_spaces|schemas|"
                        r"deploy|mlflow|docs)/[\w./-]*\.(?:py|md|yaml|yml|json|sh|toml))\b")
"""A repository file named anywhere (a page, a docstring, a comment, a help text, a schema's description)."""
WRITTEN_BY_THEIR_FILE = {
    "docs/usage/own-data.md": {"configs/mine_adlm.yaml", "tune_spaces/mine.yaml"},  # the page has the user write them
    "tests/e2e/test_journey.py": {"configs/mine_adlm.yaml", "tune_spaces/mine.yaml"},
    "tests/support/cluster.py": {"pipelines/_submitted_probe.py"},  # the module it adds to a submitted copy
    "tests/repo/test_record.py": {"benchmarks/x.py"},  # a benchmark it makes up
    "CONTRIBUTING.md": {"tests/test_x.py"},  # "the tests of the files you touched"
    # an export written by an earlier version (test_hf_export), its shipped code kept as it was then
    "tests/fixtures/export-v0/modeling_adlm.py": {"adlm_model/sedd.py"},
}
"""Files named that do not exist on purpose: the file that names them writes them, or names a placeholder."""
AS_WRITTEN = ("benchmarks/results/", "studies/")
"""Dated records and pre-registered studies (and their raw results) name the files of the tree they ran on: a file
moved since is named there as it was, never edited after the fact."""


def test_no_tracked_file_cites_a_file_the_repository_lacks() -> None:
    """No page, docstring, comment, help text or schema sends a reader to a file the repository does not have
    (such as the specifications it was written from, which users never get): every document named like
    ``README.md`` is one of the repository's, and every repository path named exists."""
    tracked = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    names = {Path(f).name for f in tracked}
    missing = []
    for path in _text_files() + [ROOT / f for f in tracked if f.startswith("schemas/")]:
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text(errors="replace")
        missing += [f"{rel}: {n}" for n in CITED_NAME.findall(text) if n not in names]
        missing += [f"{rel}: {p}" for p in CITED_PATH.findall(text)
                    if not (ROOT / p).exists() and "..." not in p and p not in WRITTEN_BY_THEIR_FILE.get(rel, ())
                    and not rel.startswith(AS_WRITTEN)]
    assert not missing, "named but not in the repository:\n" + "\n".join(sorted(set(missing)))


@pytest.mark.parametrize("line", ["the formulas of METHOD.md, section 2", "(ENVIRONMENT.md)",
                                  "see pipelines/training/gone.py"])
def test_the_citation_check_sees_a_missing_file(line: str) -> None:
    found = CITED_NAME.findall(line) + CITED_PATH.findall(line)
    assert found and not all((ROOT / f).exists() for f in found), line


def test_the_records_written_from_raw_files_are_current() -> None:
    """``benchmarks/records_from_raw.py --check``: every record it writes is committed and equals what its raw
    files give (a record edited by hand, or a raw file changed without its record, fails)."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "records_from_raw.py"), "--check"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr


# ---- the reference pages, generated from the code -------------------------------------------------------------

def test_the_reference_pages_are_current() -> None:
    """docs/reference/commands.md and config.md are what ``python tools/docs_reference.py --write`` makes of
    the code now: a new flag, key or docstring without the regenerated page fails here."""
    from tools.docs_reference import stale

    old = [p.relative_to(ROOT).as_posix() for p in stale()]
    assert not old, f"out of date: {old}; run python tools/docs_reference.py --write"


def test_the_reference_pages_name_every_flag_and_key() -> None:
    """Each command's every flag and each config dataclass's every field is on its page, and every recipe key has
    a description (a field without a docstring would leave a blank cell)."""
    import dataclasses
    import importlib

    from pipelines.training.config import SECTIONS, TrainConfig, recipe_keys
    from tools.docs_reference import COMMANDS, PAGES

    commands = PAGES["commands"].read_text()
    for name in COMMANDS:
        section = commands.split(f"\n## {name}\n", 1)[1].split("\n## ", 1)[0]
        for action in importlib.import_module(f"pipelines.{name}").build_parser()._actions:
            for flag in action.option_strings:
                assert f"`{flag}`" in section or flag in ("-h", "--help"), (name, flag)
    config = PAGES["config"].read_text()
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f"| `{section}.{f.name}` |" in config, f"{section}.{f.name}"
    assert all(k.description for k in recipe_keys()), [k.name for k in recipe_keys() if not k.description]
    assert {"ema", "ema_warmup"} <= {f.name for f in dataclasses.fields(TrainConfig)}


def test_train_help_config_prints_every_key_with_its_description() -> None:
    """``python -m pipelines.train --help-config`` (no recipe needed) lists every recipe key with its type, default
    and description: the keys the epilog of ``--help`` promises, scaling.compile and data.read_cpus among them."""
    from pipelines.training.config import recipe_keys

    r = subprocess.run([sys.executable, "-m", "pipelines.train", "--help-config"], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    for key in recipe_keys():
        assert f"  {key.name} ({key.type}; default {key.default})" in r.stdout, key.name
    compile_line = r.stdout.split("  scaling.compile ", 1)[1].split("\n  ", 2)
    assert "torch.compile" in compile_line[1], compile_line
    assert "--help-config" in subprocess.run([sys.executable, "-m", "pipelines.train", "--help"], capture_output=True,
                                             text=True, cwd=ROOT, timeout=120).stdout


# ---- tables and claims that restate the code --------------------------------------------------------------

def _table_rows(page: Path, header: str) -> list[list[str]]:
    """The rows of the Markdown table whose header line starts with ``header``, as stripped cells."""
    lines = page.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[at + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split(" | ")])
    return rows


def test_the_sampler_table_is_the_kinds_table() -> None:
    """Generation's table of samplers per kind lists, for every kind, the samplers ``samplers_for`` gives, default
    first."""
    from adlm_model.kinds import KINDS, samplers_for

    rows = _table_rows(DOCS / "usage" / "generation-and-serving.md", "| model kind | samplers")
    table = {kind.lower().replace("-", ""): re.findall(r"`([^`]+)`", samplers) for kind, samplers in rows}
    assert table == {kind: samplers_for(kind) for kind in KINDS}


def test_the_suites_table_lists_every_suite() -> None:
    from pipelines.evaluation.suites import SUITES

    rows = _table_rows(DOCS / "usage" / "evaluation.md", "| suite | what")
    assert [re.sub(r"`", "", r[0]) for r in rows] == list(SUITES)


def test_make_bench_runs_every_cpu_benchmark() -> None:
    """``make bench`` names every benchmark script, except the ones its comment says why it leaves out, and only
    scripts that exist."""
    make = (ROOT / "Makefile").read_text()
    listed = re.search(r"^CPU_BENCHMARKS := (.*?)(?<!\\)$", make, re.M | re.S).group(1).replace("\\\n", " ").split()
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("[a-z]*.py")}
    left_out = {"gpu_check", "zero_shot_empty_rows", "suite_cpu", "records_from_raw", "newest_versions"}
    assert set(listed) == scripts - left_out and len(listed) == len(set(listed)), sorted(set(listed) ^ (scripts - left_out))
    assert all(f"{name}.py" in make for name in left_out)


def test_no_page_repeats_a_paragraph() -> None:
    """A paragraph of prose (over 80 characters) appears once per page: a repeated one is a merge left behind."""
    repeated = []
    for page in [README, *sorted(DOCS.rglob("*.md"))]:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text)]
        seen: set[str] = set()
        for p in paragraphs:
            if len(p) > 80 and not p.startswith(("|", "<!--")):
                if p in seen:
                    repeated.append(f"{page.relative_to(ROOT)}: {p[:80]}")
                seen.add(p)
    assert not repeated, repeated


def test_with_a_repo_url_the_site_links_the_repository_files_its_pages_name() -> None:
    """docs/hooks/repo_links.py: a code span naming a repository file or folder becomes a link into the repository
    (``ADLM_REPO_URL``); a name that is no file, a span already inside a link, and every span without a repo_url
    are left as they are."""
    from tests.conftest import load_script

    hook = load_script(DOCS / "hooks" / "repo_links.py", "adlm_repo_links")
    page = ("<p><code>configs/demo.yaml</code>, <code>benchmarks/results/</code>, <code>configs/none.yaml</code>, "
            '<code>--set</code>, <a href="x"><code>README.md</code></a></p>')
    out = hook.on_page_content(page, config={"repo_url": "https://example.org/o/r/"})
    assert '<a href="https://example.org/o/r/blob/main/configs/demo.yaml"><code>configs/demo.yaml</code></a>' in out
    assert '<a href="https://example.org/o/r/tree/main/benchmarks/results"><code>benchmarks/results/</code></a>' in out
    assert "<code>configs/none.yaml</code>," in out and "<code>--set</code>," in out
    assert out.count("<a ") == 3
    assert hook.on_page_content(page, config={"repo_url": None}) == page
