"""The package's import graph: no cycles (module-level or inside functions), and the JIT and the
backend registry import without torch (the CLI's ``info --arch`` / ``warmup --arch`` stay fast)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import flashinfer_h3

PACKAGE = Path(flashinfer_h3.__file__).resolve().parent


def _modules() -> dict[str, Path]:
    mods = {}
    for p in PACKAGE.rglob("*.py"):
        parts = ("flashinfer_h3", *p.relative_to(PACKAGE).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = p
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Package modules imported anywhere in ``path`` (functions and TYPE_CHECKING included)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in mods)
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            base = package
            for _ in range(max(node.level - 1, 0)):
                base = base.rsplit(".", 1)[0]
            if node.level:
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            for alias in node.names:
                target = f"{mod}.{alias.name}"
                found.add(target if target in mods else mod)
    return {m for m in found if m in mods and m != name}


def test_no_import_cycles() -> None:
    mods = _modules()
    graph = {name: _imports(name, path, mods) for name, path in mods.items()}
    cycles = []

    def visit(start: str, node: str, path: list[str]) -> None:
        for nxt in sorted(graph[node]):
            if nxt == start:
                cycles.append(" -> ".join([*path, start]))
            elif nxt not in path and nxt > start:  # each cycle once, from its smallest module
                visit(start, nxt, [*path, nxt])

    for name in sorted(graph):
        visit(name, name, [name])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_jit_and_backends_import_without_torch() -> None:
    code = ("import sys; import flashinfer_h3.jit, flashinfer_h3.backends, flashinfer_h3.constants;"
            " print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"
