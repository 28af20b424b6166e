#!/usr/bin/env python3
"""Locked instructions per message, from two callgrind runs.

Counts the instructions with a `lock` prefix, and `xchg` with a memory
operand (locked without a prefix), that two runs of different lengths
executed, and prints the difference per message: the total, then each
site with its inlined call chain (addr2line).

    valgrind --tool=callgrind --dump-instr=yes --callgrind-out-file=cg.3000 \
        $B perf stream --lat -s 64 -n 3000 -r 1
    valgrind --tool=callgrind --dump-instr=yes --callgrind-out-file=cg.6000 \
        $B perf stream --lat -s 64 -n 6000 -r 1
    bench/locked-instructions.py cg.3000 cg.6000 6600 $B

(`-n N` makes 1.1 N round trips, two messages each: 6 600 messages
between the two runs above.) Binaries are matched by the object names
callgrind recorded: the program's and libc's locked instructions are
counted.
"""

import collections
import re
import subprocess
import sys


def locked_sites(path):
    """Address -> (function, instruction) of each locked instruction."""
    out = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", path], capture_output=True, text=True
    ).stdout
    sites = {}
    fn = None
    for line in out.splitlines():
        m = re.match(r"^([0-9a-f]+) <(.*)>:", line)
        if m:
            fn = m.group(2)
            continue
        m = re.match(r"^\s*([0-9a-f]+):\s+(.*)", line)
        if not m:
            continue
        ins = m.group(2)
        if ins.startswith("lock ") or (ins.startswith("xchg") and "(" in ins):
            sites[int(m.group(1), 16)] = (fn, " ".join(ins.split()[:3]))
    return sites


def instruction_counts(path):
    """(object, address) -> instructions executed (self cost only)."""
    counts = collections.Counter()
    names = {}
    ob = None
    last = 0
    call_cost = False
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if line.startswith(("ob=", "cob=")):
                m = re.match(r"c?ob=\((\d+)\)(?: (.*))?", line)
                if m.group(2):
                    names[m.group(1)] = m.group(2)
                if line.startswith("ob="):
                    ob = m.group(1)
                continue
            if line.startswith("calls="):
                # The next cost line is the call's inclusive cost.
                call_cost = True
                continue
            if not line or line[0] not in "0123456789+-*":
                continue
            parts = line.split()
            a = parts[0]
            if a.startswith("0x"):
                addr = int(a, 16)
            elif a.startswith("+"):
                addr = last + int(a[1:], 0)
            elif a.startswith("-"):
                addr = last - int(a[1:], 0)
            elif a == "*":
                addr = last
            else:
                addr = int(a)
            last = addr
            if call_cost:
                call_cost = False
                continue
            if len(parts) >= 3:
                counts[(names.get(ob, ob), addr)] += int(parts[2])
    return counts


def chain(binary, addr):
    out = subprocess.run(
        ["addr2line", "-i", "-C", "-f", "-e", binary, hex(addr)],
        capture_output=True,
        text=True,
    ).stdout.split("\n")
    links = []
    for i in range(0, len(out) - 1, 2):
        links.append(out[i].split("::")[-1][:40] + "@" + out[i + 1].split("/")[-1])
    return " <- ".join(links[:6])


def main():
    if len(sys.argv) != 5:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    short, long_, messages, binary = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
    a = instruction_counts(short)
    b = instruction_counts(long_)
    objects = {k[0] for k in list(a) + list(b) if k[0]}
    total = 0.0
    rows = []
    for obj in objects:
        if obj != binary and "libc.so" not in obj:
            continue
        for addr, (fn, ins) in locked_sites(obj).items():
            d = (b.get((obj, addr), 0) - a.get((obj, addr), 0)) / messages
            if d:
                total += d
                rows.append((d, obj, addr, fn, ins))
    print(f"locked instructions per message: {total:.2f}")
    for d, obj, addr, fn, ins in sorted(rows, reverse=True):
        if d < 0.5:
            break
        where = chain(obj, addr) if obj == binary else fn
        print(f"{d:6.2f}  {ins:28s} {where}")


if __name__ == "__main__":
    main()
