#!/usr/bin/env bash
# Runs the cargo-fuzz targets of fuzz/ (block_manager, scheduler).
#
#   scripts/fuzz.sh ci            replay fuzz/regressions/<target>/*, then fuzz each target for
#                                 FUZZ_SECONDS (default 30); exits non-zero on any crash (make test-fuzz)
#   scripts/fuzz.sh long [TARGET] start a background run of each target (or one) for FUZZ_HOURS
#                                 (default 8) at nice 19, one process per target, logging to
#                                 FUZZ_LOG_DIR/<target>.log (default fuzz/logs); corpus in
#                                 fuzz/corpus/<target>, crash inputs in fuzz/artifacts/<target>
#   scripts/fuzz.sh status        progress of the long runs: start, last status line, crash inputs
#
# The stable toolchain is enough: RUSTC_BOOTSTRAP=1 lets it accept the nightly-only flags
# cargo-fuzz passes. cargo-fuzz is installed from crates.io when missing. The targets are built
# without a sanitizer (the code under test has no unsafe; ASan would halve the executions) and with
# debug assertions and overflow checks on.
set -euo pipefail
cd "$(dirname "$0")/.."

TARGETS=(block_manager scheduler)
export RUSTC_BOOTSTRAP=1
FLAGS=(--sanitizer none --debug-assertions)
# Per-input limits: a slow or memory-hungry input is a finding too.
LIBFUZZER=(-timeout=10 -rss_limit_mb=2048 -max_len=4096)

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "installing cargo-fuzz" >&2
    cargo install cargo-fuzz --locked
fi

case "${1:-}" in
ci)
    cargo fuzz build "${FLAGS[@]}"
    for target in "${TARGETS[@]}"; do
        regressions=(fuzz/regressions/"$target"/*)
        if [ -e "${regressions[0]}" ]; then
            echo "== $target: replaying ${#regressions[@]} regression input(s)"
            cargo fuzz run "${FLAGS[@]}" "$target" "${regressions[@]}" -- -runs=1 "${LIBFUZZER[@]}"
        fi
        echo "== $target: fuzzing for ${FUZZ_SECONDS:-30} s"
        cargo fuzz run "${FLAGS[@]}" "$target" -- \
            -max_total_time="${FUZZ_SECONDS:-30}" -print_final_stats=1 "${LIBFUZZER[@]}" 2>&1 \
            | grep -Ev '^(#[0-9]+[[:space:]]+(NEW|REDUCE)[[:space:]]|"|###### )'
    done
    ;;
long)
    log_dir="${FUZZ_LOG_DIR:-fuzz/logs}"
    mkdir -p "$log_dir"
    cargo fuzz build "${FLAGS[@]}"
    for target in ${2:-"${TARGETS[@]}"}; do
        log="$log_dir/$target.log"
        echo "started $(date -u +%FT%TZ), ${FUZZ_HOURS:-8} h" >"$log"
        nohup nice -n 19 cargo fuzz run "${FLAGS[@]}" "$target" -- \
            -max_total_time="$(( ${FUZZ_HOURS:-8} * 3600 ))" -print_final_stats=1 "${LIBFUZZER[@]}" \
            >>"$log" 2>&1 </dev/null &
        echo "$target: pid $!, log $log"
    done
    ;;
status)
    log_dir="${FUZZ_LOG_DIR:-fuzz/logs}"
    echo "now $(date -u +%FT%TZ)"
    for target in "${TARGETS[@]}"; do
        log="$log_dir/$target.log"
        [ -e "$log" ] || continue
        echo "== $target ($(pgrep -f "release/$target " >/dev/null && echo running || echo stopped))"
        head -n 1 "$log"
        grep -a -E '^#[0-9]+' "$log" | tail -n 1
        grep -a -E 'panicked|SUMMARY|Test unit written' "$log" || true
        ls fuzz/artifacts/"$target" 2>/dev/null || true
    done
    ;;
*)
    sed -n '2,15p' "$0" >&2
    exit 2
    ;;
esac
