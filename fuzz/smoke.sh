#!/usr/bin/env bash
# Fuzz smoke runs. Two modes:
#
#   fuzz/smoke.sh --replay [TARGET...]
#       Stable toolchain, no cargo-fuzz: builds every target as a plain
#       binary (libFuzzer's driver without coverage instrumentation) and
#       runs each committed seed input once (fuzz/seeds/TARGET/*, plus
#       fuzz/corpus/TARGET/* if earlier fuzzing left one). Fails if any
#       input fails a target's checks. This is what CI runs.
#
#   fuzz/smoke.sh [SECONDS] [TARGET...]
#       Fuzzes every target for a bounded time (default 30 s each), starting
#       from the seeds, and prints the inputs run per target and per second.
#       Installs cargo-fuzz from crates.io if it is missing. Uses the
#       nightly toolchain with AddressSanitizer when one is installed;
#       otherwise the stable toolchain without a sanitizer (RUSTC_BOOTSTRAP
#       for libFuzzer's flags).
set -euo pipefail
cd "$(dirname "$0")"

all_targets() {
    sed -n 's/^name = "\(.*\)"$/\1/p' Cargo.toml | grep -v '^softrdma-fuzz$'
}

if [ "${1:-}" = "--replay" ]; then
    shift
    targets=("$@")
    if [ ${#targets[@]} -eq 0 ]; then
        mapfile -t targets < <(all_targets)
    fi
    bins=()
    for t in "${targets[@]}"; do bins+=(--bin "$t"); done
    echo "== fuzz replay: building ${targets[*]}"
    cargo build --quiet "${bins[@]}"
    status=0
    summary=()
    for t in "${targets[@]}"; do
        inputs=()
        for d in "seeds/$t" "corpus/$t"; do
            [ -d "$d" ] && mapfile -t -O ${#inputs[@]} inputs < <(find "$d" -type f | sort)
        done
        if [ ${#inputs[@]} -eq 0 ]; then
            summary+=("$(printf '%-10s %-7s no inputs' "$t" FAILED)")
            status=1
            continue
        fi
        log=$(mktemp)
        start=$(date +%s.%N)
        if ./target/debug/"$t" "${inputs[@]}" >"$log" 2>&1; then
            result=ok
        else
            result=FAILED
            status=1
            tail -40 "$log"
        fi
        end=$(date +%s.%N)
        rm -f "$log"
        summary+=("$(printf '%-10s %-7s %5d inputs in %6.2f s' "$t" "$result" ${#inputs[@]} \
            "$(echo "$end - $start" | bc)")")
    done
    printf '%s\n' "${summary[@]}"
    exit $status
fi

secs=${1:-30}
shift || true

if ! cargo fuzz --version >/dev/null 2>&1; then
    cargo install cargo-fuzz --locked
fi
if rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
    fuzz=(cargo +nightly fuzz)
    san=()
else
    export RUSTC_BOOTSTRAP=1
    fuzz=(cargo fuzz)
    san=(--sanitizer none)
fi

targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    mapfile -t targets < <("${fuzz[@]}" list)
fi

status=0
summary=()
for t in "${targets[@]}"; do
    mkdir -p "corpus/$t"
    log=$(mktemp)
    echo "== fuzz $t for ${secs}s"
    seeds=()
    [ -d "seeds/$t" ] && seeds=("seeds/$t")
    if "${fuzz[@]}" run "${san[@]}" "$t" "corpus/$t" "${seeds[@]}" -- \
        -max_total_time="$secs" -rss_limit_mb=2048 -print_final_stats=1 >"$log" 2>&1; then
        result=ok
    else
        result=FAILED
        status=1
        tail -40 "$log"
    fi
    execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo '?')
    rate=$(grep -o 'stat::average_exec_per_sec: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo '?')
    summary+=("$(printf '%-10s %-7s %12s executions %8s/s' "$t" "$result" "$execs" "$rate")")
    rm -f "$log"
done
printf '%s\n' "${summary[@]}"
exit $status
