#!/usr/bin/env bash
# `flatmoe plan --library` (a libflatmoe session's plan; docs/rl.md "Memory of a session"):
#  - its "library_host_bytes" equals a transcription of src/capi/flatmoe_host.c's pieces (each
#    rounded up to 64 bytes) for tests/data/micro.json at 2 x 64 tokens, without and with
#    --logprobs-topk 4 and --kv-cache; "library_kv_bytes" is the cache's share (0 without);
#    test_capi_kv checks that a session's host arena is exactly what the same function
#    (fm_capi_host_bytes) gives, so plan and session agree through it;
#  - the vocabulary set holds the RL head's buffers: larger than train's plan with the same blocks;
#  - plan without --library refuses --kv-cache and --logprobs-topk naming --library; train refuses
#    --library (a plan-only flag); the text report prints the host line and no launch line, and its
#    flatmoe_open flags carry --logprobs-topk and --kv-cache when given (the buffers the bounds count).
source "$(dirname "$0")/lib_cli.sh"
CFG="$ROOT/tests/data/micro.json"
P=(plan --config "$CFG" --seq-len 64 --micro-batch 2 --ce-block-tokens 32 --ce-block-vocab 64)
for extra in "" "--logprobs-topk 4" "--kv-cache" "--logprobs-topk 4 --kv-cache"; do
    "$FM" "${P[@]}" --library $extra --json > "$TMP/p.json" 2>/dev/null || { bad "plan --library $extra failed"; continue; }
    python3 - "$CFG" "$TMP/p.json" $extra <<'PY' && ok || bad "plan --library $extra: library bytes"
import json, sys
cfg, plan = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
args = sys.argv[3:]
topk = int(args[args.index("--logprobs-topk") + 1]) if "--logprobs-topk" in args else 0
kv = "--kv-cache" in args
r = lambda b: (b + 63) // 64 * 64
N, V, L, H = 2 * 64, cfg["vocab_size"], cfg["num_hidden_layers"], cfg["hidden_size"]
nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
hd, E, k, I = H // nh, cfg["num_experts"], cfg["num_experts_per_tok"], cfg["intermediate_size"]
# the batch (tokens, targets, pos, doc_start: int32), pos_of (int64), seq_of (int32), in_loss (u8),
# tok_loss, tok_ent, logp, ent (f32), coef (f64), seq_count (i64), weight (f32), ent_coef (f64),
# ent_weight (f32); routes [L_moe k N] int32; top-k lp f32, id i32 [K N]; sampling: tok (i32),
# lens, start (i64) [N], row, probs (f32), order (i32) [V]
per_token = [4, 4, 4, 4, 8, 4, 1, 4, 4, 4, 4, 8, 8, 4, 8, 4]
want = sum(r(b * N) for b in per_token) + r(4 * L * k * N)
if topk: want += 2 * r(4 * topk * N)
want += r(4 * N) + 2 * r(8 * N) + 3 * r(4 * V)
kvb = 0
if kv:  # K, V [L N nkv hd]; x, ln, o [N H]; q, att [N nh hd]; k, v [N nkv hd]; rlog, probs [N E]; rstd [N nh];
        # pos (i32) [N]; slot, first (i64) [N]; hid [3 I + H]; topk_idx (i32), topk_w [N k]; lse [N]
    f = [L * N * nkv * hd] * 2 + [N * H] * 3 + [N * nh * hd] * 2 + [N * nkv * hd] * 2 + [N * E] * 2 + [N * nh, N]
    kvb = sum(r(4 * x) for x in f) + 2 * r(8 * N) + r(4 * (3 * I + H)) + 2 * r(4 * N * k) + r(4 * N)
    want += kvb
got = (plan.get("library_host_bytes"), plan.get("library_kv_bytes"))
print(f"plan --library {' '.join(args)}: library_host_bytes {got[0]} (transcription {want}), kv {got[1]} ({kvb})")
sys.exit(0 if got == (want, kvb) else 1)
PY
done
vt=$("$FM" "${P[@]}" --json 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["live_sets"]["vocabulary projection"])')
vl=$("$FM" "${P[@]}" --library --json 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["live_sets"]["vocabulary projection"])')
[ -n "$vt" ] && [ -n "$vl" ] && [ "$vl" -gt "$vt" ] && ok || bad "the RL head's vocabulary set: --library $vl vs train's $vt"
out=$("$FM" "${P[@]}" --library --kv-cache 2>&1)
grep -q "^library host scratch: .* of it the KV cache" <<<"$out" && ok || bad "no library host line: $out"
grep -q "^flatmoe_open flags: " <<<"$out" && ! grep -q "^launch:" <<<"$out" && ok || bad "session flags / launch line: $out"
# the session's own options are in its flags line (the bounds above count their buffers): copied, they open it
out=$("$FM" "${P[@]}" --library --logprobs-topk 4 --kv-cache 2>&1)
grep -q "^flatmoe_open flags: .* --logprobs-topk 4 --kv-cache$" <<<"$out" && ok || bad "--logprobs-topk/--kv-cache not in the flags: $out"
expect_fail "plan --kv-cache without --library" "flatmoe plan --library" "$FM" "${P[@]}" --kv-cache
expect_fail "plan --logprobs-topk without --library" "flatmoe plan --library" "$FM" "${P[@]}" --logprobs-topk 2
expect_fail "train --library" "--library" "$FM" train --config "$CFG" --data "$TEXT" --steps 1 --library --out "$TMP/t"
echo "cli_plan_library: $PASSED passed, $FAILED failed"
[ $FAILED -eq 0 ]
