#!/usr/bin/env bash
# CPU time and page faults per process of short command lines, alternated:
# each round runs every entry once under `perf stat -r REPS` (the order
# reversed every other round), then prints per entry the median and mean
# of the rounds' ms of task-clock per run, the mean page faults, and every
# round's value. The load average is printed at the start and the end.
#
#   bench/proc-cost.sh ROUNDS REPS "LABEL=COMMAND LINE" ...
#   bench/proc-cost.sh 6 100 \
#     "A=/tmp/A/softrdma run --no-verbs --no-dat --sockets -- /bin/true" \
#     "B=target/release/softrdma run --no-verbs --no-dat --sockets -- /bin/true"
set -euo pipefail
rounds=$1 reps=$2
shift 2
labels=() cmds=()
for e in "$@"; do
	labels+=("${e%%=*}")
	cmds+=("${e#*=}")
done
out=$(mktemp) st=$(mktemp)
trap 'rm -f "$out" "$st"' EXIT
echo "load average at the start: $(cut -d' ' -f1-3 /proc/loadavg)"
n=${#cmds[@]}
for r in $(seq "$rounds"); do
	for k in $(seq 0 $((n - 1))); do
		if ((r % 2 == 0)); then i=$((n - 1 - k)); else i=$k; fi
		# shellcheck disable=SC2086 # the command line is word-split on purpose
		perf stat -x, -r "$reps" -e task-clock,page-faults ${cmds[$i]} >/dev/null 2>"$st"
		echo "${labels[$i]} $(grep task-clock "$st" | cut -d, -f1) $(grep page-faults "$st" | cut -d, -f1)" >>"$out"
	done
done
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
for l in "${labels[@]}"; do
	grep "^$l " "$out" | python3 -c '
import statistics as st, sys
rows = [x.split() for x in sys.stdin]
t = [float(r[1]) for r in rows]
p = [float(r[2]) for r in rows]
print(f"{sys.argv[1]:10s} ms/process median {st.median(t):.3f} mean {st.mean(t):.3f}"
      f"  page faults {st.mean(p):.1f}  rounds: " + " ".join(f"{x:.3f}" for x in t))' "$l"
done
