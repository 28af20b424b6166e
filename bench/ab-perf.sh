#!/usr/bin/env bash
# A/B comparison of two `softrdma` builds with `softrdma perf`, alternated
# in one run (A B, then B A, ...), each with its TCP baseline measured in
# the same invocation:
#   * RDMA Write 1 MiB bandwidth (MB/s) and blocking TCP (`--baseline tcp`)
#   * Send 8 B latency, one way: mean, p50, p99 (µs) and busy-polled TCP
#     (`--baseline tcp-spin`) mean
# Prints every run (with the 1-minute load average at its start), then per
# side the median and the mean of each column over the runs, and of the
# ratios that the goals are stated in (computed per run):
#   write/tcp      Write MB/s ÷ TCP MB/s                  (goal with a hog: ≥ 0.9)
#   mean/tcpspin   8 B mean ÷ busy-polled TCP's 8 B mean   (goal with a hog: ≤ 1.5)
#   p99/p50        8 B p99 ÷ 8 B median                    (goal: ≤ 10)
#
#   bench/ab-perf.sh BIN_A BIN_B [ROUNDS] [--load N] [--bw-iters N] [--lat-iters N]
#
# BIN_A / BIN_B: a `softrdma` binary, or a command line that runs one (word
# split, e.g. "env SOFTRDMA_POLL_ADAPTIVE=0 /tmp/softrdma-b"), e.g. copies of
# target/release/softrdma built at two commits.
# --load N keeps N CPUs busy with a CPU hog (`bash -c 'while :; do :; done'`,
# hog i pinned to CPU i mod nproc, or to the CPUs in $AB_HOG_CPUS, e.g. "1")
# for the whole comparison, the same for both builds and for the TCP
# baselines; ended by PID afterwards.
set -euo pipefail

if [ $# -lt 2 ]; then
    echo "usage: $0 BIN_A BIN_B [ROUNDS] [--load N] [--bw-iters N] [--lat-iters N]" >&2
    exit 2
fi
read -ra cmd_a <<<"$1"
read -ra cmd_b <<<"$2"
shift 2
rounds=3
load=0
bw_iters=300
lat_iters=5000
while [ $# -gt 0 ]; do
    case $1 in
    --load) load=$2; shift 2 ;;
    --bw-iters) bw_iters=$2; shift 2 ;;
    --lat-iters) lat_iters=$2; shift 2 ;;
    *) rounds=$1; shift ;;
    esac
done

# shellcheck source=bench/ab-common.sh
. "$(dirname "${BASH_SOURCE[0]}")/ab-common.sh"
start_hogs "$load"
ncpu=$(nproc)
ratio() { # a b
    awk -v a="$1" -v b="$2" 'BEGIN { if (a == "" || b == "" || b + 0 == 0) print ""; else printf "%.3f", a / b }'
}

one() { # side cmd...
    local side=$1 la out w t m p50 p99 ts
    shift
    la=$(cut -d' ' -f1 /proc/loadavg)
    out=$(timeout 120 "$@" perf write -s 1M -n "$bw_iters" --baseline tcp --json 2>/dev/null | tail -1) || out=
    w=$(field "$out" mb_s)
    t=$(field "$out" tcp_mb_s)
    echo "$side bw load=$la write_mb_s=$w tcp_mb_s=$t write/tcp=$(ratio "$w" "$t")" | tee -a "$results"
    la=$(cut -d' ' -f1 /proc/loadavg)
    out=$(timeout 120 "$@" perf send -s 8 --lat -n "$lat_iters" --baseline tcp-spin --json 2>/dev/null | tail -1) || out=
    m=$(field "$out" lat_mean_us)
    p50=$(field "$out" lat_p50_us)
    p99=$(field "$out" lat_p99_us)
    ts=$(field "$out" tcp_lat_mean_us)
    echo "$side lat load=$la mean=$m p50=$p50 p99=$p99 tcp_spin_mean=$ts mean/tcpspin=$(ratio "$m" "$ts") p99/p50=$(ratio "$p99" "$p50")" | tee -a "$results"
}

echo "# $(date -u +%FT%TZ) nproc=$ncpu hogs=$load loadavg: $(cat /proc/loadavg)"
echo "# A: ${cmd_a[*]}"
echo "# B: ${cmd_b[*]}"
for r in $(seq 1 "$rounds"); do
    if [ $((r % 2)) -eq 1 ]; then
        one A "${cmd_a[@]}"; one B "${cmd_b[@]}"
    else
        one B "${cmd_b[@]}"; one A "${cmd_a[@]}"
    fi
done

median() {
    sort -g | awk '{v[NR]=$1} END {if (NR==0) print "n/a"; else if (NR%2) print v[(NR+1)/2]; else print (v[NR/2]+v[NR/2+1])/2}'
}
mean() {
    awk '{s+=$1; n++} END {if (n==0) print "n/a"; else printf "%.4g\n", s/n}'
}
echo "# $rounds rounds, loadavg at the end: $(cat /proc/loadavg)"
for stat in median mean; do
    for side in A B; do
        line="$stat $side"
        for key in load write_mb_s tcp_mb_s write/tcp mean p50 p99 tcp_spin_mean mean/tcpspin p99/p50; do
            v=$(grep "^$side " "$results" | tr ' ' '\n' | grep -F "$key=" | sed -n "s|^$key=\(.\+\)$|\1|p" | $stat)
            line="$line $key=$v"
        done
        echo "$line"
    done
done
