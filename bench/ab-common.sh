# Shared by bench/ab-perf.sh and bench/ab-bins.sh (sourced, not run):
# a temporary results file, CPU hogs ended by PID on exit, JSON fields.
#
#   start_hogs N    keeps N CPUs busy with `bash -c 'while :; do :; done'`,
#                   hog i pinned to the i-th CPU of $AB_HOG_CPUS (e.g. "1")
#                   or to CPU i mod nproc; each also ends after an hour.
#   field JSON KEY  a number from a one-line JSON object.

hogs=()
results=$(mktemp)
cleanup() {
    for p in "${hogs[@]}"; do kill "$p" 2>/dev/null || true; done
    rm -f "$results"
}
trap cleanup EXIT

start_hogs() { # N
    local ncpu i cpu hog_cpus
    ncpu=$(nproc)
    read -ra hog_cpus <<<"${AB_HOG_CPUS:-}"
    for i in $(seq 0 $(($1 - 1))); do
        cpu=${hog_cpus[$i]:-$((i % ncpu))}
        taskset -c "$cpu" timeout 3600 bash -c 'while :; do :; done' &
        hogs+=($!)
    done
}

field() { # json key
    sed -n "s/.*\"$2\":\([0-9.e+-]*\).*/\1/p" <<<"$1"
}
