#!/usr/bin/env bash
# CPU per MiB of two `softrdma` binaries (or command lines ending in one),
# alternated in ONE run (A B, then B A, ...): `perf stat -e
# task-clock,context-switches` and the receive system calls around
# `softrdma perf write -s 1M -n MIB` (both ends in the one process, no TCP
# baseline), optionally with CPU hogs as in `bench/ab-bins.sh`.
#
#   bench/cpu-ab.sh A B [ROUNDS] [--load N] [--mib MIB] [--args "perf write -s 1M"]
#
# Prints every run (task-clock µs per MiB, context switches, `recvfrom`
# calls and reads into place (`readv` + `recvmsg`: the engine reads into
# place with `recvmsg`) per MiB, MB/s) and per side the medians and means.
# Needs `perf` with the syscalls tracepoints (run as root).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
rounds=5
load=0
mib=1000
args="perf write -s 1M"
pos=0
cmd_a=
cmd_b=
while [ $# -gt 0 ]; do
    case $1 in
    --load) load=$2; shift 2 ;;
    --mib) mib=$2; shift 2 ;;
    --args) args=$2; shift 2 ;;
    *)
        if [ $pos -eq 0 ]; then cmd_a=$1
        elif [ $pos -eq 1 ]; then cmd_b=$1
        else rounds=$1; fi
        pos=$((pos + 1)); shift ;;
    esac
done
if [ -z "$cmd_a" ] || [ -z "$cmd_b" ]; then
    echo "usage: bench/cpu-ab.sh A B [ROUNDS] [--load N] [--mib MIB] [--args \"perf write -s 1M\"]" >&2
    exit 2
fi
read -ra run_a <<<"$cmd_a"
read -ra run_b <<<"$cmd_b"
read -ra extra <<<"$args"

# shellcheck source=bench/ab-common.sh
. bench/ab-common.sh
start_hogs "$load"
stat_out=$(mktemp)
trap 'cleanup; rm -f "$stat_out"' EXIT

run() { # side
    local side=$1 cmd la out
    if [ "$side" = B ]; then cmd=("${run_b[@]}"); else cmd=("${run_a[@]}"); fi
    la=$(cut -d' ' -f1 /proc/loadavg)
    out=$(timeout 120 perf stat -x, -o "$stat_out" \
        -e task-clock,context-switches,syscalls:sys_enter_recvfrom,syscalls:sys_enter_readv,syscalls:sys_enter_recvmsg \
        "${cmd[@]}" "${extra[@]}" -n "$mib" --json 2>/dev/null | tail -1) || out=
    awk -F, -v side="$side" -v la="$la" -v mib="$mib" -v mbs="$(field "$out" mb_s)" '
        $3 == "task-clock" { cpu = $1 }
        $3 == "context-switches" { cs = $1 }
        $3 ~ /recvfrom/ { rf = $1 }
        $3 ~ /readv|recvmsg/ { rv += $1 }
        END { printf "%s load=%s cpu_us_per_mib=%.1f cs_per_mib=%.2f recv_per_mib=%.2f readv_per_mib=%.2f mb_s=%s\n",
              side, la, cpu * 1000 / mib, cs / mib, rf / mib, rv / mib, mbs }' "$stat_out" | tee -a "$results"
}

echo "# $(date -u +%FT%TZ) A=$cmd_a B=$cmd_b args=$args -n $mib hogs=$load loadavg: $(cat /proc/loadavg)"
for r in $(seq 1 "$rounds"); do
    if [ $((r % 2)) -eq 1 ]; then run A; run B; else run B; run A; fi
done

median() {
    sort -g | awk '{v[NR]=$1} END {if (NR==0) print ""; else if (NR%2) print v[(NR+1)/2]; else print (v[NR/2]+v[NR/2+1])/2}'
}
mean() {
    awk '{s+=$1; n++} END {if (n==0) print ""; else printf "%.4g\n", s/n}'
}
col() { # side key stat
    grep "^$1 " "$results" | tr ' ' '\n' | sed -n "s|^$2=\(.\+\)$|\1|p" | $3
}
keys="cpu_us_per_mib cs_per_mib recv_per_mib readv_per_mib mb_s"
echo "# $rounds rounds, loadavg at the end: $(cat /proc/loadavg)"
for stat in median mean; do
    for side in A B; do
        line="$stat $side"
        for k in $keys; do line="$line $k=$(col $side "$k" $stat)"; done
        echo "$line"
    done
done
line="B/A(median)"
for k in $keys; do
    a=$(col A "$k" median)
    b=$(col B "$k" median)
    line="$line $k=$(awk -v a="$a" -v b="$b" 'BEGIN { if (a == "" || b == "" || a + 0 == 0) print ""; else printf "%.3f", b / a }')"
done
echo "$line"
