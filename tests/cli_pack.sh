#!/usr/bin/env bash
# Document-aware batches end to end (issue 28): `prepare` writes a document index (.docs) beside
# each shard; `train --pack on` fills rows with whole documents, counts --epochs' steps, shows the
# epoch on the step line and in metrics.jsonl; a run stopped mid-epoch and resumed gives the same
# weights, bit for bit, as a straight run; pad mode; the refusals (no index, a document longer
# than a row under --pack-long refuse, --sp with packing).
source "$(dirname "$0")/lib_cli.sh"
TOK=${FM_TOKDIR:-$ROOT/tests/data/tok}

# 40 documents of 3 to 120 words (seeded), as JSONL text records
python3 - "$TMP/d.jsonl" <<'PY'
import json, random, sys
r = random.Random(7)
words = "the of and to a in that is was he for it with as his on be at by had".split()
with open(sys.argv[1], "w") as f:
    for i in range(40):
        f.write(json.dumps({"text": " ".join(r.choice(words) for _ in range(r.randint(3, 120)))}) + "\n")
PY
"$FM" prepare --tokenizer "$TOK/olmoe" --input "$TMP/d.jsonl" --out "$TMP/d" > "$TMP/p.log" 2>&1 \
    && ok || bad "prepare failed: $(cat "$TMP/p.log")"
[ -f "$TMP/d_000000.bin.docs" ] && ok || bad "prepare wrote no document index d_000000.bin.docs"
magic=$(head -c 8 "$TMP/d_000000.bin.docs")
read -r ntok_lo ntok_hi ndocs_lo ndocs_hi <<<"$(od -An -t u4 -j 8 -N 16 "$TMP/d_000000.bin.docs")"
read -r _ _ count <<<"$(od -An -t u4 -N 12 "$TMP/d_000000.bin")"
[ "$magic" = FMDOCS01 ] && [ "$ndocs_lo" -eq 40 ] && [ "$ntok_lo" -eq "$count" ] \
    && ok || bad "index header: magic $magic, $ndocs_lo documents (expected 40), $ntok_lo tokens (shard: $count)"

# training data written here (a second writer of both formats): 40 documents of 3 to 120 byte
# tokens (the micro model's vocabulary), an llm.c v7 shard and its FMDOCS01 index
python3 - "$TMP/w" <<'PY'
import random, struct, sys
r = random.Random(7)
docs = [[r.randrange(256) for _ in range(r.randint(3, 120))] for _ in range(40)]
toks = [t for d in docs for t in d]
with open(sys.argv[1] + ".bin", "wb") as f:
    f.write(struct.pack("<256i", 20240801, 7, len(toks), *([0] * 253)))
    f.write(struct.pack("<%dI" % len(toks), *toks))
starts, at = [], 0
for d in docs:
    starts.append(at); at += len(d)
with open(sys.argv[1] + ".docs", "wb") as f:
    f.write(b"FMDOCS01" + struct.pack("<QQ", len(toks), len(starts)) + struct.pack("<%dQ" % len(starts), *starts))
PY
common=(--config "$ROOT/tests/data/micro.json" --data "$TMP/w.bin" --val-fraction 0.2 --seq-len 64 --micro-batch 2
        --grad-accum 2 --warmup 1 --lr 3e-3 --threads 2 --eval-every 100 --eval-batches 1 --save-every 1000
        --pack on)
"$FM" train "${common[@]}" --epochs 2 --out "$TMP/straight" > "$TMP/s.log" 2>&1 && ok || bad "packed run failed: $(tail -5 "$TMP/s.log")"
grep -q -- "--epochs 2: [0-9]* optimizer steps" "$TMP/s.log" && ok || bad "no epoch step count: $(head -20 "$TMP/s.log")"
steps=$(sed -nE 's/.*--epochs 2: ([0-9]+) optimizer steps.*/\1/p' "$TMP/s.log")
grep -q "epoch 1/2" "$TMP/s.log" && grep -q "epoch 2/2" "$TMP/s.log" && ok || bad "the step lines lack the epoch"
grep -q "rows of 64 tokens filled with whole documents" "$TMP/s.log" && ok || bad "no packing line"
grep '"type":"step"' "$TMP/straight/metrics.jsonl" | tail -1 | grep -q '"epoch":2' && ok || bad "metrics.jsonl lacks the epoch"
[ "$(grep -c '"type":"step"' "$TMP/straight/metrics.jsonl")" -eq "$steps" ] && ok || bad "expected $steps step records"
final=$(printf 'step_%06d' "$steps")
grep -Eq '"pack":[[:space:]]*"on"' "$TMP/straight/$final/state.json" && ok || bad "state.json lacks the packer's cursor"

# exact resume mid-epoch: stop after 3 steps, resume, same weights as the straight run
"$FM" train "${common[@]}" --epochs 2 --out "$TMP/split" --exit-after 3 > /dev/null 2>&1 || bad "first half failed"
"$FM" train "${common[@]}" --epochs 2 --out "$TMP/split" --resume > "$TMP/r.log" 2>&1 || bad "resume failed: $(tail -3 "$TMP/r.log")"
for f in model.safetensors optimizer.safetensors; do
    cmp -s "$TMP/straight/$final/$f" "$TMP/split/$final/$f" && ok || bad "$f differs after a resume mid-epoch"
done
# packing is not a no-op: the same data unpacked trains other weights
"$FM" train "${common[@]}" --pack off --steps "$steps" --out "$TMP/off" > /dev/null 2>&1 || bad "--pack off failed"
cmp -s "$TMP/straight/$final/model.safetensors" "$TMP/off/$final/model.safetensors" && bad "--pack on and off gave the same weights" || ok
# pad mode: one document per row
"$FM" train "${common[@]}" --pack pad --epochs 1 --out "$TMP/pad" > "$TMP/pad.log" 2>&1 && ok || bad "--pack pad failed: $(tail -3 "$TMP/pad.log")"

# refusals
expect_fail "pack without an index" "has no document index" "$FM" train --config "$ROOT/tests/data/micro.json" \
    --data "$TEXT" --seq-len 32 --micro-batch 2 --steps 1 --pack on --out "$TMP/x1"
expect_fail "a document longer than a row" "--pack-long refuse: document" "$FM" train "${common[@]}" --seq-len 16 \
    --pack-long refuse --steps 1 --out "$TMP/x2"
expect_fail "pack with sp" "--sp 2" "$FM" train "${common[@]}" --sp 2 --steps 1 --out "$TMP/x3"
finish
