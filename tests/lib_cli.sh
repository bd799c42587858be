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

# check_memory NAME LOG: every arena of a --report-memory log has its high-water mark within 64
# bytes under its planned bound (at least 6 memory lines).
check_memory() {
    local n=0
    while read -r set bound hw; do
        n=$((n + 1))
        [ "$hw" -le "$bound" ] && [ $(( hw + 64 )) -ge "$bound" ] && ok || bad "$1: $set high-water $hw vs bound $bound"
    done < <(grep "^memory:" "$2" | grep -v "live set\|attention\|device in use" | sed -E 's/^memory: +(.*[a-z)]) +([0-9]+) +([0-9]+) .*/\1|\2|\3/' | \
             awk -F'|' '{gsub(/ /, "_", $1); print $1, $2, $3}')
    [ $n -ge 6 ] && ok || bad "$1: found $n memory lines"
}

# plan_same NAME LOG CONFIG FLAGS...: the bounds `flatmoe plan` prints for CONFIG at --seq-len 64
# --micro-batch 2 --threads 2 and FLAGS are those of the train run whose --report-memory log is LOG.
plan_same() {
    local name=$1 log=$2 cfg=$3; shift 3
    "$FM" plan --config "$cfg" --seq-len 64 --micro-batch 2 --threads 2 "$@" > "$TMP/$name.plan" 2>&1 || bad "$name: plan failed"
    python3 - "$log" "$TMP/$name.plan" <<'PY' && ok || bad "$name: flatmoe plan's bounds are not the train run's"
import re, sys
train = {m[1].strip(): int(m[2]) for m in re.finditer(r"^memory: +(.*?) +(\d+) +\d+ ", open(sys.argv[1]).read(), re.M)}
plan = {m[1].strip(): int(m[2]) for m in re.finditer(r"^([a-z][a-z ]+?) +(\d+) +[\d.]+ ", open(sys.argv[2]).read(), re.M)}
sets = ["model state", "checkpoint boundaries", "layer activations", "expert dispatch", "layer working set", "vocabulary projection"]
bad = [s for s in sets if train.get(s) is None or train.get(s) != plan.get(s)]
print("plan vs train bounds:", {s: (plan.get(s), train.get(s)) for s in sets})
sys.exit(1 if bad else 0)
PY
}

finish() {
    echo "$PASSED passed, $FAILED failed"
    [ $FAILED -eq 0 ]
}
