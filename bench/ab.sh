#!/usr/bin/env bash
# A/B comparison of two commits with the engine's loopback benchmark.
#
#   bench/ab.sh REV_A REV_B [ROUNDS]      (default 3 rounds)
#
# Exports each commit (git archive) to /tmp/softrdma-ab/<sha> (kept, so a
# second comparison reuses the builds), builds its `loopback_bench` example
# in release mode, then alternates the two binaries ROUNDS times (A B, then
# B A, ...) on:
#   * RDMA Write 1 MiB bandwidth, 1 QP, CRC off (MB/s, higher is better)
#   * Send/Recv 8 B ping-pong half round trip (µs, lower is better)
# and prints the median of each side and the ratio B/A. Each benchmark call
# is one run of the example's --quick mode. The machine is shared: keep
# ROUNDS small and read small differences as noise.
set -euo pipefail

if [ $# -lt 2 ]; then
    echo "usage: $0 REV_A REV_B [ROUNDS]" >&2
    exit 2
fi
cd "$(git rev-parse --show-toplevel)"
rounds=${3:-3}
work=${AB_DIR:-/tmp/softrdma-ab}
mkdir -p "$work"

build() {
    local sha dir
    sha=$(git rev-parse --short=12 "$1^{commit}")
    dir=$work/$sha
    if [ ! -f "$dir/.exported" ]; then
        rm -rf "$dir"
        mkdir -p "$dir"
        git archive "$sha" | tar -x -C "$dir"
        touch "$dir/.exported"
    fi
    echo "== building $1 ($sha)" >&2
    (cd "$dir" && CARGO_TARGET_DIR="$dir/target" cargo build --release --quiet \
        -p softrdma-engine --example loopback_bench >&2)
    echo "$dir/target/release/examples/loopback_bench"
}

bin_a=$(build "$1")
bin_b=$(build "$2")

results=$(mktemp)
trap 'rm -f "$results"' EXIT

one() { # side binary
    local side=$1 bin=$2 out
    out=$("$bin" write --runs 1 --quick)
    echo "$side write $(echo "$out" | sed -n 's/.*CRC off: softrdma *\([0-9.]*\) MB\/s.*/\1/p')" >>"$results"
    out=$("$bin" pingpong --runs 1 --quick)
    echo "$side pingpong $(echo "$out" | sed -n 's/.*half RTT: softrdma \([0-9.]*\) µs.*/\1/p')" >>"$results"
}

for r in $(seq 1 "$rounds"); do
    echo "== round $r of $rounds" >&2
    if [ $((r % 2)) -eq 1 ]; then
        one A "$bin_a"; one B "$bin_b"
    else
        one B "$bin_b"; one A "$bin_a"
    fi
done

python3 - "$results" "$1" "$2" "$rounds" <<'EOF'
import statistics, sys
path, rev_a, rev_b, rounds = sys.argv[1:]
vals = {}
for line in open(path):
    side, test, v = line.split()
    vals.setdefault((side, test), []).append(float(v))
print(f"A = {rev_a}, B = {rev_b}, medians of {rounds} alternating rounds")
for test, unit, better in [("write", "MB/s", "higher"), ("pingpong", "µs", "lower")]:
    a = statistics.median(vals[("A", test)])
    b = statistics.median(vals[("B", test)])
    name = {"write": "RDMA Write 1 MiB bandwidth", "pingpong": "Send 8 B half RTT"}[test]
    print(f"{name:28} A {a:9.2f} {unit:5} B {b:9.2f} {unit:5} B/A {b / a:5.3f} ({better} is better)")
EOF
