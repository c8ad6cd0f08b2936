"""Has a benchmark build kept production's tile loop? Two builds' consumer loops, side by side.

Usage::

    python benchmarks/sass_tile_loop.py PRODUCTION.so BUILD.so [--kernel attention_fp8_wgmma_kernel]
        [--opcodes 12]

A change outside the consumer's tile loop (an item boundary, an epilogue, the producer) still
makes ptxas schedule the whole kernel again. On the H100 every item-boundary build lost 0.6-1.7 %
at h3-10s, where the boundary is 0.4 % of the time, and its tile loop had been reordered
(benchmarks/RESULTS.md, thirty-fourth session). This CPU check runs before any device time is
spent. For each kernel it finds the innermost loops that hold the consumers' 64 x N wgmmas
(`HGMMA.64x128` / `QGMMA.64x128`, `.64x256`) and prints, for each:
- the loop's instruction count;
- its wgmmas;
- the stall cycles that ptxas encoded in the instructions' control bits, summed. These are the
  fixed-latency part of the schedule; the scoreboard waits of loads, MUFU and wgmma are not in
  them, so the sum is no timing (a lower sum has measured slower);
- the same two counts along a steady-state tile's path (no predicated branch taken: not the
  masked softmax of a segment's last tile): what one consumer warp issues a tile. On the H100
  the FP8 kernel's tile took 1.01-1.05x the sum of its two consumer warps' path stall cycles
  (they share each SM sub-partition's issue slot and MUFU), across 128- and 256-key builds
  (benchmarks/RESULTS.md, forty-first session); a change of a few percent is still no timing.
With ``--opcodes N``, each loop's tile path by opcode as well (the N with most stall cycles). A
stall is charged to the instruction that encodes it: in the FP8 kernel's exponentials, issued one
MUFU.EX2 every 8 cycles, the FADD of the row sum after each MUFU carries up to 7 of them, so its
~530 cycles a tile are MUFU throughput, not an FADD chain (forty-second session).
Then, loop by loop, how many of BUILD's instructions keep PRODUCTION's order once register and
predicate names are masked. All of them: the same loop, renamed. Fewer: a new schedule, which
only a timing can judge.

The control bits are not documented by NVIDIA. Their layout since Volta (the stall count in bits
105-108 of the 128-bit instruction, bits 41-44 of the second 64-bit word that cuobjdump prints)
is from Jia et al., "Dissecting the NVIDIA Volta GPU Architecture via Microbenchmarking" (2018).
"""

from __future__ import annotations

import argparse
import difflib
import re
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s*/\* 0x[0-9a-f]+ \*/")
_CONTROL = re.compile(r"^\s*/\* (0x[0-9a-f]+) \*/\s*$")
_CONSUMER_MMA = re.compile(r"^[HQ]GMMA\.64x(?:128|256)x")
_NAMES = re.compile(r"\bU?R\d+\b|\bU?P\d\b")


@dataclass
class Loop:
    first: int  # instruction index of the loop head (the back branch's target)
    last: int  # instruction index of the back branch
    instructions: list[str]
    stall_cycles: int
    wgmmas: int
    # The fall-through path from head to back branch (a predicated branch not taken, a plain
    # one followed): a steady-state tile, whose branches skip the masked softmax of a segment's
    # last tile, the one thread's barrier arrivals and the waits' retries. Its instructions and
    # encoded stall cycles by opcode (predicate dropped, modifiers kept): what one consumer warp
    # issues a tile, and where its issue time goes. A stall is charged to the instruction that
    # encodes it, so a MUFU-bound stretch shows as stalls on whatever follows each MUFU.EX2.
    path_opcodes: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def path_instructions(self) -> int:
        return sum(n for n, _ in self.path_opcodes.values())

    @property
    def path_stall_cycles(self) -> int:
        return sum(c for _, c in self.path_opcodes.values())


def _opcode(text: str) -> str:
    words = text.split()
    return words[1] if words[0].startswith("@") else words[0]


def function_sass(so: Path, kernel: str) -> str:
    """``cuobjdump --dump-sass`` of the one function of ``so`` named *kernel*."""
    sass = subprocess.run(["cuobjdump", "--dump-sass", str(so)], capture_output=True, text=True,
                          check=True).stdout
    blocks = re.split(r"\n\s*Function : ", sass)
    mine = [b for b in blocks[1:] if kernel in b.split("\n", 1)[0]]
    if len(mine) != 1:
        raise SystemExit(f"{so}: expected one function named *{kernel}*, found {len(mine)}")
    return mine[0]


def instructions(sass: str) -> list[tuple[int, str, int]]:
    """(address, text, stall cycles) of every instruction of one function's SASS."""
    lines = sass.splitlines()
    out = []
    for i, line in enumerate(lines[:-1]):
        m = _INSTRUCTION.match(line)
        control = _CONTROL.match(lines[i + 1])
        if m and control:
            out.append((int(m.group(1), 16), m.group(2), (int(control.group(1), 16) >> 41) & 0xF))
    return out


def consumer_loops(sass: str) -> list[Loop]:
    """The innermost loops (back branch to head) of one function's SASS that hold a consumer
    wgmma, in code order."""
    ins = instructions(sass)
    index = {address: i for i, (address, _, _) in enumerate(ins)}
    mma = [i for i, (_, text, _) in enumerate(ins) if _CONSUMER_MMA.match(_opcode(text))]
    # The waits' retry paths sit after the last EXIT, out of line, and branch back into the body:
    # not loops of the body.
    exits = [i for i, (_, text, _) in enumerate(ins) if _opcode(text) == "EXIT"]
    spans = []
    for i, (_, text, _) in enumerate(ins[:max(exits, default=len(ins))]):
        target = re.search(r"\b0x([0-9a-f]+)\b", text) if _opcode(text).startswith("BRA") else None
        head = index.get(int(target.group(1), 16)) if target else None
        if head is not None and head < i and any(head <= j <= i for j in mma):
            spans.append((head, i))
    innermost = [s for s in spans
                 if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in spans)]
    loops = []
    for a, b in sorted(innermost):
        count, cycles = Counter(), Counter()
        for j in tile_path(ins, index, a, b):
            op = _opcode(ins[j][1])
            count[op] += 1
            cycles[op] += ins[j][2]
        loops.append(Loop(a, b, [t for _, t, _ in ins[a:b + 1]], sum(c for _, _, c in ins[a:b + 1]),
                          sum(1 for j in mma if a <= j <= b),
                          {op: (count[op], cycles[op]) for op in count}))
    return loops


def tile_path(ins: list[tuple[int, str, int]], index: dict[int, int], first: int,
              last: int) -> list[int]:
    """Instruction indices of the path from ``first`` to ``last`` that takes no predicated
    branch and follows every plain one (a forward jump inside the loop)."""
    i, path = first, []
    while first <= i <= last and len(path) <= last - first:
        path.append(i)
        if i == last:
            break
        target = re.match(r"BRA 0x([0-9a-f]+)\b", ins[i][1])  # a predicated one starts with @
        i = index.get(int(target.group(1), 16), last + 1) if target else i + 1
    return path


def print_opcodes(loop: Loop, label: str, top: int) -> None:
    """The ``top`` opcodes of a loop's tile path by encoded stall cycles."""
    print(f"{label}: a tile's path by opcode (instructions, stall cycles), {top} with most cycles")
    ranked = sorted(loop.path_opcodes.items(), key=lambda kv: (-kv[1][1], kv[0]))
    for op, (n, cycles) in ranked[:top]:
        print(f"  {op:44s} {n:5d} {cycles:6d}")


def kept_order(base: list[str], build: list[str]) -> int:
    """How many of build's instructions keep base's order, register and predicate names masked
    (and branch targets: addresses move with any change before them)."""
    def mask(seq: list[str]) -> list[str]:
        return [_NAMES.sub("R", re.sub(r"0x[0-9a-f]+", "ADDR", s)) for s in seq]
    matcher = difflib.SequenceMatcher(None, mask(base), mask(build), autojunk=False)
    return sum(block.size for block in matcher.get_matching_blocks())


def compare(production: Path, build: Path, kernel: str, opcodes: int = 0) -> bool:
    """Print both builds' consumer loops (and, opcodes > 0, that many opcodes of each loop's
    tile path) and, loop by loop, how many of BUILD's instructions keep PRODUCTION's order; True
    if every loop is the same one, renamed at most."""
    base = consumer_loops(function_sass(production, kernel))
    other = consumer_loops(function_sass(build, kernel))
    for label, loops in (("production", base), ("build", other)):
        for n, loop in enumerate(loops):
            print(f"{label} loop {n}: instructions {loop.first}-{loop.last} "
                  f"({len(loop.instructions)}), {loop.wgmmas} wgmmas, "
                  f"{loop.stall_cycles} encoded stall cycles; a steady-state tile's path "
                  f"{loop.path_instructions} instructions, {loop.path_stall_cycles} stall cycles")
            if opcodes > 0:
                print_opcodes(loop, f"{label} loop {n}", opcodes)
    if len(base) != len(other):
        print(f"different loop structure: {len(base)} consumer loops against {len(other)}")
        return False
    same = True
    for n, (a, b) in enumerate(zip(base, other, strict=True)):
        kept = kept_order(a.instructions, b.instructions)
        same &= kept == len(a.instructions) == len(b.instructions)
        print(f"loop {n}: {kept} of the build's {len(b.instructions)} instructions in "
              f"production's order (names masked); stall cycles "
              f"{b.stall_cycles - a.stall_cycles:+d}")
    print("same loops, renamed at most" if same else "rescheduled: only a timing can judge it")
    return same


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("production", type=Path)
    parser.add_argument("build", type=Path)
    parser.add_argument("--kernel", default="attention_nvfp4_wgmma_kernel",
                        help="a part of the kernel's mangled name (one function must match)")
    parser.add_argument("--opcodes", type=int, default=0, metavar="N",
                        help="also print each loop's tile path by opcode (the N with most "
                             "stall cycles)")
    args = parser.parse_args()
    return 0 if compare(args.production, args.build, args.kernel, args.opcodes) else 1


if __name__ == "__main__":
    sys.exit(main())
