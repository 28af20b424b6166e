#!/usr/bin/env python3
"""Where the CPU went in the two phases of one `softrdma perf ... --baseline tcp`.

    perf sched record -o DATA -- softrdma perf write -s 1M -n 500 --baseline tcp --json
    bench/sched-phases.py DATA [RATIO]

Splits the trace into the softrdma phase (from the first run of the
`softrdma-dm0` engine thread to the first run of the TCP baseline's
passive thread, the last thread the process starts) and the TCP phase
(from there to the last run of any of the process's threads), and prints
one Markdown table row per trace:

    | ratio | phase ms | CPU µs per MiB | % of a CPU | % of it on CPU 1 | others | waiting | asleep | ...

for the softrdma phase, then the TCP phase:

* CPU µs per MiB: the process's threads' run time in the phase
  (`sched_stat_runtime`) per MiB moved (`-n`, default 500, from $MIB);
* % of a CPU: that run time over the phase's length (100: one whole CPU);
* % of it on CPU 1: the part that ran on CPU 1 (where `AB_HOG_CPUS=1`
  puts the hog);
* others: the run time of every other task but the hog (`bash`) over the
  phase's length (100: one CPU's worth of other work);
* waiting: the share of the phase during which no thread of the process
  ran but one was runnable (woken or preempted, waiting for a CPU);
* asleep: the share during which no thread of the process was runnable
  at all (the process waited on itself, a timer or the kernel).

The measuring thread (the poster in the softrdma phase, the writer in the
TCP phase) is one of the process's threads; a thread that calls
`sched_yield` stays runnable (a spinning CQ wait yields every 64 empty
polls). Needs `perf` with the sched tracepoints (root).
"""
import collections
import os
import re
import subprocess
import sys


def main():
    data = sys.argv[1]
    ratio = sys.argv[2] if len(sys.argv) > 2 else ""
    mib = float(os.environ.get("MIB", "500"))
    script = subprocess.run(
        ["perf", "sched", "script", "-i", data, "-F", "cpu,time,event,trace"],
        capture_output=True, text=True, check=True).stdout.splitlines()
    timehist = subprocess.run(["perf", "sched", "timehist", "-i", data],
                              capture_output=True, text=True, check=True).stdout
    m = re.search(r"softrdma-dm0\[(\d+)/(\d+)\]", timehist)
    if not m:
        sys.exit(f"{data}: no softrdma-dm0 thread in the trace")
    dm0, pid = int(m.group(1)), int(m.group(2))
    names = {int(t): n for n, t in re.findall(r"([\w-]+)\[(\d+)/%d\]" % pid, timehist)}
    tids = set(names) | {pid}

    events = []
    for line in script:
        m = re.match(r"\[(\d+)\]\s+([\d.]+):\s+sched:(\w+):\s+(.*)", line)
        if m:
            events.append((int(m.group(1)), float(m.group(2)), m.group(3), m.group(4)))

    def next_pid(trace):
        return int(re.search(r"next_pid=(\d+)", trace).group(1))

    first = {}
    for cpu, t, ev, tr in events:
        if ev == "sched_switch" and next_pid(tr) in tids:
            first.setdefault(next_pid(tr), t)
    if dm0 not in first:
        sys.exit(f"{data}: softrdma-dm0 never ran")
    t0 = first[dm0]
    tcp = [(t, k) for k, t in first.items()
           if k != pid and not names.get(k, "").startswith("softrdma") and t > t0]
    if not tcp:
        sys.exit(f"{data}: no TCP baseline thread after the engine thread")
    ts = max(tcp)[0]
    te = max(t for _, t, ev, tr in events if ev == "sched_switch" and next_pid(tr) in tids)
    length = {"R": (ts - t0) * 1e3, "T": (te - ts) * 1e3}

    def phase(t):
        return "R" if t < ts else "T"

    run = collections.defaultdict(float)
    for cpu, t, ev, tr in events:
        if ev != "sched_stat_runtime" or not t0 <= t <= te:
            continue
        m = re.search(r"comm=(.*) pid=(\d+) runtime=(\d+)", tr)
        p = int(m.group(2))
        who = "ours" if p in tids else ("hog" if m.group(1) == "bash" else "other")
        run[(phase(t), who, cpu)] += int(m.group(3)) / 1e6

    on_cpu = {}
    runnable = set()
    state = collections.defaultdict(float)
    last = t0

    def account(t):
        nonlocal last
        a, b = max(last, t0), min(t, te)
        if b > a:
            if any(x in tids for x in on_cpu.values()):
                k = "running"
            elif runnable:
                k = "waiting"
            else:
                k = "asleep"
            state[(phase(a), k)] += (b - a) * 1e3
        last = max(last, t)

    for cpu, t, ev, tr in events:
        if ev in ("sched_wakeup", "sched_wakeup_new"):
            account(t)
            p = int(re.search(r"pid=(\d+)", tr).group(1))
            if p in tids:
                runnable.add(p)
        elif ev == "sched_switch":
            account(t)
            m = re.search(r"prev_pid=(\d+) prev_prio=\d+ prev_state=(\S+)", tr)
            prev, n = int(m.group(1)), next_pid(tr)
            if prev in tids:
                if m.group(2).startswith("R"):
                    runnable.add(prev)
                else:
                    runnable.discard(prev)
            runnable.discard(n)
            on_cpu[cpu] = n

    row = [ratio]
    for ph in "RT":
        ours = sum(v for (p, w, _), v in run.items() if p == ph and w == "ours")
        on1 = sum(v for (p, w, c), v in run.items() if p == ph and w == "ours" and c == 1)
        other = sum(v for (p, w, _), v in run.items() if p == ph and w == "other")
        row += [f"{length[ph]:.0f}", f"{ours * 1000 / mib:.0f}",
                f"{ours / length[ph] * 100:.0f}", f"{on1 / max(ours, 1e-9) * 100:.0f}",
                f"{other / length[ph] * 100:.0f}",
                f"{state[(ph, 'waiting')] / length[ph] * 100:.0f}",
                f"{state[(ph, 'asleep')] / length[ph] * 100:.0f}"]
    print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
