#!/usr/bin/env bash
# CPU per MiB of softrdma's RDMA Write and of the TCP baseline in the SAME
# call (`softrdma perf write -s 1M -n MIB --baseline tcp`), from one
# `perf record -g` of the whole process split at the start of the TCP
# baseline's reading thread (the last plain `softrdma` thread to start):
# before it the softrdma phase, from it the TCP phase. Optionally with CPU
# hogs as in `bench/ab-bins.sh` (`AB_HOG_CPUS`, `--load N`).
#
#   bench/phase-cpu.sh BIN [RUNS] [--load N] [--mib MIB] [--keep DIR]
#
# Prints per run: µs of CPU per MiB of each phase (samples at 8 kHz ×
# 125 µs / MiB) and of each thread in it (softrdma: `poster`, `dm0_tx`
# the engine thread that transmits, `rx` the thread that receives, other
# engine threads by name; TCP: `writer`, `reader`; in parentheses the
# share of the thread's samples taken on the hog's CPU, the first of
# `AB_HOG_CPUS`, else 0), each phase's share of one CPU, the call's MB/s
# and ratio;
# then the medians, and per symbol the µs per MiB of both phases and their
# difference, summed over the runs that split (the costs softrdma has
# beyond the TCP baseline's, largest first; `--top N` lines [25]).
# Needs `perf` (run as root). `--keep DIR` keeps the recordings there.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
runs=5
load=0
mib=2000
top=25
keep=
bin=
pos=0
while [ $# -gt 0 ]; do
    case $1 in
    --load) load=$2; shift 2 ;;
    --mib) mib=$2; shift 2 ;;
    --top) top=$2; shift 2 ;;
    --keep) keep=$2; shift 2 ;;
    *)
        if [ $pos -eq 0 ]; then bin=$1; else runs=$1; fi
        pos=$((pos + 1)); shift ;;
    esac
done
[ -x "$bin" ] || { echo "usage: bench/phase-cpu.sh BIN [RUNS] [--load N] [--mib MIB] [--keep DIR]" >&2; exit 2; }

# shellcheck source=bench/ab-common.sh
. bench/ab-common.sh
start_hogs "$load"
# The CPU of the (first) hog: each thread's share of samples on it is
# printed in parentheses.
read -ra hog_list <<<"${AB_HOG_CPUS:-0}"
hog_cpu=${hog_list[0]}
dir=${keep:-$(mktemp -d)}
mkdir -p "$dir"
trap 'cleanup; [ -n "$keep" ] || rm -rf "$dir"' EXIT

echo "# $(date -u +%FT%TZ) $bin perf write -s 1M -n $mib --baseline tcp, hogs=$load loadavg: $(cat /proc/loadavg)"
: >"$dir/sr.syms"
: >"$dir/tcp.syms"
split=0
for r in $(seq 1 "$runs"); do
    la=$(cut -d' ' -f1 /proc/loadavg)
    out=$(perf record -q -F 8000 -g --sample-cpu -o "$dir/r$r.data" "$bin" perf write -s 1M -n "$mib" --baseline tcp --json 2>/dev/null | tail -1) || out=
    # First and last sample of every thread: "comm tid first last".
    perf script -i "$dir/r$r.data" -F comm,tid,time 2>/dev/null |
        awk '{k = $1 " " $2; t = $3 + 0; if (!(k in a)) a[k] = t; b[k] = t}
             END {for (k in a) printf "%s %.6f %.6f\n", k, a[k], b[k]}' | sort -k3 -g >"$dir/r$r.tids"
    start=$(head -1 "$dir/r$r.tids" | awk '{print $3}')
    end=$(awk 'BEGIN {m = 0} $4 > m {m = $4} END {printf "%.6f", m}' "$dir/r$r.tids")
    # The TCP phase starts with the last plain `softrdma` thread to start,
    # if it started after the engine thread's last sample.
    cut=$(awk '$1 == "softrdma" {t = $3} END {print t}' "$dir/r$r.tids")
    dm_end=$(awk '$1 == "softrdma-dm0" {print $4}' "$dir/r$r.tids")
    line="run $r load=$la mb_s=$(field "$out" mb_s) tcp_mb_s=$(field "$out" tcp_mb_s) ratio=$(field "$out" ratio) cpu_us=$(field "$out" cpu_us_per_msg)"
    if [ -z "$cut" ] || [ -z "$dm_end" ] || awk -v c="$cut" -v d="$dm_end" 'BEGIN {exit !(c < d)}'; then
        echo "$line (not split)"
        continue
    fi
    split=$((split + 1))
    # Samples as "tid symbol"; the threads' roles: in the softrdma phase
    # the main thread posts, `softrdma-dm0` transmits, the other plain
    # thread receives (its CQ wait); in the TCP phase the main thread
    # writes and the last one started reads.
    main=$(head -1 "$dir/r$r.tids" | awk '{print $2}')
    reader=$(awk '$1 == "softrdma" {t = $2} END {print t}' "$dir/r$r.tids")
    # "tid [cpu] ip symbol" -> "tid cpu symbol"
    perf script -i "$dir/r$r.data" --time "$start,$cut" -F tid,cpu,ip,sym -G 2>/dev/null |
        awk 'NF >= 4 {gsub(/[][]/, "", $2); print $1, $2 + 0, $4}' >"$dir/a.ts"
    perf script -i "$dir/r$r.data" --time "$cut,$end" -F tid,cpu,ip,sym -G 2>/dev/null |
        awk 'NF >= 4 {gsub(/[][]/, "", $2); print $1, $2 + 0, $4}' >"$dir/b.ts"
    awk '{print $3}' "$dir/a.ts" >"$dir/a.syms"
    awk '{print $3}' "$dir/b.ts" >"$dir/b.syms"
    roles=$(awk -v m="$main" -v rd="$reader" -v n="$mib" -v hc="$hog_cpu" '
        FNR == 1 {f++}
        f == 1 {name[$2] = $1; next}
        f == 2 {a[$1]++; if ($2 == hc) ah[$1]++; next}
        {b[$1]++; if ($2 == hc) bh[$1]++}
        END {
            for (t in a) {
                if (t == m) role = "poster"
                else if (name[t] == "softrdma-dm0") role = "dm0_tx"
                else if (name[t] ~ /^softrdma-/) role = substr(name[t], 10)
                else role = "rx"
                sr[role] += a[t]
                srh[role] += ah[t]
            }
            for (t in b) {
                role = "other"
                if (t == m) role = "writer"
                if (t == rd) role = "reader"
                tc[role] += b[t]
                tch[role] += bh[t]
            }
            for (k in sr) printf " sr_%s=%.0f(%d%%)", k, sr[k] * 125 / n, 100 * srh[k] / sr[k]
            for (k in tc) printf " tcp_%s=%.0f(%d%%)", k, tc[k] * 125 / n, 100 * tch[k] / tc[k]
        }' "$dir/r$r.tids" "$dir/a.ts" "$dir/b.ts")
    cat "$dir/a.syms" >>"$dir/sr.syms"
    cat "$dir/b.syms" >>"$dir/tcp.syms"
    a=$(wc -l <"$dir/a.syms")
    b=$(wc -l <"$dir/b.syms")
    awk -v l="$line" -v roles="$roles" -v a="$a" -v b="$b" -v n="$mib" -v s="$start" -v c="$cut" -v e="$end" 'BEGIN {
        printf "%s sr_us_per_mib=%.1f tcp_us_per_mib=%.1f sr_cpu_share=%.2f tcp_cpu_share=%.2f\n  µs per MiB by thread:%s\n",
            l, a * 125 / n, b * 125 / n, a / 8000 / (c - s), b / 8000 / (e - c), roles }' | tee -a "$results"
done

median() {
    sort -g | awk '{v[NR]=$1} END {if (NR==0) print ""; else if (NR%2) print v[(NR+1)/2]; else print (v[NR/2]+v[NR/2+1])/2}'
}
col() { # key
    tr ' ' '\n' <"$results" | sed -n "s|^$1=\(.\+\)$|\1|p" | median
}
echo "# $split of $runs runs split; medians: sr_us_per_mib=$(col sr_us_per_mib) tcp_us_per_mib=$(col tcp_us_per_mib) sr_cpu_share=$(col sr_cpu_share) tcp_cpu_share=$(col tcp_cpu_share) ratio=$(col ratio)"
[ "$split" -gt 0 ] || exit 0
echo "# µs per MiB by symbol over the split runs: softrdma phase, TCP phase, difference"
join -a1 -a2 -e0 -o 0,1.2,2.2 \
    <(sort "$dir/sr.syms" | uniq -c | awk '{print $2, $1}' | sort) \
    <(sort "$dir/tcp.syms" | uniq -c | awk '{print $2, $1}' | sort) |
    awk -v n="$((mib * split))" '{printf "%-60s %8.1f %8.1f %8.1f\n", $1, $2 * 125 / n, $3 * 125 / n, ($2 - $3) * 125 / n}' |
    sort -k4 -g -r | head -"$top"
