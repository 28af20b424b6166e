#!/usr/bin/env bash
# DAT (uDAPL) acceptance suite: DAPL's own test programs (dapl2-utils)
# over softrdma's provider, on loopback. Prints one PASS/FAIL line per case
# and exits non-zero if any case fails. The test programs exit 0 even when
# they fail, so every case is judged by its output.
#
# Usage: scripts/dat-suite.sh [DIR-WITH-libsoftrdma_dapl.so] [CASE-PATTERN]
#   Without DIR: builds `cargo build --release -p softrdma-dapl`.
#   CASE-PATTERN: run only cases whose name matches (grep -E).
# Environment: DAT_SUITE_KEEP=1 keeps the logs directory.
set -uo pipefail
cd "$(dirname "$0")/.."

if ! command -v dtest >/dev/null 2>&1 || ! command -v dapltest >/dev/null 2>&1; then
    echo "== installing dapl2-utils"
    DEBIAN_FRONTEND=noninteractive apt-get install -y dapl2-utils >/dev/null || {
        echo "FAIL setup: cannot install dapl2-utils"; exit 1; }
fi

DIR=${1:-}
PATTERN=${2:-.}
if [ -z "$DIR" ]; then
    echo "== cargo build --release -p softrdma-dapl"
    cargo build --release -q -p softrdma-dapl || { echo "FAIL setup: build"; exit 1; }
    DIR=$PWD/target/release
fi
SO=$(cd "$DIR" && pwd)/libsoftrdma_dapl.so
[ -f "$SO" ] || { echo "FAIL setup: $SO missing"; exit 1; }

T=$(mktemp -d /tmp/dat-suite.XXXXXX)
printf 'softrdma-lo u2.0 nonthreadsafe default %s dapl.2.0 "127.0.0.1 0" ""\n' "$SO" >"$T/dat.conf"
export DAT_OVERRIDE=$T/dat.conf
IA=softrdma-lo
FAILS=0
PASSES=0

# Connection qualifiers are TCP ports (port = qual + SOFTRDMA_DAT_PORT_BASE
# mod 65536). dtest, dtestsrq and dtestcm use 45248, inside Linux's
# ephemeral range, where TIME_WAIT sockets of busy machines can block a
# listener; their cases move it to 20000. dapltest uses 62000 and up.
DTEST_BASE=40288

result() { # name ok detail
    if [ "$2" = 1 ]; then
        echo "PASS $1"; PASSES=$((PASSES + 1))
    else
        echo "FAIL $1${3:+ ($3)}"; FAILS=$((FAILS + 1))
    fi
}

want() { # case? -> run it
    echo "$1" | grep -qE "$PATTERN"
}

wait_for() { # file pattern seconds
    local i=0
    while [ $i -lt $(($3 * 10)) ]; do
        grep -qE "$2" "$1" 2>/dev/null && return 0
        sleep 0.1; i=$((i + 1))
    done
    return 1
}

# dtest-style pair: name, ready-regex, pass-regex for both, extra client
# regex, server command..., --, client command...
pair() {
    local name=$1 ready=$2 pass=$3 extra=$4; shift 4
    local srv=() cli=()
    while [ "$1" != "--" ]; do srv+=("$1"); shift; done; shift
    cli=("$@")
    want "$name" || return 0
    local s="$T/$name.srv" c="$T/$name.cli"
    SOFTRDMA_DAT_PORT_BASE=$DTEST_BASE timeout 60 "${srv[@]}" >"$s" 2>&1 &
    local sp=$!
    if ! wait_for "$s" "$ready" 15; then
        kill "$sp" 2>/dev/null; wait "$sp" 2>/dev/null
        result "$name" 0 "server not ready"; return
    fi
    SOFTRDMA_DAT_PORT_BASE=$DTEST_BASE timeout 60 "${cli[@]}" >"$c" 2>&1
    wait "$sp" 2>/dev/null
    local ok=1 why=""
    grep -qE "$pass" "$s" || { ok=0; why="server: $(grep -iE 'error|fail' "$s" | head -1)"; }
    grep -qE "$pass" "$c" || { ok=0; why="client: $(grep -iE 'error|fail' "$c" | head -1)"; }
    if grep -qE "Error|ERR|FAILED" "$s" "$c"; then
        ok=0; why="$(grep -hE 'Error|ERR|FAILED' "$s" "$c" | head -1)"
    fi
    if [ -n "$extra" ] && ! grep -qE "$extra" "$c"; then ok=0; why="client lacks: $extra"; fi
    result "$name" $ok "$why"
}

# ---- dapltest -T L: resource limits (no peer)
limit() { # test width max pass-regex
    local name="limit:$1"
    want "$name" || return 0
    local o="$T/$name.log"
    # dapltest's limit qualifiers (0xAffab1e + n: ports 43806 + n) are in
    # the ephemeral range too: move them to 10000 + n.
    SOFTRDMA_DAT_PORT_BASE=31730 timeout 60 dapltest -T L -D $IA -w "$2" -m "$3" "$1" >"$o" 2>&1
    if grep -qE "$4" "$o" && ! grep -qiE "fails|error" "$o"; then
        result "$name" 1
    else
        result "$name" 0 "$(grep -iE 'fails|error|created|opened|posted' "$o" | head -2 | tr '\n' ' ')"
    fi
}
limit limit_ia 1 8 "IAs opened: 8"
limit limit_pz 4 64 "PZs created: 64"
limit limit_evd 4 64 "EVDs created: 64"
limit limit_cno 4 64 "CNOs created: 64"
limit limit_ep 4 64 "EPs created: 64"
limit limit_psp 4 64 "PSPs created: 64"
limit limit_rsp 4 64 "RSPs created: 64"
limit limit_lmr 4 64 "LMRs created: 64"
limit limit_rpost 2 15 "recv buffers posted per EP: 15"

# ---- dtest pairs
DREADY="Server is waiting for client connection"
DPASS="DAPL Test Complete. PASSED"
pair dtest "$DREADY" "$DPASS" "RDMA READ DATA with SEND MSG" \
    dtest -P $IA -s -b 4096 -B 100 -- dtest -P $IA -h 127.0.0.1 -b 4096 -B 100
pair dtest-p "$DREADY" "$DPASS" "RDMA READ DATA" \
    dtest -P $IA -s -p -b 4096 -B 100 -- dtest -P $IA -h 127.0.0.1 -p -b 4096 -B 100
pair dtest-c "$DREADY" "$DPASS" "RDMA READ DATA" \
    dtest -P $IA -s -c -b 4096 -B 100 -- dtest -P $IA -h 127.0.0.1 -c -b 4096 -B 100
pair dtest-W "$DREADY" "$DPASS" "" \
    dtest -P $IA -s -W -b 64 -B 100 -- dtest -P $IA -h 127.0.0.1 -W -b 64 -B 100
pair dtest-D "$DREADY" "$DPASS" "" \
    dtest -P $IA -s -D -b 4096 -B 100 -- dtest -P $IA -h 127.0.0.1 -D -b 4096 -B 100
pair dtest-w "$DREADY" "$DPASS" "" \
    dtest -P $IA -s -w -b 4096 -B 100 -- dtest -P $IA -h 127.0.0.1 -w -b 4096 -B 100
pair dtest-u "$DREADY" "$DPASS" "" \
    dtest -P $IA -s -u -b 4096 -B 100 -- dtest -P $IA -h 127.0.0.1 -u -b 4096 -B 100
pair dtest-S1 "$DREADY" "$DPASS" "RDMA READ DATA" \
    dtest -P $IA -s -S 1 -b 4096 -B 100 -- dtest -P $IA -h 127.0.0.1 -S 1 -b 4096 -B 100

# ---- dtestsrq and dtestcm
pair dtestsrq "ready on port" "DAPL RC SRQ Test Complete" "" \
    dtestsrq -P $IA -s -c 4 -B 4 -t 3 -- dtestsrq -P $IA -h 127.0.0.1 -c 4 -B 4 -t 3
# 20 EPs torn down at once: connection and async events must pair up.
pair dtestsrq-c20 "ready on port" "DAPL RC SRQ Test Complete" "" \
    dtestsrq -P $IA -s -c 20 -B 4 -t 3 -- dtestsrq -P $IA -h 127.0.0.1 -c 20 -B 4 -t 3
pair dtestcm-100 "Conn server waiting" "DAPL Connection Test Complete" "ALL 100 CONNECTED on Client" \
    dtestcm -P $IA -s -c 100 -b 10 -- dtestcm -P $IA -h 127.0.0.1 -c 100 -b 10
pair dtestcm-1000 "Conn server waiting" "DAPL Connection Test Complete" "ALL 1000 CONNECTED on Client" \
    dtestcm -P $IA -s -c 1000 -b 100 -- dtestcm -P $IA -h 127.0.0.1 -c 1000 -b 100

# ---- dapltest server with transaction, performance and quit clients
if want "dapltest"; then
    S="$T/dapltest.srv"
    timeout 150 dapltest -T S -D $IA -n 62000 >"$S" 2>&1 &
    SP=$!
    if wait_for "$S" "Service Point Ready" 15; then
        tcase() { # name args...
            local name=$1; shift
            want "$name" || return 0
            local o="$T/$name.log"
            timeout 60 dapltest "$@" >"$o" 2>&1
            if grep -qE "Stats|Test completed successfully|Total WQE|End of Work -- Client Exiting" "$o" &&
                ! grep -qE "Test Error|error:|bad connection event|Warning: conn_event_wait|retrying connection" "$o"; then
                result "$name" 1
            else
                result "$name" 0 "$(grep -iE 'error|warning|fail' "$o" | head -1)"
            fi
        }
        C="-s 127.0.0.1 -D $IA -n 62000"
        tcase dapltest-T-SR -T T $C -i 500 -t 1 -w 1 client SR 4096 server SR 4096
        tcase dapltest-T-RW -T T $C -i 200 -t 1 -w 1 client SR 256 server RW 4096 server SR 256
        tcase dapltest-T-RR -T T $C -i 200 -t 1 -w 1 client SR 256 server RR 4096 server SR 256
        tcase dapltest-T-V -T T -V $C -i 100 -t 2 -w 2 client RW 4096 1 server RW 2048 4 \
            client RR 1024 1 client SR 1024 3 -f server SR 2048 1 -f
        tcase dapltest-P-RW -T P $C -i 1000 -m b RW 4096 2
        tcase dapltest-P-RR -T P $C -i 1000 RR 4096 1
        timeout 20 dapltest -T Q $C >"$T/dapltest-Q.log" 2>&1
        wait "$SP" 2>/dev/null
        if grep -qE "Exiting" "$S"; then result dapltest-Q 1; else result dapltest-Q 0 "server did not exit"; fi
    else
        kill "$SP" 2>/dev/null; wait "$SP" 2>/dev/null
        result dapltest-server 0 "not ready: $(tail -1 "$S")"
    fi
fi

echo "== dat-suite: $PASSES passed, $FAILS failed (logs: $T)"
if [ "$FAILS" = 0 ] && [ -z "${DAT_SUITE_KEEP:-}" ]; then rm -rf "$T"; fi
[ "$FAILS" = 0 ]
