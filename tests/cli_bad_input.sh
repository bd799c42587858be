#!/usr/bin/env bash
# Every bad input gets one clear message (naming the input, the expected and found values) and
# a non-zero exit; a NaN stops training and leaves the last good checkpoint untouched.
source "$(dirname "$0")/lib_cli.sh"
cfg="$ROOT/tests/data/micro.json"
base=(--data "$TEXT" --seq-len 16 --micro-batch 2 --steps 2 --threads 2 --quiet)

expect_fail "unknown command" "unknown command" "$FM" fly
expect_fail "unknown command, a typo" "did you mean 'train'" "$FM" trian
expect_fail "unknown flag" "unknown flag '--colour'" "$FM" train --config "$cfg" "${base[@]}" --colour blue --out "$TMP/a"
expect_fail "non-numeric flag" "expects an integer, found 'ten'" "$FM" train --config "$cfg" "${base[@]}" --steps ten --out "$TMP/a"
expect_fail "a given -1 memory flag" "must be >= 0, found -1" "$FM" train --config "$cfg" "${base[@]}" --ce-block-tokens -1 --out "$TMP/a"
expect_fail "byte count beyond 2^64" "beyond what a byte count can hold" "$FM" plan --config "$cfg" --seq-len 16 --device-mem 99999999999999999999
expect_fail "byte count below one byte" "less than one byte" "$FM" plan --config "$cfg" --seq-len 16 --device-mem 0.5
expect_fail "bad FLATMOE_EXPERT_GEMM" "FLATMOE_EXPERT_GEMM=bogus: expected auto, cublas, loop, grouped or sm90" env FLATMOE_EXPERT_GEMM=bogus "$FM" train --config "$cfg" "${base[@]}" --out "$TMP/a"
expect_fail "missing config file" "nope.json: cannot open" "$FM" train --config "$TMP/nope.json" "${base[@]}" --out "$TMP/a"
expect_fail "missing data file" "missing.txt" "$FM" train --config "$cfg" --data "$TMP/missing.txt" --seq-len 16 --out "$TMP/a" --quiet
printf '{"model_type": "olmoe", "hidden_size": 32,,}' > "$TMP/malformed.json"
expect_fail "malformed JSON" "malformed JSON" "$FM" train --config "$TMP/malformed.json" "${base[@]}" --out "$TMP/a"
sed 's/"olmoe"/"gpt2"/' "$cfg" > "$TMP/gpt2.json"
expect_fail "unknown model_type" 'unknown model_type "gpt2"' "$FM" train --config "$TMP/gpt2.json" "${base[@]}" --out "$TMP/a"
sed 's/"num_attention_heads": 2/"num_attention_heads": 3/; s/"num_key_value_heads": 1/"num_key_value_heads": 3/' "$cfg" > "$TMP/heads.json"
expect_fail "heads do not divide hidden" "num_attention_heads (3) must divide hidden_size (32)" "$FM" train --config "$TMP/heads.json" "${base[@]}" --out "$TMP/a"
sed 's/"num_experts_per_tok": 2/"num_experts_per_tok": 9/' "$cfg" > "$TMP/topk.json"
expect_fail "top-k > experts" "num_experts_per_tok (9) must be <= num_experts (4)" "$FM" train --config "$TMP/topk.json" "${base[@]}" --out "$TMP/a"
expect_fail "seq-len beyond max_position_embeddings" "exceeds max_position_embeddings (64)" "$FM" train --config "$cfg" "${base[@]}" --seq-len 65 --out "$TMP/a"
"$FM" train --config "$cfg" "${base[@]}" --seq-len 65 --max-position-embeddings 80 --out "$TMP/mpe" && ok || bad "--max-position-embeddings did not lift the limit"
grep -q '"max_position_embeddings":[[:space:]]*80' "$TMP/mpe/step_000002/config.json" && ok || bad "the override is not in the checkpoint's config"
# a resume with the original config: the run spec in state.json restores --max-position-embeddings 80;
# from an older state.json without the spec it is refused, naming the flag
cp -r "$TMP/mpe" "$TMP/mpe_old"
"$FM" train --config "$cfg" "${base[@]}" --steps 3 --resume --out "$TMP/mpe" > /dev/null 2>&1 && ok ||
    bad "resume with the original config: the run's --max-position-embeddings 80 not restored"
python3 - "$TMP/mpe_old/step_000002/state.json" <<'PY'
import json, sys
p = sys.argv[1]; s = json.load(open(p)); del s["spec"]; json.dump(s, open(p, "w"), indent=1)
PY
expect_fail "resume with the original config after raising the limit (no run spec)" "pass --max-position-embeddings 80" \
    "$FM" train --config "$cfg" "${base[@]}" --steps 3 --resume --out "$TMP/mpe_old"
# state.json's values are range-checked on --resume, naming the file, the field and the range (issue
# 27: a micro_batch x data_parallel past int64 overflowed and the run exited 0; a grad_accum of 2^31-1
# asked a 192 GiB step arena; a threads of 2^31 wrapped to a negative int)
state_bad() { # $1 name, $2 python assignments on s (the latest state.json), $3 the message's field
    rm -rf "$TMP/st_$1"; cp -r "$TMP/mpe" "$TMP/st_$1"
    local st; st=$(ls -d "$TMP/st_$1"/step_* | tail -1)/state.json
    python3 -c "import json,sys; p=sys.argv[1]; s=json.load(open(p)); $2; json.dump(s, open(p,'w'))" "$st"
    expect_fail "state.json $1 out of range" "$st: field \"$3\" is" "$FM" train --out "$TMP/st_$1" --resume --quiet
}
state_bad micro_batch 's["micro_batch"]=4611686018427387904; s["data_parallel"]=4' micro_batch
state_bad grad_accum 's["grad_accum"]=2147483647' grad_accum
state_bad threads 's["threads"]=2147483648' threads
state_bad steps 's["steps"]=-5' steps
state_bad warmup 's["schedule"]["warmup"]=1e300' schedule.warmup
state_bad seed 's["seed"]="12x"' seed
expect_fail "state.json grad_accum's range named" "expected an integer in [1, 1048576]" \
    "$FM" train --out "$TMP/st_grad_accum" --resume --quiet
expect_fail "--max-position-embeddings beyond 2^30" "must be in [1, 2^30]" "$FM" train --config "$cfg" "${base[@]}" --max-position-embeddings 100000000000 --out "$TMP/a"
expect_fail "--no-checkpoint with --exit-after" "drop one of them" "$FM" train --config "$cfg" "${base[@]}" --no-checkpoint --exit-after 1 --out "$TMP/a"
expect_fail "--ep 0" "--ep must be >= 1 (expert-parallel ranks; 1 = off), found 0" "$FM" train --config "$cfg" "${base[@]}" --ep 0 --out "$TMP/a"
expect_fail "--sp 0" "--sp must be >= 1 (sequence-parallel ranks; 1 = off), found 0" "$FM" train --config "$cfg" "${base[@]}" --sp 0 --out "$TMP/a"
expect_fail "negative --ep" "--ep must be >= 1 (expert-parallel ranks; 1 = off), found -2" "$FM" train --config "$cfg" "${base[@]}" --ep -2 --out "$TMP/a"
expect_fail "negative attention tile" "[1, 4096]" "$FM" train --config "$cfg" "${base[@]}" --attention-tile-q -1 --out "$TMP/a"
: > "$TMP/empty.txt"
expect_fail "non-finite learning rate" "expects a finite number" "$FM" train --config "$cfg" "${base[@]}" --lr inf --out "$TMP/a"
expect_fail "beta2 = 1" "--beta1 and --beta2 must be in [0, 1)" "$FM" train --config "$cfg" "${base[@]}" --beta2 1 --out "$TMP/a"
expect_fail "negative --save-every" "must be >= 0" "$FM" train --config "$cfg" "${base[@]}" --save-every -1 --out "$TMP/a"
expect_fail "--recompute listed twice" "listed twice" "$FM" train --config "$cfg" "${base[@]}" --recompute 0,0 --out "$TMP/a"
expect_fail "--recompute-keep-attention with --recompute none" "--recompute recomputes none" "$FM" train --config "$cfg" "${base[@]}" --recompute none --recompute-keep-attention --out "$TMP/a"
expect_fail "--recompute-keep-attention with a value" "flag '--recompute-keep-attention' takes no value" "$FM" train --config "$cfg" "${base[@]}" --recompute full --recompute-keep-attention=yes --out "$TMP/a"
expect_fail "plan: --recompute-keep-attention with --recompute none" "--recompute recomputes none" "$FM" plan --config "$cfg" --seq-len 16 --recompute none --recompute-keep-attention
expect_fail "config is a folder" "is not a file" "$FM" train --config "$TMP" "${base[@]}" --out "$TMP/a"
expect_fail "routes beyond int32" "int32" "$FM" plan --config "$ROOT/configs/mixtral-8x7b.json" --seq-len 9000000000000
expect_fail "empty data file" "empty" "$FM" train --config "$cfg" --data "$TMP/empty.txt" --seq-len 16 --out "$TMP/a" --quiet

# llm.c shard (magic 20240520, version 1, uint16 tokens) holding a token id 300 >= vocab 256.
shard() { # $1 path, $2 magic hex (little-endian bytes), $3 version byte, then token bytes
    local p=$1; { printf "$2"; printf "\\x$3\\x00\\x00\\x00"; printf '\x04\x00\x00\x00'; head -c 1012 /dev/zero; printf "$4"; } > "$p"; }
shard "$TMP/bad_id.bin" '\x88\xd8\x34\x01' 01 '\x41\x00\x2c\x01\x42\x00\x43\x00'
expect_fail "token id >= vocab_size" "300" "$FM" train --config "$cfg" --data "$TMP/bad_id.bin" --seq-len 2 --out "$TMP/a" --quiet
shard "$TMP/bad_ver.bin" '\x88\xd8\x34\x01' 07 '\x41\x00\x2c\x00\x42\x00\x43\x00'
expect_fail "shard magic/version mismatch" "version" "$FM" train --config "$cfg" --data "$TMP/bad_ver.bin" --seq-len 2 --out "$TMP/a" --quiet
shard "$TMP/short.bin" '\x88\xd8\x34\x01' 01 '\x41\x00\x2c\x00'
expect_fail "truncated shard" "truncated" "$FM" train --config "$cfg" --data "$TMP/short.bin" --seq-len 2 --out "$TMP/a" --quiet

# A good checkpoint to damage.
"$FM" train --config "$cfg" "${base[@]}" --out "$TMP/good" || bad "training the reference checkpoint failed"
ck="$TMP/good/step_000002"
cp -r "$ck" "$TMP/trunc"; truncate -s -100 "$TMP/trunc/model.safetensors"
expect_fail "truncated safetensors" "truncated" "$FM" eval --ckpt "$TMP/trunc" --data "$TEXT" --max-batches 1
cp -r "$ck" "$TMP/mismatch"; sed 's/"intermediate_size": 32/"intermediate_size": 48/' "$cfg" > "$TMP/mismatch/config.json"
expect_fail "mismatched safetensors" "expected [48, 32], found [32, 32]" "$FM" eval --ckpt "$TMP/mismatch" --data "$TEXT" --max-batches 1
cp -r "$ck" "$TMP/missing"; sed 's/"num_hidden_layers": 2/"num_hidden_layers": 3/' "$cfg" > "$TMP/missing/config.json"
expect_fail "missing tensor" "model.layers.2" "$FM" sample --ckpt "$TMP/missing" --max-new-tokens 2
expect_fail "no checkpoint in folder" "neither a checkpoint folder" "$FM" sample --ckpt "$TMP" --max-new-tokens 2

# NaN: a huge learning rate blows the weights up; step 1's checkpoint must stay intact.
"$FM" train --config "$cfg" "${base[@]}" --steps 5 --warmup 0 --lr 1e30 --min-lr 1e30 --grad-clip 0 --save-every 1 --out "$TMP/nan" 2> "$TMP/nan.err"
rc=$?
[ $rc -ne 0 ] && ok || bad "diverging run exited 0"
grep -q "not finite" "$TMP/nan.err" && ok || bad "no 'not finite' message: $(cat "$TMP/nan.err")"
last=$(ls -d "$TMP"/nan/step_* | tail -1)
if [ -n "$last" ]; then
    sum1=$(cat "$last"/* | md5sum)
    "$FM" eval --ckpt "$last" --data "$TEXT" --max-batches 1 >/dev/null 2>&1 # readable
    [ "$(cat "$last"/* | md5sum)" = "$sum1" ] && ok || bad "checkpoint changed"
    ls -d "$TMP"/nan/.tmp* >/dev/null 2>&1 && bad "temporary checkpoint folder left behind" || ok
else
    bad "no checkpoint written before divergence"
fi
echo "nan run: $(cat "$TMP/nan.err")"
# --offload-boundaries: an integer in 0 .. L or all; the message names the flag, the value and the range.
expect_fail "offload too many" "--offload-boundaries: found '3'; expected an integer in 0 .. 2" \
    "$FM" train --config "$cfg" "${base[@]}" --offload-boundaries 3 --out "$TMP/a"
expect_fail "offload negative" "--offload-boundaries: found '-1'" "$FM" train --config "$cfg" "${base[@]}" --offload-boundaries -1 --out "$TMP/a"
expect_fail "offload not a number" "--offload-boundaries: found 'some'" "$FM" train --config "$cfg" "${base[@]}" --offload-boundaries some --out "$TMP/a"
expect_fail "plan offload too many" "--offload-boundaries: found '9'; expected an integer in 0 .. 2" \
    "$FM" plan --config "$cfg" --seq-len 16 --offload-boundaries 9
# --offload-optimizer-bucket >= 0 (0 = 100M), --offload-optimizer-slots in [1, 16]
expect_fail "offload-optimizer bucket negative" "--offload-optimizer-bucket must be >= 1 parameters (0 = 100M), found -5" \
    "$FM" train --config "$cfg" "${base[@]}" --offload-optimizer --offload-optimizer-bucket -5 --out "$TMP/a"
expect_fail "offload-optimizer slots 0" "--offload-optimizer-slots must be in [1, 16], found 0" \
    "$FM" train --config "$cfg" "${base[@]}" --offload-optimizer --offload-optimizer-slots 0 --out "$TMP/a"
expect_fail "offload-optimizer slots 17" "--offload-optimizer-slots must be in [1, 16], found 17" \
    "$FM" train --config "$cfg" "${base[@]}" --offload-optimizer --offload-optimizer-slots 17 --out "$TMP/a"
expect_fail "offload-optimizer bucket not a number" "offload-optimizer-bucket" \
    "$FM" train --config "$cfg" "${base[@]}" --offload-optimizer --offload-optimizer-bucket lots --out "$TMP/a"
expect_fail "plan offload-optimizer slots 0" "--offload-optimizer-slots must be in [1, 16]" \
    "$FM" plan --config "$cfg" --seq-len 16 --offload-optimizer --offload-optimizer-slots 0
finish
