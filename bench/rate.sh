#!/usr/bin/env bash
# 8-byte message rate with one post per message: two softrdma builds (or
# command lines) against plain TCP and UCX, alternated in ONE run.
#
#   bench/rate.sh A B [ROUNDS] [--iters N] [--no-ucx] [--no-iperf]
#
# Per round, in alternating order (A first in odd rounds, B first in even):
#   A, B    softrdma perf send -s 8 -n N --baseline tcp --json
#           Mmsg/s, and the TCP baseline of the same invocation (a blocking
#           byte stream, one send(2) per 8-byte message) in Mmsg/s
#   A, B    softrdma perf write -s 8 -n N --json     Mmsg/s
#   ucx     UCX_TLS=tcp,self UCX_NET_DEVICES=lo ucx_perftest -t ucp_am_bw
#           -s 8 -n N (server and client processes), "overall" Mmsg/s
#   iperf3  iperf3 -c 127.0.0.1 -t 2 -l 8 -J (one write(2) per 8 bytes),
#           Mmsg/s = received bytes / 8
# Then per column the median and the mean over the rounds, and the ratios
# the goal is stated in: softrdma send rate / TCP (same invocation),
# / iperf3, / UCX ucp_am_bw (medians of the rounds; means beside them).
# A side may be a command line ending in a binary, e.g. "env X=1 /tmp/sr".
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
rounds=5
iters=200000
ucx=1
iperf=1
pos=0
cmd_a=
cmd_b=
while [ $# -gt 0 ]; do
    case $1 in
    --iters) iters=$2; shift 2 ;;
    --no-ucx) ucx=0; shift ;;
    --no-iperf) iperf=0; shift ;;
    *)
        if [ $pos -eq 0 ]; then cmd_a=$1
        elif [ $pos -eq 1 ]; then cmd_b=$1
        else rounds=$1; fi
        pos=$((pos + 1)); shift ;;
    esac
done
if [ -z "$cmd_a" ] || [ -z "$cmd_b" ]; then
    echo "usage: bench/rate.sh A B [ROUNDS] [--iters N] [--no-ucx] [--no-iperf]" >&2
    exit 2
fi
read -ra run_a <<<"$cmd_a"
read -ra run_b <<<"$cmd_b"
command -v ucx_perftest >/dev/null || ucx=0
command -v iperf3 >/dev/null || iperf=0

# shellcheck source=bench/ab-common.sh
. bench/ab-common.sh  # (the working directory is the repository)
srv=
stop_srv() {
    if [ -n "$srv" ]; then kill "$srv" 2>/dev/null || true; wait "$srv" 2>/dev/null || true; srv=; fi
}
trap 'stop_srv; cleanup' EXIT

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'
}
wait_listen() {
    local i
    for i in $(seq 1 50); do
        [ -n "$(ss -ltnH "sport = :$1" 2>/dev/null)" ] && return 0
        sleep 0.1
    done
    return 1
}

side() { # A|B
    local cmd out la
    if [ "$1" = B ]; then cmd=("${run_b[@]}"); else cmd=("${run_a[@]}"); fi
    la=$(cut -d' ' -f1 /proc/loadavg)
    out=$(timeout 120 "${cmd[@]}" perf send -s 8 -n "$iters" --baseline tcp --json 2>/dev/null | tail -1) || out=
    local send tcp write
    send=$(field "$out" mmsg_s)
    tcp=$(field "$out" tcp_mb_s)
    tcp=$(awk -v t="$tcp" 'BEGIN { if (t == "") print ""; else printf "%.4f", t / 8 }')
    out=$(timeout 120 "${cmd[@]}" perf write -s 8 -n "$iters" --json 2>/dev/null | tail -1) || out=
    write=$(field "$out" mmsg_s)
    echo "$1 load=$la send=$send write=$write tcp=$tcp" | tee -a "$results"
}

ucx_run() {
    [ "$ucx" = 1 ] || return 0
    local port out la
    la=$(cut -d' ' -f1 /proc/loadavg)
    port=$(free_port)
    UCX_TLS=tcp,self UCX_NET_DEVICES=lo timeout 120 ucx_perftest -p "$port" >/dev/null 2>&1 &
    srv=$!
    wait_listen "$port" || true
    out=$(UCX_TLS=tcp,self UCX_NET_DEVICES=lo timeout 120 ucx_perftest 127.0.0.1 -p "$port" \
        -t ucp_am_bw -s 8 -n "$iters" 2>/dev/null) || out=
    stop_srv
    # Final: iters typical lat_avg lat_overall bw_avg bw_overall rate_avg rate_overall
    echo "U load=$la am_bw=$(awk '/^Final:/ { printf "%.4f", $9 / 1e6 }' <<<"$out")" | tee -a "$results"
}

iperf_run() {
    [ "$iperf" = 1 ] || return 0
    local port out la
    la=$(cut -d' ' -f1 /proc/loadavg)
    port=$(free_port)
    timeout 60 iperf3 -s -1 -p "$port" >/dev/null 2>&1 &
    srv=$!
    wait_listen "$port" || true
    out=$(timeout 60 iperf3 -c 127.0.0.1 -p "$port" -t 2 -l 8 -J 2>/dev/null) || out=
    stop_srv
    echo "I load=$la iperf3=$(python3 -c '
import json, sys
try:
    d = json.loads(sys.stdin.read())
    print("%.4f" % (d["end"]["sum_received"]["bytes"] / 8 / d["end"]["sum_received"]["seconds"] / 1e6))
except Exception:
    print("")' <<<"$out")" | tee -a "$results"
}

echo "# $(date -u +%FT%TZ) rate (Mmsg/s, 8 B, one post per message), $rounds rounds, -n $iters, nproc=$(nproc), loadavg: $(cat /proc/loadavg)"
echo "# A: ${run_a[*]}"
echo "# B: ${run_b[*]}"
for r in $(seq 1 "$rounds"); do
    if [ $((r % 2)) -eq 1 ]; then side A; side B; ucx_run; iperf_run
    else iperf_run; ucx_run; side B; side A; fi
done

median() {
    sort -g | awk '{v[NR]=$1} END {if (NR==0) print ""; else if (NR%2) print v[(NR+1)/2]; else print (v[NR/2]+v[NR/2+1])/2}'
}
mean() {
    awk '{s+=$1; n++} END {if (n==0) print ""; else printf "%.4g\n", s/n}'
}
col() { # tag key stat
    { grep "^$1 " "$results" || true; } | tr ' ' '\n' | sed -n "s|^$2=\(.\+\)$|\1|p" | $3
}
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a == "" || b == "" || b + 0 == 0) print "n/a"; else printf "%.2f", a / b }'; }
echo "# loadavg at the end: $(cat /proc/loadavg)"
for stat in median mean; do
    u=$(col U am_bw $stat); i=$(col I iperf3 $stat)
    for s in A B; do
        send=$(col $s send $stat); write=$(col $s write $stat); tcp=$(col $s tcp $stat)
        echo "$stat $s send=$send write=$write tcp=$tcp ucx_am_bw=$u iperf3=$i" \
            "send/tcp=$(ratio "$send" "$tcp") send/iperf3=$(ratio "$send" "$i") send/ucx=$(ratio "$send" "$u")" \
            "write/tcp=$(ratio "$write" "$tcp") write/ucx=$(ratio "$write" "$u")"
    done
done
