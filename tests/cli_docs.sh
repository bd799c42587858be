#!/usr/bin/env bash
# docs/cli.md is generated from the binary's help (tools/gen_cli_md.sh): regenerate it into a
# temporary file with the flatmoe under test and fail, with the fix, when the committed file
# differs (a flag added, renamed or re-described without regenerating). Also checks the generator
# itself: every command gets a section of its own, and a stale file or a failing --help is caught.
source "$(dirname "$0")/lib_cli.sh"
GEN="$ROOT/tools/gen_cli_md.sh"
DOC="$ROOT/docs/cli.md"
COMMANDS=(train sample eval plan calibrate report prepare)

bash "$GEN" "$FM" "$TMP/cli.md" > "$TMP/gen.log" 2>&1 && ok || bad "tools/gen_cli_md.sh failed: $(cat "$TMP/gen.log")"
# every command's --help is in the generated file, verbatim, under its own heading
for c in "${COMMANDS[@]}"; do
    grep -qx "## flatmoe $c" "$TMP/cli.md" && ok || bad "generated cli.md has no section for '$c'"
    "$FM" "$c" --help > "$TMP/help-$c.txt" 2>&1 || bad "flatmoe $c --help exited non-zero"
    [ -s "$TMP/help-$c.txt" ] || bad "flatmoe $c --help printed nothing"
    awk -v h="## flatmoe $c" '$0 == h { on = 1; next } on && /^```text$/ { inb = 1; next } inb && /^```$/ { exit } inb' \
        "$TMP/cli.md" > "$TMP/sec-$c.txt"
    cmp -s "$TMP/help-$c.txt" "$TMP/sec-$c.txt" && ok || bad "the '$c' section is not that command's --help"
done
grep -q "GENERATED FILE" "$TMP/cli.md" && grep -q "tools/gen_cli_md.sh" "$TMP/cli.md" && ok \
    || bad "generated cli.md lacks the header saying it is generated and by what"

# the committed docs/cli.md is what the generator makes from this binary
current() { [ -f "$1" ] && cmp -s "$1" "$TMP/cli.md"; }
if [ ! -f "$DOC" ]; then
    bad "docs/cli.md is missing: run 'bash tools/gen_cli_md.sh' (or: bash tools/gen_cli_md.sh $FM docs/cli.md) and commit it"
elif current "$DOC"; then
    ok; echo "ok  docs/cli.md matches the help of $FM"
else
    bad "docs/cli.md is stale (it differs from the help of $FM): run 'bash tools/gen_cli_md.sh' and commit docs/cli.md; the difference:"
    diff -u "$DOC" "$TMP/cli.md" | head -40 >&2
fi

# the check above can fail: a copy with one flag renamed is stale, and a binary whose --help
# fails stops the generator without leaving a file
sed '0,/^  --/s/^  --/  --renamed-/' "$TMP/cli.md" > "$TMP/stale.md"
current "$TMP/stale.md" && bad "a docs/cli.md with a renamed flag passed as current" || ok
printf '#!/bin/sh\n[ "$1" = plan ] && exit 3\necho "usage: $*"\n' > "$TMP/broken-fm"; chmod +x "$TMP/broken-fm"
if bash "$GEN" "$TMP/broken-fm" "$TMP/broken.md" > /dev/null 2> "$TMP/broken.log"; then
    bad "the generator accepted a binary whose 'plan --help' fails"
else
    grep -q "flatmoe plan --help" "$TMP/broken.log" && ok || bad "the generator's error does not name the command: $(cat "$TMP/broken.log")"
    [ ! -e "$TMP/broken.md" ] && ok || bad "a failed generation left an output file"
fi
finish
