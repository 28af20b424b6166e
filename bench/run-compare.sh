#!/usr/bin/env bash
# What programs started by two `softrdma` builds' `run` see, case by case:
# stdout (the program's environment, arguments, signal mask and ignored
# signals where the case prints them), stderr and exit status of each
# build, compared. Usage, help and error cases are among them.
#
#   bench/run-compare.sh A/softrdma B/softrdma
#
# Every case runs in the same small environment (one value not UTF-8,
# LD_PRELOAD and LD_LIBRARY_PATH already set) with stand-in libraries in a
# temporary directory ($SOFTRDMA_LIB_DIR), so both builds name the same
# paths. Prints the cases that differ and "N cases, M differ".
set -uo pipefail
A=$1 B=$2
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
mkdir "$T/libs" "$T/nolibs"
for f in libsoftrdma_verbs.so libsoftrdma_dapl.so libsoftrdma_preload.so; do
	echo stand-in >"$T/libs/$f"
done
run() { # BIN ARGS...: status, stdout (NULs as newlines), stderr
	local bin=$1
	shift
	env -i HOME=/h PATH=/usr/bin:/bin ODD=$'a\xffb' LD_PRELOAD=/x.so LD_LIBRARY_PATH=/o \
		SOFTRDMA_LIB_DIR="$T/libs" SOFTRDMA_IA_ADDR=192.0.2.1 \
		"$bin" run "$@" >"$T/out" 2>"$T/err"
	echo "status $?"
	tr '\0' '\n' <"$T/out"
	echo ---
	# The loader's complaint about the stand-in preload library.
	grep -v '^ERROR: ld.so' "$T/err" | sed 's/(\([0-9]*\)) panicked/(TID) panicked/'
}
n=0 d=0
while IFS= read -r line; do
	[ -z "$line" ] && continue
	eval "args=($line)"
	a=$(run "$A" "${args[@]}")
	b=$(run "$B" "${args[@]}")
	n=$((n + 1))
	if [ "$a" != "$b" ]; then
		d=$((d + 1))
		echo "DIFFERS: softrdma run $line"
		diff <(echo "$a") <(echo "$b") | head -20
	fi
done <<CASES
--no-verbs --no-dat --sockets -- /usr/bin/env -0
--sockets -- /usr/bin/env -0
--sockets --sockets-policy tcp -- env -0
--sockets --sockets-policy=offload env -0
-- env -0
env -0
--verbs --dat -- env -0
--no-verbs -- env -0
--no-dat -- sh -c 'printf "%s|" "\$0" "\$@"' a 'b c' '' --verbs
--ia-addr 10.1.2.3 -- env -0
--ia-addr=10.1.2.3 env -0
--lib-dir $T/libs -- env -0
--lib-dir=$T/libs --sockets env -0
--lib-dir $T/nolibs -- env -0
--lib-dir $T/nolibs --sockets -- env -0
--lib-dir $T/nolibs --verbs -- env -0
--lib-dir /nonexistent -- true
--print-env
--sockets --print-env
--print-env --no-dat env
--
--sockets
--help
-h
--version
--verbs --no-verbs -- true
--dat --no-dat true
--verbs --verbs true
--sockets-policy tcp -- true
--sockets --sockets-policy bogus -- true
--sockets --sockets-policy tcp --sockets-policy tcp true
--lib-dir
--lib-dir -- true
--lib-dir= true
--ia-addr 300.1.1.1 true
--ia-addr ::1 true
--verbs=1 true
--bogus true
--sock true
-x true
- true
-- /nonexistent/prog
-- /etc/passwd
/nonexistent/prog
-- sh -c 'exit 7'
-- printf %s \$'a\\xffb'
-- -- printf x
--no-verbs --no-dat --sockets -- sh -c 'grep -E "^Sig(Blk|Ign)" /proc/self/status; trap -p'
CASES
echo "$n cases, $d differ"
