#!/usr/bin/env bash
# Unmodified socket programs with the sockets preload (softrdma run --sockets).
#
#   scripts/apps-suite.sh [--quick]
#   scripts/apps-suite.sh --bench [RUNS]   (speed ratios, medians of RUNS, default 3,
#                                          and one "goal" line per speed goal)
#
# Every program pair runs in four placements: none (no preload: the
# reference), both ends preloaded, only the client, only the server. Each
# case prints one PASS/FAIL line: bytes checked with sha256 (or the program's
# own success output), and for "both" the stats of the preloaded processes
# must show the connections offloaded (SOFTRDMA_APPS_EXPECT=offloaded, the
# default) or plain (SOFTRDMA_APPS_EXPECT=plain). Speed lines compare each placement with "none" in
# the same run.
#
# Programs (Debian packages, installed with apt when missing): nc
# (netcat-openbsd), iperf3, redis-server + redis-benchmark + redis-cli,
# nginx + curl + wrk. --quick: smaller counts (the CI run).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 2
QUICK=0
BENCH=0
case "${1:-}" in
-h | --help)
	sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'
	exit 0
	;;
esac
[ "${1:-}" = --quick ] && QUICK=1
if [ "${1:-}" = --bench ]; then BENCH=${2:-3}; fi
EXPECT=${SOFTRDMA_APPS_EXPECT:-offloaded}
LOGS=${SOFTRDMA_APPS_LOGS:-$(mktemp -d /tmp/softrdma-apps.XXXXXX)}
mkdir -p "$LOGS" && chmod 755 "$LOGS"

need=()
command -v nc >/dev/null || need+=(netcat-openbsd)
command -v iperf3 >/dev/null || need+=(iperf3)
command -v redis-server >/dev/null || need+=(redis-server)
command -v redis-benchmark >/dev/null || need+=(redis-tools)
command -v nginx >/dev/null || need+=(nginx)
command -v curl >/dev/null || need+=(curl)
command -v wrk >/dev/null || need+=(wrk)
if [ ${#need[@]} -gt 0 ]; then
	echo "apps-suite: installing ${need[*]}"
	export DEBIAN_FRONTEND=noninteractive
	{ apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}"; } >"$LOGS/apt.log" 2>&1 ||
		{ echo "apps-suite: apt-get failed ($LOGS/apt.log)"; exit 2; }
fi

cargo build --release -q -p softrdma-cli -p softrdma-preload || exit 2
BIN=$ROOT/target/release/softrdma

if [ $QUICK = 1 ]; then
	NC_MB=10 IPERF_T=2 REDIS_N=20000 WRK_D=2
else
	NC_MB=100 IPERF_T=5 REDIS_N=100000 WRK_D=5
fi
PLACEMENTS=(none both client server)

fails=0
result() { # status name detail
	printf '%-4s %-34s %s\n' "$1" "$2" "$3"
	[ "$1" = PASS ] || fails=$((fails + 1))
}
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null; done; }
trap cleanup EXIT

# Below the ephemeral range (32768-60999): no client port can take it.
PORT=$((20000 + RANDOM % 10000))
next_port() { PORT=$((PORT + 1)); }

# wrap PLACEMENT SIDE STATS: the prefix that runs SIDE (client|server).
wrap() {
	case "$1:$2" in
	both:* | client:client | server:server)
		echo "env SOFTRDMA_SOCKETS_STATS=$3 $BIN run --no-verbs --no-dat --sockets --"
		;;
	*) echo "" ;;
	esac
}

# An empty stats file every process can append to (nginx's workers drop
# root's privileges).
fresh_stats() { : >"$1" && chmod 666 "$1"; }

# The stats verdict of a placement: "" if fine, else what is wrong.
stats_verdict() { # placement statsfile
	local f=$2
	# The library's panics print nothing: the stats line counts them.
	if [ -s "$f" ] && grep -q '"panics":' "$f"; then
		echo "the library panicked: $(grep -o '"panic":"[^"]*' "$f" | head -1 | cut -c10-)"
		return
	fi
	case "$1" in
	none)
		[ -s "$f" ] && { echo "stats written without the preload"; return; }
		;;
	both)
		[ -s "$f" ] || { echo "no stats line from the preloaded processes"; return; }
		local off plain
		off=$(grep -o '"offloaded":[0-9]*' "$f" | cut -d: -f2 | awk '{ s += $1 } END { print s + 0 }')
		plain=$(grep -o '"plain":[0-9]*' "$f" | cut -d: -f2 | awk '{ s += $1 } END { print s + 0 }')
		if [ "$EXPECT" = offloaded ] && [ "${off:-0}" -eq 0 ]; then
			echo "0 connections offloaded ($plain plain: $(grep -o '"reasons":{[^}]*}' "$f" | sort | uniq -c | tr '\n' ' '))"
		elif [ "$EXPECT" = plain ] && [ "${off:-0}" -ne 0 ]; then
			echo "$off connections offloaded, expected plain"
		fi
		;;
	client | server)
		# One end plain: every connection must have fallen back.
		[ -s "$f" ] || { echo "no stats line from the preloaded side"; return; }
		local off
		off=$(grep -o '"offloaded":[0-9]*' "$f" | cut -d: -f2 | awk '{ s += $1 } END { print s + 0 }')
		[ "${off:-0}" -eq 0 ] || echo "$off connections offloaded with a plain peer"
		;;
	esac
}

# Wait until something listens on PORT, without connecting to it (one-shot
# servers such as `nc -l` and `iperf3 -s -1` would take a probe for their
# client).
wait_port() { # port
	local hex
	hex=$(printf ':%04X$' "$1")
	for _ in $(seq 1 100); do
		awk -v p="$hex" '$2 ~ p && $4 == "0A" { found = 1 } END { exit !found }' /proc/net/tcp /proc/net/tcp6 2>/dev/null && return 0
		sleep 0.1
	done
	return 1
}

# --- --bench [RUNS]: speed ratios, medians of RUNS runs ---------------------
# Placements: none (no preload), both (both ends preloaded, offloaded),
# kwait (as both, with SOFTRDMA_SOCKETS_WAIT=kernel: poll/select/epoll wait
# in the kernel on readiness descriptors, the engine's threads carrying
# every message), tcp (both ends preloaded with policy tcp: the preload's
# pass-through cost).
# Runs interleave the placements so that drift of a busy machine spreads
# over all of them. SOFTRDMA_APPS_BASE=DIR adds placement "base": as both,
# with the softrdma binary (and its preload library) in DIR, an older build
# to compare with in the same runs; SOFTRDMA_APPS_BENCH_PLACEMENTS="none
# both ..." runs only those (default: none both kwait tcp, and base).
if [ "$BENCH" -gt 0 ]; then
	BPL=(none both kwait tcp)
	[ -n "${SOFTRDMA_APPS_BASE:-}" ] && BPL+=(base)
	if [ -n "${SOFTRDMA_APPS_BENCH_PLACEMENTS:-}" ]; then
		read -r -a BPL <<<"$SOFTRDMA_APPS_BENCH_PLACEMENTS"
	fi
	bwrap() { # placement
		case "$1" in
		both) echo "$BIN run --no-verbs --no-dat --sockets --" ;;
		base) echo "${SOFTRDMA_APPS_BASE:-}/softrdma run --no-verbs --no-dat --sockets --" ;;
		kwait) echo "env SOFTRDMA_SOCKETS_WAIT=kernel $BIN run --no-verbs --no-dat --sockets --" ;;
		tcp) echo "$BIN run --no-verbs --no-dat --sockets --sockets-policy tcp --" ;;
		*) echo "" ;;
		esac
	}
	median() { sort -g | awk '{ v[NR] = $1 } END { if (NR == 0) print ""; else if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
	declare -A B
	www=$LOGS/www
	mkdir -p "$www" && head -c 1024 /dev/urandom >"$www/1K" && chmod -R a+rX "$www" "$LOGS"
	# CPU time of each side (perf stat task-clock, all threads and child
	# processes): work per CPU second is far less sensitive to other load
	# on the machine than wall-clock rates.
	cpuwrap() { # file
		command -v perf >/dev/null && echo "perf stat -x, -e task-clock -o $1"
	}
	cpums() { # file...
		cat "$@" 2>/dev/null | awk -F, '/task-clock/ { s += $1 } END { print s + 0 }'
	}
	# ops per CPU second of both sides: case placement ops statfiles...
	eff() {
		local c=$1 pl=$2 ops=$3 ms
		shift 3
		ms=$(cpums "$@")
		[ -n "$ops" ] && awk -v o="$ops" -v m="$ms" 'BEGIN { exit !(m > 0 && o > 0) }' &&
			E[$c,$pl]+="$(awk -v o="$ops" -v m="$ms" 'BEGIN { printf "%.0f", o / (m / 1000) }') "
		rm -f "$@"
	}
	declare -A E
	st=$LOGS/bench-cpu
	for run in $(seq 1 "$BENCH"); do
		# Each run starts with another placement (the one run after
		# another's ports and TIME_WAIT is not always the same).
		k=$(((run - 1) % ${#BPL[@]}))
		for pl in "${BPL[@]:k}" "${BPL[@]:0:k}"; do
			W=$(bwrap "$pl")
			next_port
			# shellcheck disable=SC2086
			timeout 40 $(cpuwrap "$st.s") $W iperf3 -s -1 -B 127.0.0.1 -p "$PORT" >/dev/null 2>&1 &
			spid=$!
			wait_port "$PORT"
			# shellcheck disable=SC2086
			v=$(timeout 40 $(cpuwrap "$st.c") $W iperf3 -c 127.0.0.1 -p "$PORT" -t 5 -f m 2>&1 | grep receiver | tail -1 | grep -oE '[0-9.]+ Mbits/sec' | cut -d' ' -f1)
			wait "$spid"
			B[iperf3,$pl]+="$v "
			eff iperf3 "$pl" "$(awk -v r="${v:-0}" 'BEGIN { print r * 5 }')" "$st.s" "$st.c"
			# redis-P16-1M: the same with 1 000 000 requests, which
			# amortizes the set-up of the 51 connections and of the two
			# processes (informational: the per-request cost alone).
			for rc in P1:1 P16:16 P16-1M:16; do
				pipe=${rc#*:}
				rn=100000
				[ "${rc%%:*}" = P16-1M ] && rn=1000000
				next_port
				# shellcheck disable=SC2086
				timeout 120 $(cpuwrap "$st.s") $W redis-server --port "$PORT" --bind 127.0.0.1 --save '' --appendonly no --dir "$LOGS" >/dev/null 2>&1 &
				spid=$!
				wait_port "$PORT"
				# shellcheck disable=SC2086
				v=$(timeout 60 $(cpuwrap "$st.c") $W redis-benchmark -h 127.0.0.1 -p "$PORT" -q -n $rn -c 50 -t get -P $pipe 2>&1 | tr '\r' '\n' | grep -E '^GET:' | tail -1 | grep -oE '[0-9.]+ requests' | cut -d' ' -f1)
				B[redis-${rc%%:*},$pl]+="$v "
				# The server itself, so that perf writes its count.
				kill -INT "$(pgrep -f "redis-server 127.0.0.1:$PORT" | head -1)" 2>/dev/null
				wait "$spid" 2>/dev/null
				eff "redis-${rc%%:*}" "$pl" "${v:+$rn}" "$st.s" "$st.c"
			done
			# nginx-wrk: the suite's configuration (tcp_nopush off: the
			# header and the file go as two writes); nginx-nopush: with
			# tcp_nopush on, as Debian's default nginx.conf has it (TCP_CORK
			# around them: one message offloaded, one segment plain).
			for nc in nginx-wrk nginx-nopush; do
			nopush=off
			[ $nc = nginx-nopush ] && nopush=on
			next_port
			d=$LOGS/bench-$nc-$pl
			mkdir -p "$d"
			cat >"$d/nginx.conf" <<EOC
worker_processes 2;
daemon off;
pid $d/nginx.pid;
error_log $d/error.log;
events { worker_connections 256; }
http {
    access_log off;
    sendfile on;
    tcp_nopush $nopush;
    client_body_temp_path $d/body;
    proxy_temp_path $d/proxy;
    fastcgi_temp_path $d/fastcgi;
    uwsgi_temp_path $d/uwsgi;
    scgi_temp_path $d/scgi;
    server { listen 127.0.0.1:$PORT; root $www; }
}
EOC
			# shellcheck disable=SC2086
			timeout 60 $(cpuwrap "$st.s") $W nginx -c "$d/nginx.conf" -p "$d" >/dev/null 2>&1 &
			spid=$!
			wait_port "$PORT"
			# shellcheck disable=SC2086
			v=$(timeout 30 $(cpuwrap "$st.c") $W wrk -t1 -c20 -d5s "http://127.0.0.1:$PORT/1K" 2>&1 | awk '/^Requests\/sec/ { print $2 }')
			B[$nc,$pl]+="$v "
			kill -QUIT "$(cat "$d/nginx.pid" 2>/dev/null)" 2>/dev/null || kill "$spid" 2>/dev/null
			wait "$spid" 2>/dev/null
			eff $nc "$pl" "$(awk -v r="${v:-0}" 'BEGIN { print r * 5 }')" "$st.s" "$st.c"
			done
		done
		echo "apps-suite: bench run $run of $BENCH done"
	done
	# Pass-through cost of the preload (policy tcp, nothing offloaded), as
	# CPU time (less sensitive to a busy machine than wall time): 2 M
	# one-byte reads and 2 M writes, the worst case for an interposed call.
	if command -v perf >/dev/null && [[ " ${BPL[*]} " == *" tcp "* ]]; then
		for run in $(seq 1 "$BENCH"); do
			for pl in none tcp; do
				pre=""
				[ $pl = tcp ] && pre="env LD_PRELOAD=$ROOT/target/release/libsoftrdma_preload.so SOFTRDMA_SOCKETS=tcp"
				# shellcheck disable=SC2086
				v=$(timeout 60 perf stat -x, -e task-clock $pre dd if=/dev/zero of=/dev/null bs=1 count=2000000 2>&1 >/dev/null | awk -F, '/task-clock/ { print $1 }')
				B[dd-cpu-ms,$pl]+="$v "
			done
		done
	fi
	printf '%-10s %-6s %14s %8s   %s\n' case placement median "x none" "runs"
	declare -A RATIO
	for c in iperf3 redis-P1 redis-P16 redis-P16-1M nginx-wrk nginx-nopush dd-cpu-ms; do
		base=$(echo "${B[$c,none]:-}" | tr ' ' '\n' | grep . | median)
		for pl in none both kwait tcp base; do
			[ -n "${B[$c,$pl]:-}" ] || continue
			m=$(echo "${B[$c,$pl]}" | tr ' ' '\n' | grep . | median)
			r=$(awk -v a="$m" -v b="$base" 'BEGIN { if (a == "" || b == "" || b == 0) print "-"; else printf "%.2f", a / b }')
			RATIO[$c,$pl]=$r
			printf '%-10s %-6s %14s %8s   %s\n' "$c" "$pl" "$m" "$r" "${B[$c,$pl]}"
		done
	done
	# Work per CPU second of both sides (Mbit, requests), the load-insensitive
	# view of the same runs.
	if [ -n "${E[iperf3,none]:-}${E[redis-P1,none]:-}" ]; then
		printf '\n%-10s %-6s %14s %8s   %s\n' "case/cpu-s" placement median "x none" "runs"
		for c in iperf3 redis-P1 redis-P16 redis-P16-1M nginx-wrk nginx-nopush; do
			base=$(echo "${E[$c,none]:-}" | tr ' ' '\n' | grep . | median)
			for pl in none both kwait tcp base; do
				[ -n "${E[$c,$pl]:-}" ] || continue
				m=$(echo "${E[$c,$pl]}" | tr ' ' '\n' | grep . | median)
				r=$(awk -v a="$m" -v b="$base" 'BEGIN { if (a == "" || b == "" || b == 0) print "-"; else printf "%.2f", a / b }')
				RATIO[cpu-$c,$pl]=$r
				printf '%-10s %-6s %14s %8s   %s\n' "$c" "$pl" "$m" "$r" "${E[$c,$pl]}"
			done
		done
		echo
	fi
	# The speed goals, each with its ratio (medians of this run; "per CPU":
	# the same from work per CPU second).
	goal() { # name ratio op limit
		local v
		v=$(awk -v r="$2" -v l="$4" -v op="$3" 'BEGIN { if (r == "-" || r == "") print "n/a"; else if ((op == ">=" && r >= l) || (op == "<=" && r <= l)) print "met"; else print "MISSED" }')
		printf 'goal %-36s %6s %s %-5s %s\n' "$1" "${2:--}" "$3" "$4" "$v"
	}
	goal "iperf3 both/none" "${RATIO[iperf3,both]:-}" ">=" 0.90
	goal "redis GET -P 1 both/none" "${RATIO[redis-P1,both]:-}" ">=" 0.90
	goal "redis GET -P 16 both/none" "${RATIO[redis-P16,both]:-}" ">=" 1.00
	goal "nginx+wrk both/none" "${RATIO[nginx-wrk,both]:-}" ">=" 0.90
	goal "nginx+wrk tcp_nopush both/none" "${RATIO[nginx-nopush,both]:-}" ">=" 0.90
	for c in iperf3 redis-P1 redis-P16 nginx-wrk; do
		goal "policy tcp overhead: $c tcp/none" "${RATIO[$c,tcp]:-}" ">=" 0.97
	done
	goal "policy tcp overhead: CPU of dd tcp/none" "${RATIO[dd-cpu-ms,tcp]:-}" "<=" 1.03
	if [ -n "${RATIO[cpu-iperf3,both]:-}" ]; then
		goal "per CPU: iperf3 both/none" "${RATIO[cpu-iperf3,both]:-}" ">=" 0.90
		goal "per CPU: redis GET -P 1 both/none" "${RATIO[cpu-redis-P1,both]:-}" ">=" 0.90
		goal "per CPU: redis GET -P 16 both/none" "${RATIO[cpu-redis-P16,both]:-}" ">=" 1.00
		goal "per CPU: nginx+wrk both/none" "${RATIO[cpu-nginx-wrk,both]:-}" ">=" 0.90
		goal "per CPU: nginx+wrk tcp_nopush both/none" "${RATIO[cpu-nginx-nopush,both]:-}" ">=" 0.90
		for c in iperf3 redis-P1 redis-P16 nginx-wrk; do
			goal "per CPU: policy tcp overhead: $c" "${RATIO[cpu-$c,tcp]:-}" ">=" 0.97
		done
		# No goal: the per-request part of redis -P 16 alone (the
		# set-up of connections and processes amortized).
		printf 'info %-36s %6s\n' "per CPU: redis -P 16, 1M requests" "${RATIO[cpu-redis-P16-1M,both]:--}"
	fi
	exit 0
fi

# --- nc: random bytes each way, sha256 on both ends ------------------------
head -c $((NC_MB * 1024 * 1024)) /dev/urandom >"$LOGS/nc.in"
want=$(sha256sum <"$LOGS/nc.in" | cut -d' ' -f1)
for pl in "${PLACEMENTS[@]}"; do
	for dir in up down; do
		next_port
		st=$LOGS/nc-$pl-$dir.stats
		fresh_stats "$st"
		out=$LOGS/nc-$pl-$dir.out
		if [ $dir = up ]; then
			# shellcheck disable=SC2046
			timeout 60 $(wrap "$pl" server "$st") nc -l 127.0.0.1 "$PORT" >"$out" 2>"$out.err" &
			spid=$!
			PIDS+=("$spid")
			wait_port "$PORT"
			# shellcheck disable=SC2046
			timeout 60 $(wrap "$pl" client "$st") nc -N 127.0.0.1 "$PORT" <"$LOGS/nc.in" 2>"$out.cerr"
			crc=$?
			wait "$spid"
			src=$?
		else
			# shellcheck disable=SC2046
			timeout 60 $(wrap "$pl" server "$st") nc -N -l 127.0.0.1 "$PORT" <"$LOGS/nc.in" 2>"$out.err" &
			spid=$!
			PIDS+=("$spid")
			wait_port "$PORT"
			# shellcheck disable=SC2046
			timeout 60 $(wrap "$pl" client "$st") nc 127.0.0.1 "$PORT" >"$out" 2>"$out.cerr" </dev/null
			crc=$?
			wait "$spid"
			src=$?
		fi
		got=$(sha256sum <"$out" | cut -d' ' -f1)
		v=$(stats_verdict "$pl" "$st")
		name="nc $NC_MB MB $dir ($pl)"
		if [ "$got" = "$want" ] && [ -z "$v" ]; then
			result PASS "$name" "sha256 equal; exits $crc/$src"
		else
			result FAIL "$name" "sha256 $([ "$got" = "$want" ] && echo equal || echo DIFFERS); exits $crc/$src; $v"
		fi
		rm -f "$out"
	done
done

# --- iperf3 -----------------------------------------------------------------
declare -A IPERF_BASE
for pl in "${PLACEMENTS[@]}"; do
	for variant in default -R "-P 4" -Z; do
		next_port
		st=$LOGS/iperf-$pl-${variant// /}.stats
		fresh_stats "$st"
		log=$LOGS/iperf-$pl-${variant// /}.log
		# shellcheck disable=SC2046
		timeout $((IPERF_T + 30)) $(wrap "$pl" server "$st") iperf3 -s -1 -B 127.0.0.1 -p "$PORT" >"$log.server" 2>&1 &
		spid=$!
		PIDS+=("$spid")
		wait_port "$PORT"
		opts=""
		[ "$variant" != default ] && opts=$variant
		# shellcheck disable=SC2046,SC2086
		timeout $((IPERF_T + 30)) $(wrap "$pl" client "$st") iperf3 -c 127.0.0.1 -p "$PORT" -t "$IPERF_T" $opts -f m >"$log" 2>&1
		crc=$?
		wait "$spid"
		gbps=$(grep -E 'receiver' "$log" | tail -1 | grep -oE '[0-9.]+ Mbits/sec' | cut -d' ' -f1)
		v=$(stats_verdict "$pl" "$st")
		name="iperf3 $variant ($pl)"
		if [ $crc -eq 0 ] && [ -n "$gbps" ] && [ -z "$v" ]; then
			ratio=""
			if [ "$pl" = none ]; then
				IPERF_BASE[$variant]=$gbps
			elif [ -n "${IPERF_BASE[$variant]:-}" ]; then
				ratio=$(awk -v a="$gbps" -v b="${IPERF_BASE[$variant]}" 'BEGIN { printf "%.2f x none", a / b }')
			fi
			result PASS "$name" "$gbps Mbit/s $ratio"
		else
			result FAIL "$name" "exit $crc, rate '${gbps}'; $v ($log)"
		fi
	done
done

# --- redis --------------------------------------------------------------------
declare -A REDIS_BASE
for pl in "${PLACEMENTS[@]}"; do
	next_port
	st=$LOGS/redis-$pl.stats
	fresh_stats "$st"
	dir=$LOGS/redis-$pl
	mkdir -p "$dir"
	# shellcheck disable=SC2046
	timeout 300 $(wrap "$pl" server "$st") redis-server --port "$PORT" --bind 127.0.0.1 --save '' \
		--appendonly no --dir "$dir" --daemonize no >"$dir/server.log" 2>&1 &
	spid=$!
	PIDS+=("$spid")
	wait_port "$PORT"
	for pipe in 1 16; do
		log=$dir/bench-P$pipe.log
		# shellcheck disable=SC2046
		timeout 120 $(wrap "$pl" client "$st") redis-benchmark -h 127.0.0.1 -p "$PORT" -q -n "$REDIS_N" -c 50 -t set,get -P $pipe >"$log" 2>&1 &
		bpid=$!
		PIDS+=("$bpid")
		if [ $pipe = 16 ]; then
			sleep 0.3
			# shellcheck disable=SC2046
			timeout 30 $(wrap "$pl" client "$st") redis-cli -h 127.0.0.1 -p "$PORT" bgsave >"$dir/bgsave.log" 2>&1
		fi
		wait "$bpid"
		brc=$?
		set_rps=$(tr '\r' '\n' <"$log" | grep -E '^SET:' | tail -1 | grep -oE '[0-9.]+ requests' | cut -d' ' -f1)
		get_rps=$(tr '\r' '\n' <"$log" | grep -E '^GET:' | tail -1 | grep -oE '[0-9.]+ requests' | cut -d' ' -f1)
		name="redis-benchmark -P $pipe ($pl)"
		if [ $brc -eq 0 ] && [ -n "$set_rps" ] && [ -n "$get_rps" ]; then
			ratio=""
			if [ "$pl" = none ]; then
				REDIS_BASE[$pipe]=$get_rps
			elif [ -n "${REDIS_BASE[$pipe]:-}" ]; then
				ratio=$(awk -v a="$get_rps" -v b="${REDIS_BASE[$pipe]}" 'BEGIN { printf "(GET %.2f x none)", a / b }')
			fi
			result PASS "$name" "SET $set_rps GET $get_rps req/s $ratio"
		else
			result FAIL "$name" "exit $brc ($log)"
		fi
	done
	if grep -q 'Background saving started' "$dir/bgsave.log" 2>/dev/null; then
		result PASS "redis-cli bgsave under load ($pl)" "$(head -1 "$dir/bgsave.log")"
	else
		result FAIL "redis-cli bgsave under load ($pl)" "$(head -1 "$dir/bgsave.log" 2>/dev/null)"
	fi
	kill "$spid" 2>/dev/null
	wait "$spid" 2>/dev/null
	v=$(stats_verdict "$pl" "$st")
	if [ -z "$v" ]; then result PASS "redis stats ($pl)" "as expected"; else result FAIL "redis stats ($pl)" "$v"; fi
done

# --- nginx: curl files with sha256, wrk -------------------------------------
www=$LOGS/www
mkdir -p "$www"
sizes=(1K 64K 1M 16M)
for s in "${sizes[@]}"; do head -c "$(numfmt --from=iec "$s")" /dev/urandom >"$www/$s"; done
chmod -R a+rX "$www" "$LOGS"
declare -A NGINX_BASE
for pl in "${PLACEMENTS[@]}"; do
	for sf in on off; do
		next_port
		st=$LOGS/nginx-$pl-$sf.stats
		fresh_stats "$st"
		d=$LOGS/nginx-$pl-$sf
		mkdir -p "$d"
		# With sendfile, tcp_nopush too (Debian's default nginx.conf):
		# TCP_CORK around the header and the file.
		cat >"$d/nginx.conf" <<EOF
worker_processes 2;
daemon off;
pid $d/nginx.pid;
error_log $d/error.log;
events { worker_connections 256; }
http {
    access_log off;
    sendfile $sf;
    tcp_nopush $sf;
    client_body_temp_path $d/body;
    proxy_temp_path $d/proxy;
    fastcgi_temp_path $d/fastcgi;
    uwsgi_temp_path $d/uwsgi;
    scgi_temp_path $d/scgi;
    server { listen 127.0.0.1:$PORT; root $www; }
}
EOF
		# shellcheck disable=SC2046
		timeout 120 $(wrap "$pl" server "$st") nginx -c "$d/nginx.conf" -p "$d" >"$d/out.log" 2>&1 &
		spid=$!
		PIDS+=("$spid")
		wait_port "$PORT"
		ok=1
		detail=""
		for s in "${sizes[@]}"; do
			# shellcheck disable=SC2046
			got=$(timeout 30 $(wrap "$pl" client "$st") curl -s "http://127.0.0.1:$PORT/$s" | sha256sum | cut -d' ' -f1)
			if [ "$got" != "$(sha256sum <"$www/$s" | cut -d' ' -f1)" ]; then
				ok=0
				detail="$detail $s differs;"
			fi
		done
		# shellcheck disable=SC2046
		timeout $((WRK_D + 20)) $(wrap "$pl" client "$st") wrk -t1 -c20 -d"${WRK_D}s" "http://127.0.0.1:$PORT/1K" >"$d/wrk.log" 2>&1
		rps=$(grep -E '^Requests/sec' "$d/wrk.log" | awk '{print $2}')
		kill "$spid" 2>/dev/null
		wait "$spid" 2>/dev/null
		v=$(stats_verdict "$pl" "$st")
		name="nginx sendfile $sf ($pl)"
		if [ $ok = 1 ] && [ -n "$rps" ] && [ -z "$v" ]; then
			ratio=""
			if [ "$pl" = none ]; then
				NGINX_BASE[$sf]=$rps
			elif [ -n "${NGINX_BASE[$sf]:-}" ]; then
				ratio=$(awk -v a="$rps" -v b="${NGINX_BASE[$sf]}" 'BEGIN { printf "(%.2f x none)", a / b }')
			fi
			result PASS "$name" "curl 1K..16M sha256 equal; wrk $rps req/s $ratio"
		else
			result FAIL "$name" "${detail} wrk '${rps}'; $v ($d)"
		fi
	done
done

echo "apps-suite: $fails case(s) failed (expecting $EXPECT connections with both ends preloaded); logs in $LOGS"
[ $fails -eq 0 ]
