#!/usr/bin/env bash
# A/B comparison of two `softrdma` binaries with `softrdma perf`, alternated
# in one run (A B, then B A, ...), each with its TCP baseline measured in
# the same invocation:
#   * RDMA Write 1 MiB bandwidth (MB/s) and blocking TCP (`--baseline tcp`)
#   * Send 8 B latency, one way: mean, p50, p99 (µs) and busy-polled TCP
#     (`--baseline tcp-spin`) mean
# Prints every run (with the 1-minute load average at its start) and the
# median of each column per side.
#
#   bench/ab-perf.sh BIN_A BIN_B [ROUNDS] [--load N]
#
# --load N keeps N CPUs busy with a CPU hog (`bash -c 'while :; do :; done'`,
# hog i pinned to CPU i) for the whole comparison, ended by PID afterwards.
# Binaries: e.g. `cargo build --release -p softrdma-cli` at two commits,
# copies of target/release/softrdma.
set -euo pipefail

if [ $# -lt 2 ]; then
    echo "usage: $0 BIN_A BIN_B [ROUNDS] [--load N]" >&2
    exit 2
fi
bin_a=$1
bin_b=$2
shift 2
rounds=3
load=0
while [ $# -gt 0 ]; do
    case $1 in
    --load) load=$2; shift 2 ;;
    *) rounds=$1; shift ;;
    esac
done

hogs=()
cleanup() {
    for p in "${hogs[@]}"; do kill "$p" 2>/dev/null || true; done
}
trap cleanup EXIT
ncpu=$(nproc)
for i in $(seq 0 $((load - 1))); do
    taskset -c $((i % ncpu)) timeout 3600 bash -c 'while :; do :; done' &
    hogs+=($!)
done

field() { # json key
    sed -n "s/.*\"$2\":\([0-9.e+-]*\).*/\1/p" <<<"$1"
}

results=$(mktemp)
one() { # side bin
    local side=$1 bin=$2 la out
    la=$(cut -d' ' -f1 /proc/loadavg)
    out=$(timeout 120 "$bin" perf write -s 1M -n 300 --baseline tcp --json 2>/dev/null | tail -1) || out=
    echo "$side bw load=$la write_mb_s=$(field "$out" mb_s) tcp_mb_s=$(field "$out" tcp_mb_s)" | tee -a "$results"
    la=$(cut -d' ' -f1 /proc/loadavg)
    out=$(timeout 120 "$bin" perf send -s 8 --lat -n 3000 --baseline tcp-spin --json 2>/dev/null | tail -1) || out=
    echo "$side lat load=$la mean=$(field "$out" lat_mean_us) p50=$(field "$out" lat_p50_us) p99=$(field "$out" lat_p99_us) tcp_spin_mean=$(field "$out" tcp_lat_mean_us)" | tee -a "$results"
}

echo "# $(date -u +%FT%TZ) nproc=$ncpu hogs=$load loadavg: $(cat /proc/loadavg)"
for r in $(seq 1 "$rounds"); do
    if [ $((r % 2)) -eq 1 ]; then
        one A "$bin_a"; one B "$bin_b"
    else
        one B "$bin_b"; one A "$bin_a"
    fi
done

median() {
    sort -g | awk '{v[NR]=$1} END {if (NR==0) print "n/a"; else if (NR%2) print v[(NR+1)/2]; else print (v[NR/2]+v[NR/2+1])/2}'
}
echo "# medians of $rounds rounds"
for side in A B; do
    line="$side"
    for key in write_mb_s tcp_mb_s mean p50 p99 tcp_spin_mean; do
        v=$(grep "^$side " "$results" | tr ' ' '\n' | sed -n "s/^$key=\(.\+\)$/\1/p" | median)
        line="$line $key=$v"
    done
    echo "$line"
done
rm -f "$results"
