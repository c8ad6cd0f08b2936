"""Summarise an Nsight Compute source page: warp stall reasons and instruction mix per kernel.

Input: the CSV of ``ncu --import REPORT --page source --csv --print-source sass`` (one block per
profiled kernel launch, each starting with a "Kernel Name" row). For each kernel (the first
launch of each name), prints the stall reasons over all warp samples, the instructions with the
most samples and the executed-instruction mix by opcode.

    python benchmarks/ncu_stalls.py ncu_sass.csv --top 25
"""

from __future__ import annotations

import argparse
import collections
import csv
from pathlib import Path


def kernel_blocks(rows: list[list[str]]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(kernel name, header, instruction rows) of the first launch of each kernel name."""
    starts = [i for i, r in enumerate(rows) if r and r[0] == "Kernel Name"] + [len(rows)]
    out, seen = [], set()
    for a, b in zip(starts, starts[1:], strict=False):
        name = rows[a][1] if len(rows[a]) > 1 else "?"
        if name in seen or a + 1 >= len(rows):
            continue
        seen.add(name)
        header = rows[a + 1]
        out.append((name, header, [r for r in rows[a + 2 : b] if len(r) >= len(header)]))
    return out


def summarise(name: str, header: list[str], body: list[list[str]], top: int) -> str:
    col = {h: i for i, h in enumerate(header)}
    stalls = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]

    def num(row: list[str], key: str) -> int:
        return int(row[col[key]] or 0)

    totals: collections.Counter[str] = collections.Counter()
    mix: collections.Counter[str] = collections.Counter()
    samples = executed = 0
    for r in body:
        samples += num(r, "# Samples")
        n = num(r, "Instructions Executed")
        executed += n
        words = r[col["Source"]].split()
        op = words[1] if words and words[0].startswith("@") and len(words) > 1 else words[0]
        mix[op.split(".")[0]] += n
        for s in stalls:
            totals[s] += num(r, s)
    lines = [f"== {name[:150]}", f"warp samples {samples}, warp instructions {executed}"]
    for stall, v in totals.most_common():
        if v:
            lines.append(f"  {stall:26s} {v:8d} {100 * v / max(samples, 1):5.1f} %")
    lines.append(f"  top {top} instructions by samples:")
    for r in sorted(body, key=lambda r: -num(r, "# Samples"))[:top]:
        worst = sorted(((num(r, s), s[6:]) for s in stalls), reverse=True)[:3]
        why = " ".join(f"{s}={v}" for v, s in worst if v)
        source = r[col["Source"]].strip()[:58]
        lines.append(f"  {num(r, '# Samples'):7d} {r[col['Address']][-5:]} {source:58s} {why}")
    lines.append("  instruction mix:")
    lines += [f"  {op:10s} {100 * n / max(executed, 1):5.1f} %" for op, n in mix.most_common(15)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv", type=Path)
    p.add_argument("--top", type=int, default=25, help="instructions listed per kernel")
    args = p.parse_args(argv)
    with args.csv.open(newline="") as f:
        rows = list(csv.reader(f))
    for name, header, body in kernel_blocks(rows):
        print(summarise(name, header, body, args.top), end="\n\n")


if __name__ == "__main__":
    main()
