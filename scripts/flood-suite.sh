#!/usr/bin/env bash
# Flood and churn: hostile load against softrdma servers on loopback.
#
#   scripts/flood-suite.sh            one PASS/FAIL line per case; exit 1 if any failed
#
# Cases:
#   halfopen   1000 silent TCP connections against `softrdma perf --server`:
#              a real client is still served (time printed, must be < 2 s),
#              the server's thread count stays flat
#   finclose   2000 MPA connections closed by the client with a FIN against
#              the async_echo example server: every one gets the server's
#              FIN back, threads and memory stay flat
#   silent     a perf client stopped (SIGSTOP) in the middle of a run: the
#              `--persist --timeout 3` server gives up on it and serves the
#              next client
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 2
LOGS=${SOFTRDMA_FLOOD_LOGS:-$(mktemp -d /tmp/softrdma-flood.XXXXXX)}
mkdir -p "$LOGS"

cargo build --release -q -p softrdma-cli || exit 2
cargo build --release -q -p softrdma-engine --features tokio --example async_echo || exit 2
BIN=$ROOT/target/release/softrdma
ECHO=$ROOT/target/release/examples/async_echo
# 1000 connections on each side of loopback.
ulimit -n 8192 2>/dev/null || ulimit -n 4096

fails=0
result() { # status name detail
	printf '%-4s %-10s %s\n' "$1" "$2" "$3"
	[ "$1" = PASS ] || fails=$((fails + 1))
}
# The server runs under `timeout`: measure its child.
child() { awk '{print $1}' "/proc/$1/task/$1/children" 2>/dev/null; }
threads() { awk '/^Threads:/{print $2}' "/proc/$(child "$1")/status" 2>/dev/null || echo 0; }
rss_kb() { awk '/^VmRSS:/{print $2}' "/proc/$(child "$1")/status" 2>/dev/null || echo 0; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.2f", b - a }'; }
below() { awk -v x="$1" -v y="$2" 'BEGIN { exit !(x < y) }'; }

PIDS=()
cleanup() {
	for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null; done
}
trap cleanup EXIT

# Wait for "listening on ADDR:PORT" in a log; print the port.
port_of() { # log
	for _ in $(seq 1 100); do
		p=$(grep -oE 'listening on [^ ]*:[0-9]+' "$1" 2>/dev/null | head -1 | grep -oE '[0-9]+$')
		[ -n "$p" ] && { echo "$p"; return 0; }
		sleep 0.1
	done
	return 1
}

# --- halfopen -------------------------------------------------------------
log=$LOGS/halfopen-server.log
timeout 120 "$BIN" perf --server --persist --bind 127.0.0.1 --port 0 --timeout 10 >"$log" 2>&1 &
SPID=$!
PIDS+=("$SPID")
if port=$(port_of "$log"); then
	t0=$(threads "$SPID")
	timeout 60 python3 scripts/flood.py halfopen 127.0.0.1 "$port" 1000 15 >"$LOGS/halfopen-flood.log" 2>&1 &
	FPID=$!
	PIDS+=("$FPID")
	for _ in $(seq 1 100); do grep -q 'connections open' "$LOGS/halfopen-flood.log" && break; sleep 0.1; done
	sleep 1
	t1=$(threads "$SPID")
	start=$(now)
	timeout 30 "$BIN" perf write --connect "127.0.0.1:$port" -n 100 -s 4K --timeout 10 >"$LOGS/halfopen-client.log" 2>&1
	crc=$?
	took=$(since "$start")
	t2=$(threads "$SPID")
	kill "$FPID" 2>/dev/null
	wait "$FPID" 2>/dev/null
	flood=$(grep -o '[0-9]* of 1000 connections open' "$LOGS/halfopen-flood.log")
	detail="$flood; real client served in ${took}s (exit $crc); server threads $t0 -> $t1 under flood -> $t2"
	if [ $crc -eq 0 ] && below "$took" 2 && [ "$t1" -le $((t0 + 16)) ] && [ "$t2" -le $((t0 + 16)) ]; then
		result PASS halfopen "$detail"
	else
		result FAIL halfopen "$detail ($LOGS)"
	fi
else
	result FAIL halfopen "server did not start ($log)"
fi
kill "$SPID" 2>/dev/null
wait "$SPID" 2>/dev/null

# --- finclose -------------------------------------------------------------
log=$LOGS/finclose-server.log
timeout 300 "$ECHO" server 127.0.0.1:0 >"$log" 2>&1 &
SPID=$!
PIDS+=("$SPID")
if port=$(port_of "$log"); then
	python3 scripts/flood.py finclose 127.0.0.1 "$port" 50 >/dev/null 2>&1 # warm up
	t0=$(threads "$SPID")
	m0=$(rss_kb "$SPID")
	timeout 240 python3 scripts/flood.py finclose 127.0.0.1 "$port" 2000 >"$LOGS/finclose.log" 2>&1 &
	FPID=$!
	PIDS+=("$FPID")
	tmax=$t0
	while kill -0 "$FPID" 2>/dev/null; do
		t=$(threads "$SPID")
		[ "$t" -gt "$tmax" ] && tmax=$t
		sleep 0.2
	done
	wait "$FPID"
	frc=$?
	sleep 1
	t1=$(threads "$SPID")
	m1=$(rss_kb "$SPID")
	detail="$(cat "$LOGS/finclose.log"); server threads $t0 -> max $tmax -> $t1; RSS ${m0} -> ${m1} KiB"
	if [ $frc -eq 0 ] && [ "$tmax" -le $((t0 + 16)) ] && [ "$m1" -le $((m0 + 20480)) ]; then
		result PASS finclose "$detail"
	else
		result FAIL finclose "$detail ($LOGS)"
	fi
else
	result FAIL finclose "server did not start ($log)"
fi
kill "$SPID" 2>/dev/null
wait "$SPID" 2>/dev/null

# --- silent ---------------------------------------------------------------
log=$LOGS/silent-server.log
timeout 120 "$BIN" perf --server --persist --bind 127.0.0.1 --port 0 --timeout 3 >"$log" 2>&1 &
SPID=$!
PIDS+=("$SPID")
if port=$(port_of "$log"); then
	timeout 60 "$BIN" perf write --connect "127.0.0.1:$port" -D 30 -s 64K --timeout 30 >"$LOGS/silent-client.log" 2>&1 &
	CPID=$!
	PIDS+=("$CPID")
	sleep 1.5
	kill -STOP "$CPID"
	start=$(now)
	timeout 30 "$BIN" perf write --connect "127.0.0.1:$port" -n 200 -s 4K --timeout 20 >"$LOGS/silent-next.log" 2>&1
	nrc=$?
	took=$(since "$start")
	kill -9 "$CPID" 2>/dev/null
	wait "$CPID" 2>/dev/null
	alive=no
	kill -0 "$SPID" 2>/dev/null && alive=yes
	detail="next client exit $nrc after ${took}s; server still serving: $alive"
	if [ $nrc -eq 0 ] && [ $alive = yes ]; then
		result PASS silent "$detail"
	else
		result FAIL silent "$detail ($LOGS)"
	fi
else
	result FAIL silent "server did not start ($log)"
fi
kill "$SPID" 2>/dev/null
wait "$SPID" 2>/dev/null

echo "flood-suite: $fails case(s) failed; logs in $LOGS"
[ $fails -eq 0 ]
