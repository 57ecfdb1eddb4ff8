"""Comments and docstrings say why the code is the way it is, never which ticket asked for it.

A ticket number tells a reader nothing without the tracker at hand, and nothing at all once the
tracker moves; the reason it stands for does. The scan reads the source text of the runtime, the
services, the benches, the scripts and the tests (this file aside) and lists every line that
names an issue by number ("issue 26", "Issue #29"). References to upstream projects' issues in
the `project#123` form cite an external fact and do not match.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TICKET = re.compile(r"\bissue[ #]*\d+", re.IGNORECASE)
SUFFIXES = {".py", ".pyi", ".sh", ".md", ".jinja", ".json", ".yml", ".yaml", ".proto"}


def scanned_files(root: Path) -> list[Path]:
    """The runtime, the services, the scripts and the tests (recursively) and the benches' own
    modules (`bench/*.py`, not their results)."""
    files = [p for d in ("llmesh", "services", "scripts", "tests") for p in (root / d).rglob("*")]
    files += (root / "bench").glob("*.py")
    this = Path(__file__).resolve()
    return sorted(
        p
        for p in files
        if p.is_file() and p.suffix in SUFFIXES and "__pycache__" not in p.parts and p.resolve() != this
    )


def ticket_sites(root: Path) -> list[str]:
    sites = []
    for path in scanned_files(root):
        text = path.read_text(encoding="utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), start=1):
            if TICKET.search(line):
                sites.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    return sites


def test_the_pattern_matches_ticket_numbers_and_not_upstream_references() -> None:
    assert all(TICKET.search(s) for s in ("# issue 26: x", "(Issue #29)", "issue#3", "ISSUE 15's pass"))
    assert not any(TICKET.search(s) for s in ("vllm#14721", "tissue 4", "issues/12", "the issue asks"))


def test_no_comment_or_docstring_names_a_ticket() -> None:
    assert scanned_files(ROOT), "the scan found no files: the paths are wrong"
    sites = ticket_sites(ROOT)
    assert not sites, "say why, not which ticket:\n" + "\n".join(sites)
