"""The contract lives in the repository (docs/spec.md): no tracked source, test or doc cites a
path outside it (the team checkout's ../shared/ files)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SUFFIXES = {".py", ".md", ".cuh", ".jinja", ".h", ".cu", ".sh"}
OUTSIDE = re.compile(
    r"\.\./shared/|(?<![\w/])shared/(notes|SPEC|ARCHITECTURE)|(?<!docs/)\bSPEC\.md"
)


def _tracked() -> list[Path]:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "ls-files"], capture_output=True,
                             text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [REPO / p for p in out.splitlines() if Path(p).suffix in SUFFIXES]


def test_spec_is_in_the_repository() -> None:
    spec = (REPO / "docs" / "spec.md").read_text()
    assert spec.startswith("# flashinfer_h3")
    assert "## 5. Accuracy" in spec and "Gaussian inputs at the default softmax scale" in spec


def test_nothing_cites_files_outside_the_repository() -> None:
    bad = []
    for path in _tracked():
        if path.name == "spec.md" or path == Path(__file__).resolve() or not path.is_file():
            continue
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                bad.append(f"{path.relative_to(REPO)}:{i}: {line.strip()}")
    assert not bad, "cite docs/spec.md (or the repository) instead:\n" + "\n".join(bad)
