#!/usr/bin/env bash
# STYLE: no C function in src/ over 200 lines (kernels in .cu aside) and no source file over 800
# lines (issue 24's "Must show"; the project's standard). A function runs from its signature's
# first line (column 0, an identifier and "(", not a declaration ending in ";", not a typedef,
# struct, enum, union or initializer) to the next "}" at column 0. Also the layering: no file in
# src/bounded/ includes a model/ header, none in src/plan/ a train/ header. Prints each offender with its length and exits 1 when there is one.
#   bash tests/src_limits.sh [ROOT]
ROOT=${1:-$(cd "$(dirname "$0")/.." && pwd)}
cd "$ROOT" || exit 2
bad=0
while IFS= read -r f; do
    out=$(awk -v F="$f" -v LIM="${LIM:-200}" '
        !infn && /^[A-Za-z_]/ && /\(/ && !/;[[:space:]]*$/ && !/^(typedef|struct|enum|union)/ && !/= *\{/ { sig = NR; name = $0 }
        !infn && sig && /\{[[:space:]]*$/ && !/= *\{/ { infn = 1; start = sig }
        infn && /^}/ { len = NR - start + 1; if (len > LIM) printf "%s:%d: function of %d lines: %s\n", F, start, len, name; infn = 0; sig = 0 }
    ' "$f")
    [ -n "$out" ] && { echo "$out"; bad=1; }
    n=$(wc -l < "$f")
    [ "$n" -gt 800 ] && { echo "$f: $n lines (over 800: split it by purpose)"; bad=1; }
done < <(find src -name '*.c' -o -name '*.h' | sort)
# the layering DESIGN.md draws: the bounded operators know no model, the planner no trainer
for pair in "bounded model" "plan train"; do
    set -- $pair
    hits=$(grep -ln -E "#include \"(\.\./)?$2/" src/$1/* 2>/dev/null)
    [ -n "$hits" ] && { echo "src/$1 includes a $2/ header (layering): $hits"; bad=1; }
done
[ $bad -eq 0 ] && echo "src_limits: every function in src/ within 200 lines, every file within 800; bounded/ includes no model/ header, plan/ no train/ header"
exit $bad
