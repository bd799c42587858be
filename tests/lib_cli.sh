# Shared helpers for the CLI tests (sourced). $1 of the test is the flatmoe binary.
FM=${1:?usage: $0 path/to/flatmoe}
FM=$(readlink -f "$FM")
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TMP=$(mktemp -d /tmp/flatmoe-test.XXXXXX)
trap 'rm -rf "$TMP"' EXIT
PASSED=0
FAILED=0
# Real English text: the shared Shakespeare, else Debian's fortunes, else this repo's README.
TEXT="$ROOT/../shared/data/tinyshakespeare.txt"
[ -f "$TEXT" ] || TEXT=/usr/share/games/fortunes/fortunes
[ -f "$TEXT" ] || TEXT="$ROOT/README.md"

ok() { PASSED=$((PASSED + 1)); }
bad() { FAILED=$((FAILED + 1)); echo "FAIL: $*" >&2; }

# expect_fail NAME NEEDLE CMD...: CMD must exit non-zero and print NEEDLE on stderr.
expect_fail() {
    local name=$1 needle=$2; shift 2
    local out rc
    out=$("$@" 2>&1 >/dev/null); rc=$?
    if [ $rc -eq 0 ]; then bad "$name: exited 0"; return; fi
    if ! grep -qF -- "$needle" <<<"$out"; then bad "$name: message lacks '$needle': $out"; return; fi
    echo "ok  $name (exit $rc): $(head -c 300 <<<"$out" | head -1)"
    ok
}

finish() {
    echo "$PASSED passed, $FAILED failed"
    [ $FAILED -eq 0 ]
}
