#!/usr/bin/env bash
# Runs every fuzz target for a bounded time (default 30 s each) and prints the
# executions run per target. Usage: fuzz/smoke.sh [SECONDS] [TARGET...]
# Installs cargo-fuzz from crates.io if it is missing. Uses the nightly
# toolchain with AddressSanitizer when one is installed; otherwise the stable
# toolchain without a sanitizer (RUSTC_BOOTSTRAP for libFuzzer's flags).
set -euo pipefail
cd "$(dirname "$0")"
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
    if "${fuzz[@]}" run "${san[@]}" "$t" "corpus/$t" -- \
        -max_total_time="$secs" -rss_limit_mb=2048 -print_final_stats=1 >"$log" 2>&1; then
        result=ok
    else
        result=FAILED
        status=1
        tail -40 "$log"
    fi
    execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo '?')
    summary+=("$(printf '%-12s %-7s %12s executions' "$t" "$result" "$execs")")
    rm -f "$log"
done
printf '%s\n' "${summary[@]}"
exit $status
