#!/usr/bin/env bash
# Acceptance suite of the drop-in libibverbs/librdmacm (crates/softrdma-verbs):
# unmodified rdma-core programs (ibv_devices, ibv_devinfo, rping, perftest,
# qperf) over softrdma on loopback, started with `softrdma run`.
#
# Prints one PASS/FAIL line per case (judged by the programs' output, not
# their exit status) and exits non-zero if any case fails.
#
#   scripts/verbs-suite.sh            # installs the tools with apt if missing
#   VERBS_SUITE_NO_BUILD=1 scripts/verbs-suite.sh   # use the existing build
set -uo pipefail
cd "$(dirname "$0")/.."

need=()
for t in ibv_devices:ibverbs-utils rping:rdmacm-utils ib_write_bw:perftest qperf:qperf; do
    command -v "${t%%:*}" >/dev/null 2>&1 || need+=("${t#*:}")
done
if ((${#need[@]})); then
    echo "== installing ${need[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y "${need[@]}" >/dev/null 2>&1 ||
        { apt-get update >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y "${need[@]}" >/dev/null 2>&1; } ||
        { echo "FAIL setup: cannot install ${need[*]}"; exit 1; }
fi

if [[ -z "${VERBS_SUITE_NO_BUILD:-}" ]]; then
    echo "== cargo build --release -p softrdma-verbs -p softrdma-cli"
    cargo build --release -p softrdma-verbs -p softrdma-cli >"${TMPDIR:-/tmp}/verbs-suite-build.$$" 2>&1 ||
        { tail -n 20 "${TMPDIR:-/tmp}/verbs-suite-build.$$"; echo "FAIL build"; exit 1; }
    rm -f "${TMPDIR:-/tmp}/verbs-suite-build.$$"
fi
S=$PWD/target/release/softrdma
[[ -x $S ]] || { echo "FAIL setup: $S missing"; exit 1; }

T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
RUN=("$S" run --verbs --no-dat --)
fails=0
pass() { echo "PASS $1"; }
fail() {
    echo "FAIL $1${2:+ ($2)}"
    fails=$((fails + 1))
    for f in "$T"/srv.out "$T"/cli.out; do
        [[ -s $f ]] && sed 's/^/    | /' "$f" | tail -n 8
    done
}

# wait_listen PORT: until something listens on TCP PORT (at most 15 s).
wait_listen() {
    local i
    for ((i = 0; i < 150; i++)); do
        [[ -n $(ss -Hltn "sport = :$1" 2>/dev/null) ]] && return 0
        sleep 0.1
    done
    return 1
}

# run_pair NAME TIMEOUT PORT "SERVER CMD" "CLIENT CMD": the server starts in
# the background, the client once the server listens on PORT; both outputs
# kept in srv.out/cli.out.
run_pair() {
    local name=$1 to=$2 port=$3 srv=$4 cli=$5
    : >"$T/srv.out"
    : >"$T/cli.out"
    # shellcheck disable=SC2086
    timeout "$to" $srv >"$T/srv.out" 2>&1 &
    local spid=$!
    wait_listen "$port" || echo "(suite: nothing listens on $port after 15 s)" >>"$T/cli.out"
    # shellcheck disable=SC2086
    timeout "$to" $cli >>"$T/cli.out" 2>&1
    wait "$spid" 2>/dev/null
}

# ---- loader: every symbol and version node resolves ----
for b in rping udaddy ibv_devinfo ibv_devices ibv_rc_pingpong ib_write_bw ib_read_bw ib_send_bw \
    ib_write_lat ib_read_lat ib_send_lat ib_atomic_bw qperf; do
    p=$(command -v "$b") || { fail "loader $b" "not installed"; continue; }
    out=$("${RUN[@]}" ldd -r "$p" 2>&1)
    if grep -qE 'not found|undefined symbol|no version information' <<<"$out"; then
        fail "loader $b" "$(grep -E 'not found|undefined symbol|no version' <<<"$out" | head -n 2 | tr '\n' ' ')"
    elif ! grep -qE '(libibverbs|librdmacm|libmlx5|libefa).so.1 => .*softrdma-run' <<<"$out" ||
        grep -E '(libibverbs|librdmacm|libmlx5|libefa).so.1 => ' <<<"$out" | grep -qv softrdma-run; then
        # One file serves all four names, so only the first one loaded is listed.
        fail "loader $b" "the real libibverbs/librdmacm would load"
    else
        pass "loader $b"
    fi
done

# ---- devices ----
out=$(timeout 20 "${RUN[@]}" ibv_devices 2>&1)
if grep -qE '^\s+softrdma0\s+[0-9a-f]{16}' <<<"$out"; then pass "ibv_devices"; else fail "ibv_devices" "$out"; fi
out=$(timeout 20 "${RUN[@]}" ibv_devinfo -v 2>&1)
if grep -qE 'transport:\s+iWARP' <<<"$out" && grep -qE 'link_layer:\s+Ethernet' <<<"$out" &&
    grep -qE 'state:\s+PORT_ACTIVE' <<<"$out" && grep -qE 'GID\[\s*0\]:\s+0000:0000:0000:0000:0000:ffff:7f00:0001' <<<"$out"; then
    pass "ibv_devinfo -v"
else
    fail "ibv_devinfo -v" "$(head -n 3 <<<"$out" | tr '\n' ' ')"
fi

# ---- rping ----
pings() { grep -c "ping data" "$1"; }
run_pair "rping pair" 30 7174 "${RUN[*]} rping -s -a 127.0.0.1 -p 7174 -C 100 -v -V" \
    "${RUN[*]} rping -c -a 127.0.0.1 -p 7174 -C 100 -v -V"
if [[ $(pings "$T/cli.out") == 100 && $(pings "$T/srv.out") == 100 ]]; then pass "rping pair (100 pings)"; else fail "rping pair"; fi

# rping's buffer is 64 bytes unless -S says otherwise; the server RDMA
# Reads the client's whole buffer into its own, so both sides use one size.
run_pair "rping -> softrdma ping" 30 7175 "$S ping -s -a 127.0.0.1 -p 7175 -C 100 -S 64" \
    "${RUN[*]} rping -c -a 127.0.0.1 -p 7175 -C 100 -v -V"
if [[ $(pings "$T/cli.out") == 100 ]] && grep -q "100 iterations .* verified" "$T/srv.out"; then
    pass "rping client -> softrdma ping server"
else fail "rping client -> softrdma ping server"; fi

run_pair "softrdma ping -> rping" 30 7176 "${RUN[*]} rping -s -a 127.0.0.1 -p 7176 -C 100 -v -V" \
    "$S ping -c -a 127.0.0.1 -p 7176 -C 100 -S 64"
if [[ $(pings "$T/srv.out") == 100 ]] && grep -q "100 iterations .* verified" "$T/cli.out"; then
    pass "softrdma ping client -> rping server"
else fail "softrdma ping client -> rping server"; fi

# ---- perftest (-R: connections through rdma_cm, as iWARP needs) ----
results() { grep -qE '^\s*[0-9]+\s+[0-9]+\s+[0-9.]+\s+[0-9.]+' "$1"; }
port=18515
# perf NAME [--server-only "ARGS"] [--client-only "ARGS"] PROGRAM ARGS...:
# both sides run PROGRAM ARGS (line-buffered, so a hang still shows how far
# it got); the --*-only arguments go to one side.
perf() {
    local name=$1 sonly="" conly=""
    shift
    while [[ $1 == --server-only || $1 == --client-only ]]; do
        if [[ $1 == --server-only ]]; then sonly=$2; else conly=$2; fi
        shift 2
    done
    local try
    for try in 1 2; do
        port=$((port + 1))
        run_pair "$name" 60 "$port" "${RUN[*]} stdbuf -oL $* $sonly -R -d softrdma0 -p $port" \
            "${RUN[*]} stdbuf -oL $* $conly -R -d softrdma0 -p $port 127.0.0.1"
        # perftest times its report with the CPU's cycle counter, whose
        # rate it samples against the clock first; on a busy machine that
        # sample can be too noisy ("Correlation coefficient r^2: ... < 0.9",
        # "Can't produce a report"), and the side that gives up leaves its
        # peer's connection flushed. Not softrdma's doing: run it once more.
        if [[ $try == 1 ]] && grep -q "Correlation coefficient r^2" "$T/cli.out" "$T/srv.out"; then
            echo "    ($name: perftest could not time its report on this busy machine; once more)"
            continue
        fi
        break
    done
    # Both sides print the table, except the server of ib_read_lat (which
    # only serves the reads): there, no error line is enough.
    if results "$T/cli.out" && { results "$T/srv.out" || ! grep -qiE "fail|error|couldn't|unable" "$T/srv.out"; }; then
        pass "$name"
    else fail "$name"; fi
}
perf "ib_write_bw" ib_write_bw -s 65536 -n 200
perf "ib_read_bw" ib_read_bw -s 65536 -n 200
perf "ib_send_bw" ib_send_bw -s 65536 -n 200
perf "ib_write_lat" ib_write_lat -s 8 -n 500
perf "ib_read_lat" ib_read_lat -s 8 -n 500
perf "ib_send_lat" ib_send_lat -s 8 -n 500
perf "ib_atomic_bw" ib_atomic_bw -n 200
perf "ib_write_bw -q 4" ib_write_bw -s 65536 -n 200 -q 4
# Completion channels at bandwidth. ib_send_bw -e on the client hangs by
# design on iWARP (see docs/verbs.md: it waits for a send completion event
# while only the receiver's credit, an RDMA Write that raises no event, can
# unblock it), so there the receiving server takes the events and the client
# polls; ib_read_bw -e takes send-queue events on the client.
perf "ib_send_bw, server on completion events" --server-only -e ib_send_bw -s 65536 -n 200
perf "ib_read_bw -e (completion events)" ib_read_bw -s 65536 -n 200 -e
perf "ib_send_lat -e (completion events)" ib_send_lat -s 8 -n 200 -e
perf "ib_send_bw --use-srq" ib_send_bw -s 4096 -n 200 --use-srq
perf "ib_write_bw -a" ib_write_bw -a -n 20
perf "ib_read_bw -a" ib_read_bw -a -n 20
perf "ib_send_bw -a" ib_send_bw -a -n 20

# ---- qperf (-cm1: the RDMA CM, as iWARP needs) ----
# qperf's rc_bw and rc_rdma_write_bw count on InfiniBand's receiver-not-ready
# retry: the server re-posts its 1024 receives only after polling, and stops
# re-posting when its own timer ends the test while the client may still
# send. iWARP has no such retry: a Send or Write-with-Immediate that finds no
# receive posted ends the connection with a Terminate (kernel siw and iWARP
# NICs do the same), and qperf then reports "WR flush failure". With 8 MiB
# messages a 1 s test sends far fewer than 1024 messages, so the server's
# first receives cover the whole test however late it re-posts. (qperf
# options go before the host: after a test name they are ignored.)
: >"$T/srv.out"
: >"$T/cli.out"
SOFTRDMA_VERBS_DEBUG=$T/qsrv.dbg timeout 120 "${RUN[@]}" qperf -lp 19765 >"$T/qsrv.out" 2>&1 &
qpid=$!
wait_listen 19765 || echo "(suite: qperf server not listening after 15 s)"
for t in rc_bw rc_lat rc_rdma_write_bw rc_rdma_read_bw; do
    opts=()
    [[ $t == rc_bw || $t == rc_rdma_write_bw ]] && opts=(-m 8M)
    out=$(timeout 30 "${RUN[@]}" qperf -lp 19765 -cm1 -t 1 "${opts[@]}" 127.0.0.1 "$t" 2>&1)
    if grep -qE '^\s+(bw|latency)\s+=\s+[0-9.]+ ' <<<"$out"; then
        pass "qperf $t ($(grep -oE '(bw|latency)\s+=\s+[0-9.]+ \S+' <<<"$out" | tr -s ' '))"
    else
        fail "qperf $t" "$(tr '\n' ' ' <<<"$out") $(grep -h 'async event' "$T/qsrv.dbg" 2>/dev/null | grep -v CommEstablished | tail -n 2 | tr '\n' ' ')"
    fi
done
kill "$qpid" 2>/dev/null
wait "$qpid" 2>/dev/null

if ((fails)); then
    echo "verbs suite: $fails case(s) failed"
    exit 1
fi
echo "verbs suite: all cases passed"
