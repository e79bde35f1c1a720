"""Code cites only what ships in the repository: no issue numbers, review tags, contract section
numbers or spec/ADR numbers of documents that are not here (docs/ says the reasons instead)."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# "CONTRACT" in capitals is the product contract's name; "contract" in prose is only a word.
PROVENANCE = re.compile(r"(?i:\bissue \d+|\(review\))|§\s?\d|\bSPEC-\d+|\bADR-?\d+|\bCONTRACT\b")
# Code and configuration; prose (docs/, *.md) may talk about anything, and tests may name the
# attack or defect they reproduce.
CODE_SUFFIXES = {".py", ".html", ".js", ".css", ".sh", ".conf", ".toml", ".cfg", ".ini", ".txt",
                 ".yml", ".yaml"}


def _tracked_code_files():
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    for name in names:
        path = Path(name)
        if path.parts[0] in ("docs", "tests") or "tests" in path.parts[:-1]:
            continue
        if path.name.startswith("test_") or path.name == "conftest.py":
            continue
        if path.suffix in CODE_SUFFIXES or name in ("Procfile", "scripts/test", ".ci/run"):
            yield name


def find_provenance(text: str) -> list[tuple[int, str]]:
    return [(number, line.strip()) for number, line in enumerate(text.splitlines(), 1)
            if PROVENANCE.search(line)]


def test_the_pattern_finds_each_kind_of_tag():
    for line in ("# see issue 17", "x = 1  # (review)", '"""As CONTRACT says."""', "# §12",
                 "(SPEC-0011)", "ADR-3"):
        assert find_provenance(line), line
    assert find_provenance("# Issue 4 says so")
    assert not find_provenance("# an issue with the 17 rows; see docs/reference.md#leases")
    assert not find_provenance("# the lossy contract of the transport")


def test_no_code_cites_documents_that_do_not_ship():
    found = []
    for name in _tracked_code_files():
        path = ROOT / name
        if not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        found += [f"{name}:{number}: {line}" for number, line in find_provenance(text)]
    assert not found, "provenance tags in code:\n" + "\n".join(found)


def test_comments_stay_at_the_houses_density():
    # scripts/comment-density, the number docs/testing.md#comment-density talks about.
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "comment-density"), "--max", "7"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
