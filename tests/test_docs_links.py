"""Every relative link in the README and the docs leads to a file of the repository, and
every #anchor to one of that file's headings (as GitHub names them), so that moving a
section or a file cannot leave a reader at a dead end."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = sorted([REPO / "README.md", *REPO.glob("docs/*.md"),  # not a hidden folder's (pytest's cache has one)
                    *(p for p in REPO.glob("*/README.md") if not p.parent.name.startswith("."))])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`[^`]*`")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.DOTALL | re.MULTILINE)


def heading_anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, code marks and punctuation dropped
    (hyphens and underscores kept), spaces as hyphens."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return {heading_anchor(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+)$", text, re.MULTILINE)}


def relative_links(path: Path) -> list[str]:
    text = CODE.sub("", FENCE.sub("", path.read_text(encoding="utf-8")))
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_the_anchor_of_a_heading_is_githubs():
    assert heading_anchor("Quantization and the 16 MB budget") == "quantization-and-the-16-mb-budget"
    assert heading_anchor("Per-document LoRA test-time training") == "per-document-lora-test-time-training"
    assert heading_anchor("The `.ptz`") == "the-ptz"


def test_the_documents_are_found():
    names = {p.relative_to(REPO).as_posix() for p in DOCUMENTS}
    assert {"README.md", "docs/usage.md", "docs/frontier.md"} <= names


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_leads_somewhere(document: Path):
    dead = []
    for target in relative_links(document):
        file_part, _, anchor = target.partition("#")
        destination = (document.parent / file_part).resolve() if file_part else document
        if not destination.exists():
            dead.append(f"{target}: no such file")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            dead.append(f"{target}: no such heading")
    assert not dead, f"{document.relative_to(REPO)}: " + "; ".join(dead)
