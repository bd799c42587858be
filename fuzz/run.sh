#!/usr/bin/env bash
# Runs the libFuzzer harnesses of fuzz/ (docs/testing.md): bash fuzz/run.sh TARGET|all SECONDS
# TARGET is a harness's name without "fuzz_" (chat, config, data, pack, prepare, rlbatch, safetensors,
# state, tokenizer) or "all" (each in turn, SECONDS each). Builds them first into build-fuzz/ (clang,
# -DFLATMOE_FUZZ=ON: libFuzzer, AddressSanitizer with LeakSanitizer, UBSan). Each run starts from
# the seeds of fuzz/corpus/TARGET (read only) and a scratch corpus in $FUZZ_WORK (default
# build-fuzz/fuzz-work/TARGET), where a finding's input is kept too (crash-*, leak-*, timeout-*,
# oom-*). An input running past FUZZ_TIMEOUT s (default 10; wall time, so raise it on a machine
# loaded enough to starve a process) is a hang; past 2 GiB of memory an out-of-memory; an
# allocation past 1 GiB returns NULL, so the parsers' out-of-memory paths run (a refusal, not a
# finding). Prints one line per target (executions, seconds, findings) and exits non-zero when
# any target had a finding. Extra libFuzzer flags: FUZZ_FLAGS="-jobs=2 ...".
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -eq 2 ] || { echo "usage: bash fuzz/run.sh TARGET|all SECONDS" >&2; exit 2; }
what=$1 secs=$2
all=$(ls fuzz/fuzz_*.c | sed 's|fuzz/fuzz_||; s|\.c$||')
if [ "$what" = all ]; then targets=$all
elif grep -qx "$what" <<<"$all"; then targets=$what
else echo "fuzz/run.sh: no target '$what'; expected all or one of: $(echo $all)" >&2; exit 2; fi
CC=${FUZZ_CC:-$(command -v clang || command -v clang-14 || true)}
[ -n "$CC" ] || { echo "fuzz/run.sh: clang not found (apt-get install clang libclang-rt-dev libomp-dev)" >&2; exit 2; }
if [ ! -f build-fuzz/CMakeCache.txt ]; then
    cmake -S . -B build-fuzz -DCMAKE_C_COMPILER="$CC" -DCMAKE_BUILD_TYPE=Release -DFLATMOE_MPI=OFF -DFLATMOE_FUZZ=ON >/dev/null
fi
cmake --build build-fuzz -j"$(nproc)" --target fuzz_targets >/dev/null
work=${FUZZ_WORK:-build-fuzz/fuzz-work}
export ASAN_OPTIONS=${ASAN_OPTIONS:-allocator_may_return_null=1:max_allocation_size_mb=1024:detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
rc=0
for t in $targets; do
    dir=$work/$t
    mkdir -p "$dir/corpus" "$dir/findings"
    log=$dir/run.log
    set +e
    "build-fuzz/fuzz_$t" -max_total_time="$secs" -timeout="${FUZZ_TIMEOUT:-10}" -rss_limit_mb=2048 -print_final_stats=1 \
        -artifact_prefix="$dir/findings/" ${FUZZ_FLAGS:-} "$dir/corpus" "fuzz/corpus/$t" >"$log" 2>&1
    status=$?
    set -e
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    secs_run=$(sed -n 's/^stat::\(average_exec_per_sec\): *//p' "$log" | tail -1)
    findings=$(ls "$dir/findings" | grep -Ec '^(crash|leak|timeout|oom)-' || true)
    reports=$(grep -Ec 'ERROR: (AddressSanitizer|LeakSanitizer|libFuzzer)|runtime error:' "$log" || true)
    printf '%-12s %12s executions (%s/s) in %s s, corpus %s files, findings %s, sanitizer reports %s, exit %s\n' \
        "$t" "${execs:-?}" "${secs_run:-?}" "$secs" "$(ls "$dir/corpus" | wc -l)" "$findings" "$reports" "$status"
    if [ "$status" -ne 0 ] || [ "$findings" -ne 0 ] || [ "$reports" -ne 0 ]; then
        rc=1
        echo "  $t: see $log and $dir/findings/" >&2
        grep -m3 -E 'ERROR|runtime error|fuzz:' "$log" | sed 's/^/  /' >&2 || true
    fi
done
exit $rc
