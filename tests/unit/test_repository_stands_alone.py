"""The repository explains itself: no source, test or doc cites a design document that is not in it.

A clone holds README.md and docs/ (docs/architecture.md: layers, the step's transaction, module map, public
API), so a comment or page that sends its reader to a document kept elsewhere is a dead end. The patterns
below catch such citations; the words they share with legitimate uses ("the fp32 reference" of the
benchmarks, the oracle ``paged_attention_reference``, a request's random seed) are left alone, which the
control tests prove. Each pattern is assembled from pieces so that this file does not cite what it forbids.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCANNED_DIRS = ("pagedgen", "tests", "docs")
SCANNED_SUFFIXES = {".py", ".md", ".c", ".h"}
DOCUMENTATION = ROOT / "docs"

_REF = "refer" + "ence"
_SEED = "the " + "seed"
CITATIONS: dict[str, re.Pattern[str]] = {
    "the design file": re.compile("DESIGN" + r"\.md"),
    "the engine design file": re.compile("paged_attention" + "_engine"),
    "the shared folder": re.compile(r"\bshared" + "/"),
    "the seed document": re.compile(
        r"(?i:\b" + _SEED + r"'s\b|\b(?:beyond|as in|next to|than) " + _SEED + r"\b)"
    ),
    "the outside design": re.compile(r"(?i:\b" + _REF + r" (?:design|document)s?\b)"),
    "a section citation": re.compile(r"\b[Rr]" + _REF[1:] + r", [\"A-Z]"),
    "a citation of its rules": re.compile(
        r"(?i:\bthe " + _REF + r"'s\b|\b(?:beyond|as in|than|following) the " + _REF + r"\b)"
        r"|\b[Tt]he " + _REF + r" (?:lets|retries|keeps|proves|captures|does|says)\b"
    ),
}


def scanned_files() -> list[Path]:
    files = [ROOT / "README.md"]
    for folder in SCANNED_DIRS:
        files += sorted(
            p
            for p in (ROOT / folder).rglob("*")
            if p.suffix in SCANNED_SUFFIXES and "__pycache__" not in p.parts
        )
    return files


def citations_in(text: str) -> list[str]:
    """``"line N: kind: the line"`` for every citation of an outside design document in ``text``."""
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        for kind, pattern in CITATIONS.items():
            if pattern.search(line):
                found.append(f"line {number}: {kind}: {line.strip()}")
    return found


def test_no_file_cites_a_document_outside_the_repository():
    files = scanned_files()
    assert len(files) > 100  # the walk really reached the package, the tests and the docs
    problems = [f"{p.relative_to(ROOT)} {hit}" for p in files for hit in citations_in(p.read_text())]
    assert problems == []


@pytest.mark.parametrize(
    "line",
    [
        "The architecture is in the project's " + "DESIGN" + ".md.",
        "engine behaviour follows " + "paged_attention" + "_engine.md",
        "both kept beside the repository in `" + "shared" + "/`",
        "Failure isolation (beyond " + _SEED + "'s whole-step retry)",
        "Releasing residency (Beyond " + _SEED + ", which lets idle residents hold their rows)",
        "The " + _REF + " design's sections",
        "Policy (" + _REF + ', "Backpressure and fairness")',
        "R" + _REF[1:] + ', "Fixed request-state pools". Every fixed tensor',
        "(" + _REF + ", ValidateCompositeStateInvariants)",
        "the processors run in the " + _REF + "'s Generator order",
        "## Residency (beyond the " + _REF + ")",
        "The " + _REF + " retries a rolled-back step as is.",
    ],
)
def test_each_kind_of_citation_is_caught(line):
    assert citations_in(line) != []


@pytest.mark.parametrize(
    "line",
    [
        "| W1 | pagedgen-f32w | 199.0 | 100% (" + _REF + ") | 1.49x |",
        "the length of the common prefix with the fp32 " + _REF,
        "ref = paged_attention_" + _REF + "(case.query, case.k_cache, case.v_cache, case.inputs, scale)",
        '"""The ' + "seed of this request's random stream (drawn fresh when the params gave none)." + '"""',
        "``u = mix(mix(seed) + (counter + 1) * gamma)``: " + _SEED + " is mixed first",
        "RMSNorm computed in float32, as the " + _REF + " implementations do, then cast back.",
        "A block whose last " + _REF + " goes is CACHED",
        "blocks named in the prefix cache, " + _REF + "d or not",
    ],
)
def test_legitimate_uses_of_the_same_words_pass(line):
    assert citations_in(line) == []


def test_readme_lists_the_documentation_pages_that_exist():
    readme = (ROOT / "README.md").read_text()
    listed = set(
        re.findall(r"`(docs/[a-z_-]+\.md)`", readme.split("## Documentation", 1)[1].split("\n## ", 1)[0])
    )
    pages = {f"docs/{p.name}" for p in DOCUMENTATION.glob("*.md")}
    assert "docs/architecture.md" in listed
    assert listed == pages
