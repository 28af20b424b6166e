#!/usr/bin/env bash
# A/B comparison of two `softrdma` binaries (or command lines) in ONE run:
# the two are alternated (A B, then B A, ...), so that both see the same
# machine; every run prints the 1-minute load average at its start.
# (`bench/ab.sh` builds two commits and compares them with fewer tests.)
#
#   bench/ab-bins.sh A B [ROUNDS] [--load N] [--ucx] [--tests "write slat wlat wlat1m rate"]
#
# A, B: a `softrdma` binary each, or a command line ending in one (word
# split), e.g. "env SOFTRDMA_WAIT_SET=epoll /tmp/new/softrdma"; ROUNDS [5].
# Tests (each one `softrdma perf` call per side and round, `--json`):
#   write   perf write -s 1M -n 500 --baseline tcp   MB/s, TCP MB/s, ratio, CPU µs/msg
#   write64k perf write -s 64K -n 8000 --baseline tcp MB/s, TCP MB/s, ratio, CPU µs/msg
#   write8m perf write -s 8M -n 100                  MB/s, CPU µs/msg (no TCP
#           baseline: with --ucx, UCX's ucp_am_bw of 8 MiB is the reference)
#   slat    perf send --lat -s 8 -n 5000             one-way µs: mean, p50, p99
#   wlat    perf write --lat -s 8 -n 5000            one-way µs: mean, p50, p99
#   wlat1m  perf write --lat -s 1M -n 200            one-way µs: mean, p50, p99
#   slat64k perf send --lat -s 64K -n 2000           one-way µs: mean, p50, p99
#   wlat64k perf write --lat -s 64K -n 2000          one-way µs: mean, p50, p99
#   rate    perf send -s 8 -n 200000                 Mmsg/s, CPU µs/msg
# --ucx runs UCX over TCP once per round and test beside A and B (side U,
# between them) for the bandwidth tests: `UCX_TLS=tcp,self
# UCX_NET_DEVICES=lo ucx_perftest 127.0.0.1 -t ucp_am_bw -s SIZE -n N`
# (8 MiB: -n 200, 1 MiB: -n 1000, 64 KiB: -n 10000, as bench/compare.sh;
# MB/s = its overall message rate × SIZE), and prints A/U and B/U of the
# medians and means.
# --load N keeps N CPUs busy with a CPU hog (`bash -c 'while :; do :; done'`,
# hog i pinned to CPU i mod nproc) for the whole comparison, both sides and
# the TCP baseline alike; the hogs are ended by PID afterwards.
# Prints every run, then per side the median and the mean of each column,
# and B/A of the medians.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
rounds=5
load=0
tests="write slat wlat rate"
ucx=0
pos=0
cmd_a=
cmd_b=
while [ $# -gt 0 ]; do
    case $1 in
    --load) load=$2; shift 2 ;;
    --tests) tests=$2; shift 2 ;;
    --ucx) ucx=1; shift ;;
    *)
        if [ $pos -eq 0 ]; then cmd_a=$1
        elif [ $pos -eq 1 ]; then cmd_b=$1
        else rounds=$1; fi
        pos=$((pos + 1)); shift ;;
    esac
done
if [ -z "$cmd_a" ] || [ -z "$cmd_b" ]; then
    echo "usage: bench/ab-bins.sh A B [ROUNDS] [--load N] [--ucx] [--tests \"...\"]" >&2
    exit 2
fi
read -ra run_a <<<"$cmd_a"
read -ra run_b <<<"$cmd_b"
for c in "${run_a[-1]}" "${run_b[-1]}"; do
    [ -x "$c" ] || { echo "no binary $c (cargo build --release -p softrdma-cli)" >&2; exit 2; }
done

# shellcheck source=bench/ab-common.sh
. bench/ab-common.sh  # (the working directory is the repository)
start_hogs "$load"
ncpu=$(nproc)

run() { # side test
    local side=$1 t=$2 la out cmd
    if [ "$side" = B ]; then cmd=("${run_b[@]}"); else cmd=("${run_a[@]}"); fi
    la=$(cut -d' ' -f1 /proc/loadavg)
    case $t in
    write)
        out=$(timeout 120 "${cmd[@]}" perf write -s 1M -n 500 --baseline tcp --json 2>/dev/null | tail -1) || out=
        echo "$side $t load=$la mb_s=$(field "$out" mb_s) tcp_mb_s=$(field "$out" tcp_mb_s) ratio=$(field "$out" ratio) cpu_us=$(field "$out" cpu_us_per_msg)" ;;
    write64k)
        out=$(timeout 120 "${cmd[@]}" perf write -s 64K -n 8000 --baseline tcp --json 2>/dev/null | tail -1) || out=
        echo "$side $t load=$la mb_s=$(field "$out" mb_s) tcp_mb_s=$(field "$out" tcp_mb_s) ratio=$(field "$out" ratio) cpu_us=$(field "$out" cpu_us_per_msg)" ;;
    write8m)
        out=$(timeout 120 "${cmd[@]}" perf write -s 8M -n 100 --json 2>/dev/null | tail -1) || out=
        echo "$side $t load=$la mb_s=$(field "$out" mb_s) cpu_us=$(field "$out" cpu_us_per_msg)" ;;
    slat | wlat | wlat1m | slat64k | wlat64k)
        local op=send size=8 n=5000
        case $t in wlat*) op=write ;; esac
        [ "$t" = wlat1m ] && { size=1M; n=200; }
        case $t in *64k) size=64K; n=2000 ;; esac
        out=$(timeout 120 "${cmd[@]}" perf $op --lat -s $size -n $n --json 2>/dev/null | tail -1) || out=
        echo "$side $t load=$la mean=$(field "$out" lat_mean_us) p50=$(field "$out" lat_p50_us) p99=$(field "$out" lat_p99_us) cpu_us=$(field "$out" cpu_us_per_msg)" ;;
    rate)
        out=$(timeout 120 "${cmd[@]}" perf send -s 8 -n 200000 --json 2>/dev/null | tail -1) || out=
        echo "$side $t load=$la mmsg_s=$(field "$out" mmsg_s) cpu_us=$(field "$out" cpu_us_per_msg)" ;;
    *) echo "unknown test $t" >&2; exit 2 ;;
    esac | tee -a "$results"
}

# UCX's ucp_am_bw over TCP on loopback for a bandwidth test (side U).
ucx_size() { # test -> "bytes iters", or nothing
    case $1 in
    write) echo "1048576 1000" ;;
    write64k) echo "65536 10000" ;;
    write8m) echo "8388608 200" ;;
    esac
}
run_ucx() { # test
    local t=$1 la port srv out sz
    sz=$(ucx_size "$t")
    [ -n "$sz" ] || return 0
    read -r size n <<<"$sz"
    la=$(cut -d' ' -f1 /proc/loadavg)
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()')
    UCX_TLS=tcp,self UCX_NET_DEVICES=lo timeout 60 ucx_perftest -p "$port" >/dev/null 2>&1 &
    srv=$!
    for _ in $(seq 50); do
        [ -n "$(ss -ltnH "sport = :$port" 2>/dev/null)" ] && break
        sleep 0.1
    done
    out=$(UCX_TLS=tcp,self UCX_NET_DEVICES=lo timeout 60 ucx_perftest 127.0.0.1 -p "$port" \
        -t ucp_am_bw -s "$size" -n "$n" 2>/dev/null | awk -v s="$size" '/^Final:/ { printf "%.1f\n", $9 * s / 1e6 }') || out=
    for _ in $(seq 30); do kill -0 "$srv" 2>/dev/null || break; sleep 0.1; done
    kill "$srv" 2>/dev/null || true
    wait "$srv" 2>/dev/null || true
    echo "U $t load=$la mb_s=$out" | tee -a "$results"
}
if [ "$ucx" = 1 ] && ! command -v ucx_perftest >/dev/null; then
    echo "--ucx: no ucx_perftest (apt-get install ucx-utils)" >&2
    exit 2
fi

echo "# $(date -u +%FT%TZ) A=$cmd_a B=$cmd_b nproc=$ncpu hogs=$load loadavg: $(cat /proc/loadavg)"
echo "# A: ${run_a[*]}"
echo "# B: ${run_b[*]}"
for r in $(seq 1 "$rounds"); do
    for t in $tests; do
        if [ $(((r + ${#t}) % 2)) -eq 1 ]; then first=A; second=B; else first=B; second=A; fi
        run $first "$t"
        [ "$ucx" = 1 ] && run_ucx "$t"
        run $second "$t"
    done
done

median() {
    sort -g | awk '{v[NR]=$1} END {if (NR==0) print ""; else if (NR%2) print v[(NR+1)/2]; else print (v[NR/2]+v[NR/2+1])/2}'
}
mean() {
    awk '{s+=$1; n++} END {if (n==0) print ""; else printf "%.4g\n", s/n}'
}
col() { # side test key stat
    grep "^$1 $2 " "$results" | tr ' ' '\n' | sed -n "s|^$3=\(.\+\)$|\1|p" | $4
}
echo "# $rounds rounds, loadavg at the end: $(cat /proc/loadavg)"
for t in $tests; do
    keys=$(grep -m1 "^A $t " "$results" | tr ' ' '\n' | sed -n 's/=.*//p' | tr '\n' ' ')
    for stat in median mean; do
        for side in A B; do
            line="$stat $side $t"
            for k in $keys; do line="$line $k=$(col $side "$t" "$k" $stat)"; done
            echo "$line"
        done
    done
    line="B/A(median) $t"
    for k in $keys; do
        a=$(col A "$t" "$k" median)
        b=$(col B "$t" "$k" median)
        line="$line $k=$(awk -v a="$a" -v b="$b" 'BEGIN { if (a == "" || b == "" || a + 0 == 0) print ""; else printf "%.3f", b / a }')"
    done
    echo "$line"
    if grep -q "^U $t " "$results"; then
        for stat in median mean; do
            u=$(col U "$t" mb_s $stat)
            a=$(col A "$t" mb_s $stat)
            b=$(col B "$t" mb_s $stat)
            echo "$stat U $t mb_s=$u A/U=$(awk -v a="$a" -v u="$u" 'BEGIN { if (u + 0 == 0) print ""; else printf "%.3f", a / u }') B/U=$(awk -v b="$b" -v u="$u" 'BEGIN { if (u + 0 == 0) print ""; else printf "%.3f", b / u }')"
        done
    fi
done
