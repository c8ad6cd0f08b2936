"""Compare the SASS of every kernel in two JIT caches, kernel by kernel ("same SASS" checks).

Usage::

    FLASHINFER_H3_CACHE_DIR=/tmp/before python -m flashinfer_h3 warmup --arch sm_90a,sm_120a
    # ... move code ...
    FLASHINFER_H3_CACHE_DIR=/tmp/after python -m flashinfer_h3 warmup --arch sm_90a,sm_120a
    python benchmarks/sass_diff.py /tmp/before /tmp/after [--show NAME_PART] [--rename OLD=NEW]

Each ``.so`` under a cache is dumped with ``cuobjdump --dump-sass``; a kernel is keyed by
``<arch>/<module>`` and its mangled name, with anonymous-namespace hashes masked (and ``--rename``
applied, for a renamed namespace). Instruction addresses, encodings and ELF headers are dropped,
so two kernels compare equal exactly when their instruction streams are the same. Prints one line
a kernel (IDENTICAL, DIFFERENT, ONLY-BEFORE, ONLY-AFTER) and a unified diff of the kernels whose
name contains ``--show``. Exit code 1 when a kernel present in both differs.
"""

from __future__ import annotations

import argparse
import difflib
import re
import subprocess
import sys
from pathlib import Path

_HEADER = re.compile(r"(identifier|code version|host|compile_size|code for|Fatbin|arch)\b")
_ANON = re.compile(r"(\d+)_GLOBAL__N__")


def _mask_anonymous(name: str) -> str:
    """Replace each anonymous namespace (a length-prefixed ``_GLOBAL__N__<hashes>`` component of
    the mangled name, different in every translation unit) by ``ANON``."""
    while (m := _ANON.search(name)) is not None:
        length = int(m.group(1))
        start = m.start(1) + len(m.group(1))
        name = name[: m.start()] + "4ANON" + name[start + length:]
    return name


def kernels(cache: Path, renames: list[tuple[str, str]]) -> dict[tuple[str, str], list[str]]:
    out: dict[tuple[str, str], list[str]] = {}
    for so in sorted(Path(cache).rglob("*.so")):
        module = re.sub(r"_hd\d+_sm\d+a_[0-9a-f]+$", "", so.stem)
        where = f"{so.parent.parent.name}/{module}"
        text = subprocess.run(["cuobjdump", "--dump-sass", str(so)], capture_output=True,
                              text=True, check=True).stdout
        key = None
        for line in text.splitlines():
            m = re.search(r"Function : (\S+)", line)
            if m:
                name = _mask_anonymous(m.group(1))
                for old, new in renames:
                    name = name.replace(old, new)
                key = (where, name)
                out.setdefault(key, [])
                continue
            if key is None:
                continue
            line = re.sub(r"/\*[0-9a-f]{4,}\*/|/\* 0x[0-9a-f]+ \*/", "", line).strip()
            if line and not re.fullmatch(r"[=.]+", line) and not _HEADER.match(line) \
                    and ".target" not in line and ".section" not in line:
                out[key].append(line)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--show", help="print the diff of the kernels whose name contains this")
    parser.add_argument("--rename", action="append", default=[], metavar="OLD=NEW",
                        help="a renamed namespace or kernel (e.g. attn_sm120=attn_nvfp4)")
    args = parser.parse_args()
    renames = [tuple(r.split("=", 1)) for r in args.rename]
    a, b = kernels(args.before, renames), kernels(args.after, renames)
    different = 0
    for key in sorted(set(a) | set(b)):
        where, name = key
        if key not in b:
            print(f"ONLY-BEFORE {where} {name}")
        elif key not in a:
            print(f"ONLY-AFTER  {where} {name}")
        elif a[key] == b[key]:
            print(f"IDENTICAL   {where} {name} ({len(a[key])} lines)")
        else:
            different += 1
            print(f"DIFFERENT   {where} {name} ({len(a[key])} -> {len(b[key])} lines)")
            if args.show and args.show in name:
                print("\n".join(difflib.unified_diff(a[key], b[key], lineterm="")))
    print(f"{len(set(a) & set(b)) - different} identical, {different} different")
    return 1 if different else 0


if __name__ == "__main__":
    sys.exit(main())
