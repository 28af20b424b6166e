#!/usr/bin/env bash
# Loopback comparison of softrdma with raw TCP, UCX over TCP and libfabric's
# tcp provider. See bench/README.md for what each cell means.
#
# Usage: bench/compare.sh [--runs N] [--out FILE] [--no-install] [--no-build]
#                         [--duration SECS] [--load N]
#   --load N: keep N cores busy with CPU hogs (pinned with taskset) while
#             every stack runs, to see how each behaves on a loaded machine
set -u -o pipefail

RUNS=3
OUT=""
INSTALL=1
BUILD=1
DUR=2            # seconds per time-based test (iperf3, qperf)
TMO=40           # hard limit in seconds for any single tool invocation
LOAD=0           # CPU hogs kept running during the measurements

usage() {
    sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
}

while [ $# -gt 0 ]; do
    case "$1" in
        --runs) RUNS="$2"; shift 2 ;;
        --runs=*) RUNS="${1#*=}"; shift ;;
        --out) OUT="$2"; shift 2 ;;
        --out=*) OUT="${1#*=}"; shift ;;
        --duration) DUR="$2"; shift 2 ;;
        --duration=*) DUR="${1#*=}"; shift ;;
        --load) LOAD="$2"; shift 2 ;;
        --load=*) LOAD="${1#*=}"; shift ;;
        --no-install) INSTALL=0; shift ;;
        --no-build) BUILD=0; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "unknown argument: $1" >&2; usage >&2; exit 2 ;;
    esac
done
case "$RUNS" in ''|*[!0-9]*|0) echo "--runs needs a positive integer" >&2; exit 2 ;; esac
case "$LOAD" in ''|*[!0-9]*) echo "--load needs a number of cores (0 or more)" >&2; exit 2 ;; esac

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
[ -n "$OUT" ] || OUT="$HERE/last-compare.md"
SOFTRDMA="$ROOT/target/release/softrdma"
SIZES="8 65536 1048576"

WORK="$(mktemp -d /tmp/softrdma-compare.XXXXXX)"
RESULTS="$WORK/results.tsv"     # tool <TAB> test <TAB> metric <TAB> size <TAB> run <TAB> value
: >"$RESULTS"

# ---------------------------------------------------------------- processes
# Every background process this script starts is recorded here; only these
# are ever signalled.
PIDS=()

stop_pid() {
    local pid="$1"
    kill -0 "$pid" 2>/dev/null || return 0
    kill -TERM "$pid" 2>/dev/null
    for _ in 1 2 3 4 5 6 7 8 9 10; do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
    return 0
}

cleanup() {
    local pid
    for pid in "${PIDS[@]:-}"; do
        [ -n "$pid" ] && stop_pid "$pid"
    done
    PIDS=()
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Start a server in the background under `timeout`, remember its PID.
# Usage: start_bg LOGFILE cmd args...   (PID in $BG_PID)
start_bg() {
    local log="$1"; shift
    timeout -k 2 "$TMO" "$@" >"$log" 2>&1 &
    BG_PID=$!
    PIDS+=("$BG_PID")
}

# Wait for a server started with start_bg to finish (it normally exits after
# serving one client) and forget it.
finish_bg() {
    local pid="$1" i
    for i in $(seq 1 30); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    stop_pid "$pid"
    local keep=() p
    for p in "${PIDS[@]:-}"; do [ "$p" != "$pid" ] && [ -n "$p" ] && keep+=("$p"); done
    PIDS=("${keep[@]:-}")
}

# Wait until something listens on TCP port $1 (without connecting to it, so
# one-shot servers are not consumed). Gives up after ~5 s.
wait_listen() {
    local port="$1" i
    for i in $(seq 1 50); do
        if command -v ss >/dev/null 2>&1; then
            [ -n "$(ss -ltnH "sport = :$port" 2>/dev/null)" ] && return 0
        fi
        sleep 0.1
    done
    command -v ss >/dev/null 2>&1 || return 0
    return 1
}

# Run a client in the background and wait for it, so that a signal to this
# script is handled at once (bash defers traps while a foreground child
# runs). Output goes to stdout of this function.
client() {
    local out="$WORK/client.out"
    timeout -k 2 "$TMO" "$@" >"$out" 2>&1 &
    local pid=$!
    PIDS+=("$pid")
    wait "$pid"
    local keep=() p
    for p in "${PIDS[@]:-}"; do [ "$p" != "$pid" ] && [ -n "$p" ] && keep+=("$p"); done
    PIDS=("${keep[@]:-}")
    cat "$out"
}

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'
}

record() { # tool test metric size run value
    [ -n "${6:-}" ] || return 0
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" "$6" >>"$RESULTS"
}

log() { printf '%s\n' "$*" >&2; }

# ---------------------------------------------------------------- load
# N CPU hogs, hog i pinned to CPU i mod nproc, started here and ended by
# PID (they are in PIDS, so cleanup ends them too).
HOG_PIDS=()
start_load() {
    local n="$1" i cpu ncpu
    [ "$n" -gt 0 ] || return 0
    if ! have taskset; then
        log "--load needs taskset (util-linux); running without load"
        LOAD=0
        return 0
    fi
    ncpu="$(nproc)"
    for i in $(seq 0 $((n - 1))); do
        cpu=$((i % ncpu))
        taskset -c "$cpu" bash -c 'while :; do :; done' &
        HOG_PIDS+=("$!")
        PIDS+=("$!")
    done
    log "load: $n CPU hog(s) on CPU(s) $(seq -s, 0 $(( (n < ncpu ? n : ncpu) - 1 )))"
}

stop_load() {
    local pid keep=() p
    for pid in "${HOG_PIDS[@]:-}"; do
        [ -n "$pid" ] && stop_pid "$pid"
    done
    for p in "${PIDS[@]:-}"; do
        local hog=0 h
        for h in "${HOG_PIDS[@]:-}"; do [ "$p" = "$h" ] && hog=1; done
        [ "$hog" -eq 0 ] && [ -n "$p" ] && keep+=("$p")
    done
    PIDS=("${keep[@]:-}")
    HOG_PIDS=()
}

# ---------------------------------------------------------------- install
have() { command -v "$1" >/dev/null 2>&1; }

install_tools() {
    local pkgs=()
    have iperf3 || pkgs+=(iperf3)
    have qperf || have sockperf || pkgs+=(qperf)
    have ucx_perftest || pkgs+=(ucx-utils)
    have fi_pingpong || pkgs+=(libfabric-bin)
    [ ${#pkgs[@]} -eq 0 ] && return 0
    if [ "$INSTALL" -eq 0 ]; then
        log "missing tools (not installing, --no-install): ${pkgs[*]}"
        return 0
    fi
    if ! have apt-get; then
        log "apt-get not found; missing: ${pkgs[*]}"
        return 0
    fi
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    log "installing: ${pkgs[*]}"
    # Install one at a time so a package missing from the release only
    # loses its own column.
    local p
    for p in "${pkgs[@]}"; do
        if ! DEBIAN_FRONTEND=noninteractive timeout 300 $sudo apt-get install -y -q "$p" >"$WORK/apt-$p.log" 2>&1; then
            DEBIAN_FRONTEND=noninteractive timeout 300 $sudo apt-get update -q >/dev/null 2>&1
            DEBIAN_FRONTEND=noninteractive timeout 300 $sudo apt-get install -y -q "$p" >"$WORK/apt-$p.log" 2>&1 \
                || log "could not install $p (see apt-get output)"
        fi
    done
    if ! have qperf && ! have sockperf; then
        DEBIAN_FRONTEND=noninteractive timeout 300 $sudo apt-get install -y -q sockperf >/dev/null 2>&1 || true
    fi
}

# ---------------------------------------------------------------- softrdma
SOFTRDMA_OK=0
prepare_softrdma() {
    if [ "$BUILD" -eq 1 ] && have cargo; then
        log "building softrdma (cargo build --release -p softrdma-cli)"
        (cd "$ROOT" && timeout 600 cargo build --release -q -p softrdma-cli) >"$WORK/build.log" 2>&1 \
            || log "softrdma build failed; softrdma cells will be n/a (see cargo output)"
    fi
    if [ -x "$SOFTRDMA" ] && timeout 10 "$SOFTRDMA" perf --help >/dev/null 2>&1; then
        SOFTRDMA_OK=1
    else
        log "softrdma perf is not available; softrdma cells will be n/a"
    fi
}

# ---------------------------------------------------------------- tools
# iperf3 streaming bandwidth, write size = message size.
run_iperf3() {
    local run="$1" size port srv out
    have iperf3 || return 0
    for size in $SIZES; do
        port="$(free_port)"
        start_bg "$WORK/iperf3-srv.log" iperf3 -s -1 -p "$port"
        srv=$BG_PID
        wait_listen "$port"
        client iperf3 -c 127.0.0.1 -p "$port" -t "$DUR" -l "$size" -J >"$WORK/out"; out="$(cat "$WORK/out")"
        finish_bg "$srv"
        record tcp iperf3 bw "$size" "$run" "$(printf '%s' "$out" | python3 -c '
import json, sys
try:
    d = json.load(sys.stdin)
    print("%.3f" % (d["end"]["sum_received"]["bits_per_second"] / 8e6))
except Exception:
    pass')"
    done
}

# TCP ping-pong latency (one way, i.e. half the round trip).
QPERF_PID=""
QPERF_PORT=""
run_tcp_lat() {
    local run="$1" size out
    if have qperf; then
        if [ -z "$QPERF_PID" ] || ! kill -0 "$QPERF_PID" 2>/dev/null; then
            QPERF_PORT="$(free_port)"
            # the qperf server runs for the whole script; give it a long limit
            local tmo_save="$TMO"; TMO=$((RUNS * 120 + 60))
            start_bg "$WORK/qperf-srv.log" qperf --listen_port "$QPERF_PORT"
            TMO="$tmo_save"
            QPERF_PID=$BG_PID
            wait_listen "$QPERF_PORT"
        fi
        for size in $SIZES; do
            client qperf 127.0.0.1 --listen_port "$QPERF_PORT" -t "$DUR" -m "$size" tcp_lat >"$WORK/out"; out="$(cat "$WORK/out")"
            record tcp tcp_lat latmean "$size" "$run" "$(printf '%s' "$out" | awk '
                /latency *=/ { v=$3; u=$4;
                    if (u=="ns") v=v/1000; else if (u=="ms") v=v*1000; else if (u=="sec"||u=="s") v=v*1e6;
                    printf "%.3f\n", v }')"
        done
    elif have sockperf; then
        # sockperf messages are 14..65506 bytes; other sizes stay n/a
        local port srv
        port="$(free_port)"
        start_bg "$WORK/sockperf-srv.log" sockperf sr --tcp -i 127.0.0.1 -p "$port"
        srv=$BG_PID
        wait_listen "$port"
        for size in 14 65536; do
            [ "$size" -gt 65506 ] && continue
            local m="$size"; [ "$m" -gt 65506 ] && m=65506
            client sockperf pp --tcp -i 127.0.0.1 -p "$port" -m "$m" -t "$DUR" >"$WORK/out"; out="$(cat "$WORK/out")"
            local key="$size"; [ "$size" -eq 14 ] && key=8
            record tcp tcp_lat latmean "$key" "$run" "$(printf '%s' "$out" | sed -n 's/.*Summary: Latency is \([0-9.]*\) usec.*/\1/p' | tail -1)"
        done
        finish_bg "$srv"
    fi
}

ucx_iters() { # test size
    case "$1:$2" in
        *_lat:8) echo 20000 ;;
        *_lat:65536) echo 5000 ;;
        *_lat:*) echo 1000 ;;
        *:8) echo 100000 ;;
        *:65536) echo 10000 ;;
        *) echo 1000 ;;
    esac
}

# UCX over TCP only (UCX_TLS=tcp,self, UCX_NET_DEVICES=lo).
run_ucx() {
    local run="$1" test size port srv out n
    have ucx_perftest || return 0
    for test in ucp_put_bw ucp_am_bw tag_bw tag_lat; do
        for size in $SIZES; do
            n="$(ucx_iters "$test" "$size")"
            port="$(free_port)"
            UCX_TLS=tcp,self UCX_NET_DEVICES=lo start_bg "$WORK/ucx-srv.log" ucx_perftest -p "$port"
            srv=$BG_PID
            wait_listen "$port"
            UCX_TLS=tcp,self UCX_NET_DEVICES=lo client \
                ucx_perftest 127.0.0.1 -p "$port" -t "$test" -s "$size" -n "$n" >"$WORK/out"; out="$(cat "$WORK/out")"
            finish_bg "$srv"
            # Final: iters typical(median) lat_avg lat_overall bw_avg bw_overall rate_avg rate_overall
            case "$test" in
                *_lat)
                    record ucx "$test" lat "$size" "$run" "$(printf '%s' "$out" | awk '/^Final:/ { print $3 }')"
                    record ucx "$test" latmean "$size" "$run" "$(printf '%s' "$out" | awk '/^Final:/ { print $5 }')" ;;
                *)
                    record ucx "$test" bw "$size" "$run" "$(printf '%s' "$out" | awk -v s="$size" '/^Final:/ { printf "%.3f\n", $9 * s / 1e6 }')" ;;
            esac
        done
    done
}

fi_iters() {
    case "$1" in 8) echo 20000 ;; 65536) echo 5000 ;; *) echo 1000 ;; esac
}

# libfabric tcp provider, msg endpoint ping-pong.
run_fabric() {
    local run="$1" size port srv out n
    have fi_pingpong || return 0
    for size in $SIZES; do
        n="$(fi_iters "$size")"
        port="$(free_port)"
        start_bg "$WORK/fi-srv.log" fi_pingpong -p tcp -e msg -B "$port" -I "$n" -S "$size"
        srv=$BG_PID
        wait_listen "$port"
        client fi_pingpong -p tcp -e msg -P "$port" -I "$n" -S "$size" 127.0.0.1 >"$WORK/out"; out="$(cat "$WORK/out")"
        finish_bg "$srv"
        # bytes #sent #ack total time MB/sec usec/xfer Mxfers/sec
        local line
        line="$(printf '%s' "$out" | awk 'f { print; exit } /usec\/xfer/ { f=1 }')"
        record fabric pingpong latmean "$size" "$run" "$(printf '%s' "$line" | awk 'NF>=8 { print $7 }')"
        record fabric pingpong bw "$size" "$run" "$(printf '%s' "$line" | awk 'NF>=8 { print $6 }')"
    done
}

sr_iters() { # mode size
    case "$1:$2" in
        lat:8) echo 20000 ;;
        lat:65536) echo 5000 ;;
        lat:*) echo 1000 ;;
        bw:8) echo 100000 ;;
        bw:65536) echo 20000 ;;
        *) echo 2000 ;;
    esac
}

run_softrdma() {
    local run="$1" test mode size out n latflag
    [ "$SOFTRDMA_OK" -eq 1 ] || return 0
    for test in write send; do
        for mode in bw lat; do
            for size in $SIZES; do
                n="$(sr_iters "$mode" "$size")"
                latflag=""; [ "$mode" = lat ] && latflag="--lat"
                # shellcheck disable=SC2086
                # The latency runs carry a busy-polled TCP ping-pong of the
                # same size (a spinning TCP beside the spinning softrdma).
                local base=""; [ "$mode" = lat ] && [ "$test" = send ] && base="--baseline tcp-spin"
                # Two measurements in one invocation (softrdma and TCP): a
                # longer limit, which a loaded machine (--load) needs.
                local tmo_save="$TMO"; [ -n "$base" ] && TMO=$((TMO * 3))
                # shellcheck disable=SC2086
                client "$SOFTRDMA" perf "$test" --size "$size" $latflag $base -n "$n" --json >"$WORK/out"; out="$(grep "^{" "$WORK/out")"
                TMO="$tmo_save"
                printf '%s\n' "$out" | python3 -c '
import json, sys
test, mode, size, run = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
last = None
for line in sys.stdin:
    line = line.strip()
    if not line.startswith("{"):
        continue
    try:
        d = json.loads(line)
    except ValueError:
        continue
    if d.get("mode", mode) == mode and int(d.get("size", size)) == size:
        last = d
if last is None:
    sys.exit(0)
if mode == "bw":
    v = last.get("gbit_s")
    v = v * 125.0 if v is not None else last.get("mb_s")
    if v is not None:
        print("softrdma\t%s\tbw\t%d\t%s\t%.3f" % (test, size, run, v))
else:
    v = last.get("lat_p50_us")
    if v is not None:
        print("softrdma\t%s\tlat\t%d\t%s\t%.3f" % (test, size, run, v))
    v = last.get("lat_mean_us")
    if v is not None:
        print("softrdma\t%s\tlatmean\t%d\t%s\t%.3f" % (test, size, run, v))
    for k, metric in (("tcp_lat_p50_us", "lat"), ("tcp_lat_mean_us", "latmean")):
        v = last.get(k)
        if v is not None:
            print("tcpspin\tpingpong\t%s\t%d\t%s\t%.3f" % (metric, size, run, v))
' "$test" "$mode" "$size" "$run" >>"$RESULTS"
            done
        done
    done
}

# ---------------------------------------------------------------- header
tool_version() {
    case "$1" in
        iperf3) have iperf3 && iperf3 -v 2>/dev/null | head -1 | awk '{print $1" "$2}' ;;
        qperf) have qperf && qperf --version 2>&1 | head -1 ;;
        sockperf) have sockperf && sockperf --version 2>&1 | head -1 | sed 's/^sockperf, //' ;;
        ucx) have ucx_info && ucx_info -v 2>/dev/null | sed -n 's/^# Version /UCX /p' | head -1 ;;
        fabric) have fi_info && fi_info --version 2>/dev/null | sed -n 's/^libfabric: /libfabric /p' | head -1 ;;
        softrdma)
            if [ -x "$SOFTRDMA" ]; then
                local v; v="$(timeout 5 "$SOFTRDMA" --version 2>/dev/null | head -1)"
                printf '%s (git %s)\n' "${v:-softrdma}" "$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')"
            fi ;;
    esac
}

# ---------------------------------------------------------------- main
START=$(date +%s)
install_tools
prepare_softrdma

CPU_MODEL="$(awk -F': *' '/^model name/ { print $2; exit }' /proc/cpuinfo 2>/dev/null)"
HEADER="$WORK/header.txt"
{
    echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "machine: $(nproc) CPUs, ${CPU_MODEL:-unknown CPU}, Linux $(uname -r)"
    echo "runs: $RUNS (cells are medians of the runs), loopback 127.0.0.1, load average at start: $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null)"
    if [ "$LOAD" -gt 0 ]; then
        echo "load: $LOAD CPU hog(s) (busy loops pinned with taskset to CPU $(seq -s, 0 $(( (LOAD < $(nproc) ? LOAD : $(nproc)) - 1 )))) running during every measurement of every stack"
    else
        echo "load: none added (--load 0)"
    fi
    echo "tools: $(tool_version iperf3 || echo 'iperf3 missing'); $(tool_version qperf || tool_version sockperf || echo 'qperf/sockperf missing'); $(tool_version ucx || echo 'UCX missing'); $(tool_version fabric || echo 'libfabric missing'); $(tool_version softrdma || echo 'softrdma missing')"
} >"$HEADER"


start_load "$LOAD"
for run in $(seq 1 "$RUNS"); do
    log "run $run/$RUNS: iperf3";   run_iperf3 "$run"
    log "run $run/$RUNS: tcp ping-pong"; run_tcp_lat "$run"
    log "run $run/$RUNS: UCX";      run_ucx "$run"
    log "run $run/$RUNS: libfabric"; run_fabric "$run"
    log "run $run/$RUNS: softrdma"; run_softrdma "$run"
done
if [ -n "$QPERF_PID" ]; then finish_bg "$QPERF_PID"; fi
stop_load

LAT_TOOL="qperf tcp_lat"
have qperf || LAT_TOOL="sockperf ping-pong"
mkdir -p "$(dirname "$OUT")"
python3 - "$RESULTS" "$HEADER" "$OUT" "$LAT_TOOL" "$(( $(date +%s) - START ))" <<'PYEOF'
import statistics, sys
from collections import defaultdict

results, header, out, lat_tool, elapsed = sys.argv[1:6]
SIZES = [8, 65536, 1048576]
SIZE_NAMES = {8: "8 B", 65536: "64 KiB", 1048576: "1 MiB"}

runs = defaultdict(list)
with open(results) as f:
    for line in f:
        parts = line.rstrip("\n").split("\t")
        if len(parts) != 6:
            continue
        tool, test, metric, size, _run, value = parts
        try:
            runs[(tool, test, metric, int(size))].append(float(value))
        except ValueError:
            pass

def med(tool, test, metric, size):
    v = runs.get((tool, test, metric, size))
    return statistics.median(v) if v else None

# (label, test name, tool, test, metric); latency rows say whether the
# cell is a median or a mean (every stack has a mean row).
ROWS = [
    ("raw TCP", "iperf3 stream", "tcp", "iperf3", "bw"),
    ("raw TCP", lat_tool, "tcp", "tcp_lat", "latmean"),
    ("raw TCP, busy-polled", "softrdma perf --baseline tcp-spin", "tcpspin", "pingpong", "lat"),
    ("raw TCP, busy-polled", "softrdma perf --baseline tcp-spin", "tcpspin", "pingpong", "latmean"),
    ("UCX tcp", "ucx_perftest ucp_put_bw", "ucx", "ucp_put_bw", "bw"),
    ("UCX tcp", "ucx_perftest ucp_am_bw", "ucx", "ucp_am_bw", "bw"),
    ("UCX tcp", "ucx_perftest tag_bw", "ucx", "tag_bw", "bw"),
    ("UCX tcp", "ucx_perftest tag_lat", "ucx", "tag_lat", "lat"),
    ("UCX tcp", "ucx_perftest tag_lat", "ucx", "tag_lat", "latmean"),
    ("libfabric tcp", "fi_pingpong (ping-pong)", "fabric", "pingpong", "bw"),
    ("libfabric tcp", "fi_pingpong", "fabric", "pingpong", "latmean"),
    ("softrdma", "perf write", "softrdma", "write", "bw"),
    ("softrdma", "perf write --lat", "softrdma", "write", "lat"),
    ("softrdma", "perf write --lat", "softrdma", "write", "latmean"),
    ("softrdma", "perf send", "softrdma", "send", "bw"),
    ("softrdma", "perf send --lat", "softrdma", "send", "lat"),
    ("softrdma", "perf send --lat", "softrdma", "send", "latmean"),
]
# Ratios: bandwidth / iperf3; latency (median or mean) / the TCP ping-pong's
# mean (qperf and sockperf report means only).
REF = {"bw": ("tcp", "iperf3", "bw"), "lat": ("tcp", "tcp_lat", "latmean"),
       "latmean": ("tcp", "tcp_lat", "latmean")}
UNIT = {"bw": "bandwidth MB/s", "lat": "latency us, median", "latmean": "latency us, mean"}

def fmt(v):
    if v is None:
        return "n/a"
    if v >= 100:
        return "%.0f" % v
    if v >= 10:
        return "%.1f" % v
    return "%.2f" % v

def cell(tool, test, metric, size):
    v = med(tool, test, metric, size)
    if v is None:
        return "n/a"
    ref = med(*REF[metric], size)
    if (tool, test, metric) == REF[metric]:
        return fmt(v)
    if ref:
        return "%s (%.2fx)" % (fmt(v), v / ref)
    return fmt(v)

head = ["stack", "test", "metric"] + [SIZE_NAMES[s] for s in SIZES]
table = [head]
for label, name, tool, test, metric in ROWS:
    table.append([label, name, UNIT[metric]] + [cell(tool, test, metric, s) for s in SIZES])

# --- targets
lines = []
def target(name, ok, detail):
    if ok is None:
        lines.append("N/A   %s: %s" % (name, detail))
    else:
        lines.append("%s  %s: %s" % ("PASS" if ok else "MISS", name, detail))

MIB = 1048576
w = med("softrdma", "write", "bw", MIB)
ip = med("tcp", "iperf3", "bw", MIB)
if w is None or ip is None:
    target("write bw 1 MiB >= 0.9 x iperf3", None, "softrdma %s MB/s, iperf3 %s MB/s" % (fmt(w), fmt(ip)))
else:
    target("write bw 1 MiB >= 0.9 x iperf3", w >= 0.9 * ip,
           "%s MB/s = %.2f x iperf3 %s MB/s (needs >= %s)" % (fmt(w), w / ip, fmt(ip), fmt(0.9 * ip)))
ucx_bw = [x for x in (med("ucx", t, "bw", MIB) for t in ("ucp_put_bw", "ucp_am_bw", "tag_bw")) if x is not None]
for name, other in (("UCX", max(ucx_bw) if ucx_bw else None), ("libfabric", med("fabric", "pingpong", "bw", MIB))):
    if w is None or other is None:
        target("write bw 1 MiB > %s" % name, None, "softrdma %s, %s %s MB/s" % (fmt(w), name, fmt(other)))
    else:
        target("write bw 1 MiB > %s" % name, w > other, "%s vs %s MB/s (%.2fx)" % (fmt(w), fmt(other), w / other))

# Latency targets compare means with means (qperf, sockperf, UCX overall,
# fi_pingpong all report means); the median is noted.
l = med("softrdma", "write", "latmean", 8)
lmed = med("softrdma", "write", "lat", 8)
tl = med("tcp", "tcp_lat", "latmean", 8)
if l is None or tl is None:
    target("8 B mean latency <= 1.2 x TCP ping-pong", None, "softrdma %s us, TCP %s us" % (fmt(l), fmt(tl)))
else:
    med_note = "; median %s us" % fmt(lmed) if lmed is not None else ""
    target("8 B mean latency <= 1.2 x TCP ping-pong", l <= 1.2 * tl,
           "mean %s us = %.2f x TCP %s us (needs <= %s)%s" % (fmt(l), l / tl, fmt(tl), fmt(1.2 * tl), med_note))
ts = med("tcpspin", "pingpong", "latmean", 8)
ls = med("softrdma", "send", "latmean", 8)
if ls is None or ts is None:
    target("8 B mean send latency <= busy-polled TCP", None, "softrdma %s us, TCP spinning %s us" % (fmt(ls), fmt(ts)))
else:
    target("8 B mean send latency <= busy-polled TCP", ls <= ts,
           "mean %s us = %.2f x spinning TCP %s us" % (fmt(ls), ls / ts, fmt(ts)))
for name, other in (("UCX", med("ucx", "tag_lat", "latmean", 8)), ("libfabric", med("fabric", "pingpong", "latmean", 8))):
    if l is None or other is None:
        target("8 B mean latency < %s" % name, None, "softrdma %s, %s %s us" % (fmt(l), name, fmt(other)))
    else:
        target("8 B mean latency < %s" % name, l < other, "%s vs %s us (%.2fx)" % (fmt(l), fmt(other), l / other))

# --- text output
widths = [max(len(r[i]) for r in table) for i in range(len(head))]
def text_row(r):
    return "  ".join(c.ljust(widths[i]) if i < 3 else c.rjust(widths[i]) for i, c in enumerate(r))
hdr = open(header).read().rstrip("\n")
print(hdr)
print()
print(text_row(table[0]))
print("  ".join("-" * w_ for w_ in widths))
for r in table[1:]:
    print(text_row(r))
print()
print("ratios: bandwidth / iperf3, latency (median or mean) / the mean of %s, at the same size; latency is one way (half a round trip)" % lat_tool)
print()
for t in lines:
    print(t)
print()
print("elapsed: %s s" % elapsed)

# --- markdown output
with open(out, "w") as f:
    f.write("# softrdma vs. raw TCP, UCX and libfabric (loopback)\n\n")
    for h in hdr.splitlines():
        f.write("- %s\n" % h)
    f.write("\n")
    f.write("| " + " | ".join(table[0]) + " |\n")
    f.write("|" + "|".join(["---"] * 3 + ["---:"] * len(SIZES)) + "|\n")
    for r in table[1:]:
        f.write("| " + " | ".join(r) + " |\n")
    f.write("\nRatios: bandwidth / iperf3, latency (median or mean) / the mean of %s, at the same size. "
            "Latency is one way (half a round trip). See bench/README.md.\n\n" % lat_tool)
    f.write("```\n")
    for t in lines:
        f.write(t + "\n")
    f.write("```\n")
print("table written to %s" % out, file=sys.stderr)
PYEOF
