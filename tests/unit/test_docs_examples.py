"""Every Python example of README.md and docs/*.md runs as written: each ```python block is
marked on the line before it with ``<!-- example: cpu -->`` (run here), ``<!-- example: gpu -->``
(run by the GPU test) or ``<!-- example: fragment (why) -->`` (not runnable alone, with the
reason). The configuration table of the README names every environment variable the package
reads."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_MARK = re.compile(r"<!-- example: (cpu|gpu|fragment)\b(.*?)-->\s*$")


def _examples() -> list[tuple[str, int, str, str, str]]:
    """(file, line, kind, reason, code) of every python block."""
    found = []
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        i = 0
        while i < len(lines):
            if lines[i].strip() == "```python":
                start = i + 1
                end = next(j for j in range(start, len(lines)) if lines[j].strip() == "```")
                prev = lines[i - 1] if i > 0 else ""
                match = _MARK.match(prev.strip())
                kind, reason = (match.group(1), match.group(2).strip()) if match else ("", "")
                found.append((doc.relative_to(REPO).as_posix(), start, kind, reason,
                              "\n".join(lines[start:end]) + "\n"))
                i = end
            i += 1
    return found


EXAMPLES = _examples()


def test_every_python_example_is_marked() -> None:
    unmarked = [f"{f}:{line}" for f, line, kind, _, _ in EXAMPLES if not kind]
    assert not unmarked, f"mark these blocks (<!-- example: cpu|gpu|fragment (why) -->): {unmarked}"
    no_reason = [f"{f}:{line}" for f, line, kind, reason, _ in EXAMPLES
                 if kind == "fragment" and not reason.strip("() ")]
    assert not no_reason, f"a fragment says why it is not runnable: {no_reason}"


def _run(code: str, name: str) -> None:
    exec(compile(code, name, "exec"), {"__name__": "__doc_example__"})


@pytest.mark.parametrize(
    "example",
    [e for e in EXAMPLES if e[2] == "cpu"],
    ids=lambda e: f"{e[0]}:{e[1]}",
)
def test_cpu_example_runs(example, torch_one_thread) -> None:
    path, line, _, _, code = example
    _run(code, f"{path}:{line}")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "example",
    [e for e in EXAMPLES if e[2] == "gpu"],
    ids=lambda e: f"{e[0]}:{e[1]}",
)
def test_gpu_example_runs(example) -> None:
    path, line, _, _, code = example
    _run(code, f"{path}:{line}")


def test_readme_configuration_table_names_every_variable() -> None:
    readme = REPO / "README.md"
    text = readme.read_text()
    table = text[text.index("## Configuration"):]
    table = table[: table.index("\n## ", 1)] if "\n## " in table[1:] else table
    read = set()
    for src in (REPO / "flashinfer_h3").rglob("*.py"):
        read |= set(re.findall(r"\bFLASHINFER_H3_[A-Z0-9_]+\b", src.read_text()))
    missing = sorted(v for v in read if not re.search(rf"`{v}(=[^`]*)?`", table))
    assert not missing, f"README.md's configuration table lacks {missing}"
