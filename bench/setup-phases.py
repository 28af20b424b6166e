#!/usr/bin/env python3
"""Where one connection of `softrdma perf stream --setup` spends its time.

    perf record -e sched:sched_waking -e 'syscalls:sys_enter_connect' \\
        -e 'syscalls:sys_enter_sendto' -e 'syscalls:sys_enter_write' \\
        -e 'syscalls:sys_enter_shutdown' -e 'syscalls:sys_enter_close' \\
        -o DATA -- softrdma perf stream --setup -n 300 -r 1 [--mode tcp]
    perf script -i DATA -F tid,time,event,trace > DATA.txt
    bench/setup-phases.py DATA.txt

Prints two tables, per connection:

* the wake-ups between threads (`sched_waking`: waker -> wakee), the
  threads named by role: `client` (the thread that calls `connect` most),
  `server` (the thread the client wakes most, other than the twin),
  `twin` (`softrdma-sd-twi`), the engine's by their names;
* the client thread's steps: its system calls in the order of the most
  common per-connection sequence (a sequence starts at the `connect` of
  the measured stream), `sendto`/`write` named with their length, and the
  median and mean µs from each step to the next. The time from the last
  step to the next connection's first is the last row.

A step that waits shows as a long gap after it: in an offloaded
connection, the `connect` (the answer to the capability query, then the
MPA Request), the MPA Request (the Reply), the data (the echo), the
`shutdown` (the peer's FIN).
"""

import re
import statistics
import sys
from collections import Counter, defaultdict

LINE = re.compile(r"\s*(\d+)\s+([\d.]+):\s+(\S+):\s+(.*)")


def main(path):
    events = []
    for line in open(path):
        m = LINE.match(line)
        if m:
            events.append((int(m.group(1)), float(m.group(2)), m.group(3), m.group(4)))
    connects = Counter(t for t, _, ev, _ in events if ev.endswith("sys_enter_connect"))
    if not connects:
        sys.exit("no connect calls in the trace")
    client = connects.most_common(1)[0][0]

    # Wake-ups by role.
    comm_of = {}
    wakes = Counter()
    for tid, _, ev, rest in events:
        if ev != "sched:sched_waking":
            continue
        m = re.search(r"comm=(\S+) pid=(\d+)", rest)
        if not m:
            continue
        comm_of[int(m.group(2))] = m.group(1)
        wakes[(tid, int(m.group(2)))] += 1
    from_client = Counter({w: n for (c, w), n in wakes.items() if c == client})
    server = None
    for w, _ in from_client.most_common():
        if comm_of.get(w) == comm_of.get(client) and w != client:
            server = w
            break

    def role(t):
        if t == client:
            return "client"
        if t == server:
            return "server"
        return comm_of.get(t, str(t))

    # The client's steps, one sequence per stream connect: the stream's
    # descriptor is the one connected most often (the query socket once).
    cev = [e for e in events if e[0] == client and e[2].startswith("syscalls:")]
    fds = Counter(
        re.search(r"fd: (0x[0-9a-f]+)", r).group(1)
        for _, _, ev, r in cev
        if ev.endswith("sys_enter_connect")
    )
    stream_fd = fds.most_common(1)[0][0]

    def label(ev, rest):
        name = ev.split("sys_enter_")[-1]
        if name in ("sendto", "write"):
            n = int(re.search(r"(?:len|count): (0x[0-9a-f]+)", rest).group(1), 16)
            return f"{name} {n}"
        return name

    seqs, cur = [], None
    for _, t, ev, rest in cev:
        if ev.endswith("sys_enter_connect") and f"fd: {stream_fd}," in rest:
            if cur:
                cur.append(("next connect", t))
                seqs.append(cur)
            cur = []
        if cur is not None:
            cur.append((label(ev, rest), t))
    n = len(seqs) + 1
    print(f"connections: {n}; client thread {client}, server thread {server}")
    print()
    print("| waker -> wakee | per connection |")
    print("|---|---|")
    by_role = defaultdict(int)
    for (a, b), k in wakes.items():
        by_role[(role(a), role(b))] += k
    for (a, b), k in sorted(by_role.items(), key=lambda x: -x[1]):
        if k / n >= 0.01:
            print(f"| {a} -> {b} | {k / n:.2f} |")
    print()
    pats = Counter(tuple(s for s, _ in q) for q in seqs)
    pat, count = pats.most_common(1)[0]
    print(f"client steps ({count} of {len(seqs)} connections in this order):")
    print()
    print("| step | to the next, median µs | mean µs |")
    print("|---|---|---|")
    gaps = [[] for _ in pat]
    for q in seqs:
        if tuple(s for s, _ in q) == pat:
            for i in range(len(q) - 1):
                gaps[i].append((q[i + 1][1] - q[i][1]) * 1e6)
    for i in range(len(pat) - 1):
        g = gaps[i]
        print(f"| {pat[i]} | {statistics.median(g):.1f} | {statistics.mean(g):.1f} |")
    whole = [(q[-1][1] - q[0][1]) * 1e6 for q in seqs if tuple(s for s, _ in q) == pat]
    print(f"| (connect to next connect) | {statistics.median(whole):.1f} | {statistics.mean(whole):.1f} |")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
