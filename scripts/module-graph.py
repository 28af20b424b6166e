#!/usr/bin/env python3
"""Print the engine's module import graph and its import loops.

An edge A -> B means a file of top-level module A (e.g. `cq.rs`, or
`qp/post.rs` for `qp`) names something of top-level module B through a
`crate::` / `super::` / `self::` path (`use` or an inline path).  Names
re-exported at the crate root (`crate::Device`) count as an edge to the
module that defines them.  Comments, string literals and items under a
`cfg` that mentions `test` (test modules, loom models) are left out.

`sys` is also the only place of `unsafe`: every file outside `sys/` that
says `unsafe` (code, not comments or strings; test code included), and
every `allow(unsafe_code)` / `expect(unsafe_code)` other than on `mod sys`
or on a module whose file is under `sys/` (`#[path = "sys/..."]`), is
reported as `unsafe outside sys/`.

Usage:
    scripts/module-graph.py [--src DIR] [--why] [--check]

    --src DIR   the crate's `src` (default: crates/softrdma-engine/src)
    --why       after each edge, the places (file:line) that make it
    --check     print only the import loops and `unsafe` outside `sys/`
                (or nothing) and exit 1 if there is any: for CI

Output: one line per module with the modules it imports, then every
strongly connected component with more than one module (an import loop),
largest first, and any `unsafe` outside `sys/`.  Exit status 0 without
`--check` (it measures); with `--check`, 1 if there is a loop or `unsafe`
outside `sys/`.
"""

import argparse
import os
import re
import sys
from collections import defaultdict


def strip_code(text):
    """Blank out comments, string and char literals, keeping line breaks."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            i = j
            continue
        if text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append("\n" * text.count("\n", i, j))
            i = j
            continue
        m = re.match(r'b?r(#*)"', text[i:i + 40])
        if m and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            end = '"' + m.group(1)
            j = text.find(end, i + m.end())
            j = n if j < 0 else j + len(end)
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j
            continue
        if c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j + 1
            continue
        if c == "'":
            # char literal ('a', '\n', '\u{..}') but not a lifetime ('a)
            m = re.match(r"'(\\(u\{[0-9a-fA-F]+\}|x[0-9a-fA-F]{2}|.)|[^\\'])'", text[i:i + 12])
            if m:
                out.append("' '")
                i += m.end()
                continue
        out.append(c)
        i += 1
    return "".join(out)


def skip_item(text, i):
    """Index just past the item starting at `i` (ends at `;` or its block)."""
    depth = 0
    n = len(text)
    while i < n:
        c = text[i]
        if c in "([":
            depth += 1
        elif c in ")]":
            depth -= 1
        elif c == "{":
            d, j = 1, i + 1
            while j < n and d:
                if text[j] == "{":
                    d += 1
                elif text[j] == "}":
                    d -= 1
                j += 1
            if depth == 0:
                return j
            i = j
            continue
        elif c == ";" and depth == 0:
            return i + 1
        i += 1
    return n


TEST_ATTR = re.compile(r"#\[cfg\(([^\]]*)\)\]")


def drop_test_items(text):
    """Blank out items whose `cfg` mentions `test` (keeping line breaks)."""
    out, pos = [], 0
    for m in TEST_ATTR.finditer(text):
        if m.start() < pos or not re.search(r"\btest\b", m.group(1)):
            continue
        if "not(test)" in m.group(1).replace(" ", ""):
            continue
        end = skip_item(text, m.end())
        out.append(text[pos:m.start()])
        out.append("\n" * text.count("\n", m.start(), end))
        pos = end
    out.append(text[pos:])
    return "".join(out)


def test_file_modules(src):
    """Files declared as `#[cfg(test)] mod x;` (relative paths, no .rs)."""
    skip = set()
    for root, _, files in os.walk(src):
        for f in files:
            if not f.endswith(".rs"):
                continue
            path = os.path.join(root, f)
            text = strip_code(open(path, encoding="utf-8").read())
            for m in re.finditer(r"#\[cfg\(([^\]]*)\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;", text):
                if re.search(r"\btest\b", m.group(1)):
                    rel = os.path.relpath(path, src)[:-3]
                    base = os.path.dirname(rel) if os.path.basename(rel) in ("mod", "lib") else rel
                    skip.add(os.path.normpath(os.path.join(base, m.group(2))))
    return skip


def module_path(rel):
    parts = rel[:-3].split(os.sep)
    if parts[-1] in ("mod", "lib"):
        parts = parts[:-1]
    return parts


PATH_START = re.compile(r"(?<![\w:])(crate|super|self)\b(?=\s*::)")


def parse_use_tree(text, i):
    """Parse a path tree at `i` (after a leading `::`): returns list of
    segment lists (only the leading segments matter) and end index."""
    paths = []
    segs = []
    n = len(text)
    while i < n:
        while i < n and text[i].isspace():
            i += 1
        if i < n and text[i] == "{":
            # group: split at depth-0 commas
            depth, j, start = 1, i + 1, i + 1
            items = []
            while j < n and depth:
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        items.append(text[start:j])
                elif text[j] == "," and depth == 1:
                    items.append(text[start:j])
                    start = j + 1
                j += 1
            for item in items:
                item = item.strip()
                if not item:
                    continue
                sub, _ = parse_use_tree(item, 0)
                for s in sub:
                    paths.append(segs + s)
            return paths, j
        m = re.match(r"[A-Za-z_]\w*|\*", text[i:])
        if not m:
            break
        segs.append(m.group(0))
        i += m.end()
        k = i
        while k < n and text[k].isspace():
            k += 1
        if text.startswith("::", k):
            i = k + 2
            continue
        break
    paths.append(segs)
    return paths, i


ALLOW_UNSAFE = re.compile(r"#!?\[\s*(?:allow|expect)\s*\(\s*unsafe_code\s*\)\s*\]")


def unsafe_outside_sys(src):
    """`file:line: what` for each `unsafe` outside `sys/` (see the docs)."""
    found = []
    for root, _, files in os.walk(src):
        for f in sorted(files):
            if not f.endswith(".rs"):
                continue
            path = os.path.join(root, f)
            rel = os.path.relpath(path, src)
            raw = open(path, encoding="utf-8").read()
            text = strip_code(raw)
            raw_lines = raw.split("\n")
            if rel.startswith("sys" + os.sep):
                continue
            for m in re.finditer(r"\bunsafe\b", text):
                line = text.count("\n", 0, m.start()) + 1
                found.append(f"{rel}:{line}: `unsafe` outside sys/")
            for m in ALLOW_UNSAFE.finditer(text):
                line = text.count("\n", 0, m.start()) + 1
                # the item the attribute is on: the next few lines of code
                after = " ".join(re.sub(r"//.*", "", ln) for ln in raw_lines[line - 1:line + 3])
                after = ALLOW_UNSAFE.sub("", after, count=1)
                item = re.match(
                    r'\s*(#\[path\s*=\s*"([^"]+)"\]\s*)?(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;', after
                )
                ok = False
                if item:
                    target = item.group(2)
                    if target is not None:
                        target = os.path.normpath(os.path.join(os.path.dirname(rel), target))
                        ok = target.startswith("sys" + os.sep)
                    else:
                        ok = rel == "lib.rs" and item.group(3) == "sys"
                if not ok:
                    found.append(f"{rel}:{line}: `allow(unsafe_code)` outside sys/")
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--src", default=os.path.join(here, "..", "crates", "softrdma-engine", "src"))
    ap.add_argument("--why", action="store_true")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    src = os.path.normpath(args.src)

    lib = strip_code(open(os.path.join(src, "lib.rs"), encoding="utf-8").read())
    top = set(re.findall(r"^\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;", lib, re.M))
    # names re-exported at the root: `pub use module::{A, B}` / `pub use module::A`
    reexport = {}
    for m in re.finditer(r"\buse\s+([\w:{}, \n]+);", lib):
        for segs in parse_use_tree(m.group(1), 0)[0]:
            if segs and segs[0] in top and len(segs) >= 2:
                name = segs[-1]
                reexport[name] = segs[0]

    skip = test_file_modules(src)
    # `#[path = "..."] mod name;` puts a file into the including module
    # (e.g. `pd.rs` includes `sys/register_raw.rs` as `pd::register_raw`).
    path_attr = re.compile(r'#\[path\s*=\s*"([^"]+)"\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;')
    included = {}
    for root, _, files in os.walk(src):
        for f in files:
            if f.endswith(".rs"):
                path = os.path.join(root, f)
                for m in path_attr.finditer(open(path, encoding="utf-8").read()):
                    target = os.path.normpath(os.path.join(os.path.dirname(path), m.group(1)))
                    owner_rel = os.path.relpath(path, src)
                    included[os.path.relpath(target, src)] = module_path(owner_rel) + [m.group(2)]

    edges = defaultdict(lambda: defaultdict(list))
    nodes = set(top)
    for root, _, files in os.walk(src):
        for f in sorted(files):
            if not f.endswith(".rs"):
                continue
            path = os.path.join(root, f)
            rel = os.path.relpath(path, src)
            if rel == "lib.rs" or os.path.normpath(rel[:-3]) in skip:
                continue
            mpath = included.get(rel) or module_path(rel)
            owner = mpath[0]
            text = drop_test_items(strip_code(open(path, encoding="utf-8").read()))
            # inline (non-test) `mod x { ... }` blocks extend the module path
            inline = []
            for m in re.finditer(r"\bmod\s+(\w+)\s*\{", text):
                end = skip_item(text, m.start())
                inline.append((m.start(), end, m.group(1)))
            for m in PATH_START.finditer(text):
                here_path = list(mpath) + [name for s, e, name in inline if s < m.start() < e]
                kw = m.group(1)
                i = m.end()
                k = i
                while text[k].isspace():
                    k += 1
                segs_all, _ = parse_use_tree(text, k + 2)
                for segs in segs_all:
                    if kw == "crate":
                        base = []
                    else:
                        base = here_path[:-1] if kw == "super" else list(here_path)
                    rest = list(segs)
                    while rest and rest[0] == "super":
                        base = base[:-1]
                        rest.pop(0)
                    full = base + rest
                    if not full or full[0] in ("*", "self"):
                        continue
                    target = full[0] if full[0] in top else reexport.get(full[0])
                    if target == "datamover":
                        target = "datapath"
                    if target is None or target == owner:
                        continue
                    line = text.count("\n", 0, m.start()) + 1
                    edges[owner][target].append(f"{rel}:{line}")
    # `pub(crate) use datapath::datamover` makes `datamover` an alias
    nodes.discard("datamover")

    for a in sorted(nodes):
        if args.check:
            break
        outs = sorted(edges[a])
        print(f"{a} -> {', '.join(outs) if outs else '(none)'}")
        if args.why:
            for b in outs:
                places = sorted(set(edges[a][b]))
                more = f" (+{len(places) - 4} more)" if len(places) > 4 else ""
                print(f"    {b}: {', '.join(places[:4])}{more}")

    # Tarjan's strongly connected components
    index, low, on, stack, sccs = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            sccs.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(nodes):
        if v not in index:
            visit(v)
    loops = sorted((c for c in sccs if len(c) > 1), key=lambda c: (-len(c), c))
    unsafe = unsafe_outside_sys(src)
    if args.check:
        for c in loops:
            print(f"import loop ({len(c)} modules): {', '.join(c)}", file=sys.stderr)
        for u in unsafe:
            print(u, file=sys.stderr)
        return 1 if loops or unsafe else 0
    print()
    if not loops:
        print("import loops: none")
    for c in loops:
        print(f"import loop ({len(c)} modules): {', '.join(c)}")
    for u in unsafe:
        print(u)
    return 0


if __name__ == "__main__":
    sys.exit(main())
