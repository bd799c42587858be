#!/usr/bin/env python3
"""Fine-tune check: a Hugging Face model folder and a JSONL file to a fine-tuned flatmoe checkpoint
that transformers loads with the same loss (issue 13, "Must show").

For each family (OlmoeForCausalLM, Qwen3MoeForCausalLM) it
  1. builds a small random-initialized model with transformers (tiny dims, vocab_size from the
     tokenizer), saves it with save_pretrained (safetensors) and the tokenizer.json given by
     --tokenizer, in fp32 and in bf16;
  2. writes a small JSONL of {"prompt": ..., "completion": ...} records (a learnable pattern);
  3. runs `flatmoe prepare --tokenizer DIR --input FILE.jsonl --out PREFIX` (PREFIX_000000.bin and
     its loss mask) and checks that the mask masks some tokens and not all;
  4. checks that `flatmoe eval` of the saved folder (fp32 and bf16) gives transformers' loss on the
     same windows with the same mask (targets whose mask byte is 0 ignored);
  5. runs `flatmoe train --init-from` the fp32 folder for --steps steps and checks the loss falls;
  6. loads the fine-tuned checkpoint in transformers and checks that its loss on the evaluation
     windows equals `flatmoe eval`'s (and, when fm_hf_grad is next to flatmoe, that the logits
     agree);
  7. checks that changing a masked target's token does not move flatmoe's loss and changing an
     unmasked one does (eval of the fine-tuned checkpoint on a copy of the shard with one token
     changed).
Each check prints a PASS or FAIL line; the exit status is 1 when any failed.

  python3 tools/hf_finetune_check.py --flatmoe build/flatmoe --tokenizer tests/data/tok \\
      [--work DIR] [--steps 40] [--families olmoe,qwen3_moe] [--tol 2e-4] [--threads N]

--tokenizer is a folder holding tokenizer.json, or a folder of per-family folders (olmoe/,
qwen3/ or qwen3_moe/, ...), each holding one. Works with the CPU build (fp32; --tol 2e-4 covers
eval's 4-decimal print) and the CUDA build (--flatmoe build-cuda/flatmoe-cuda: bf16, use
--tol 3e-2). Needs torch, transformers and safetensors; no network.
"""
import argparse
import copy
import glob
import json
import math
import os
import random
import re
import shutil
import struct
import subprocess
import sys
import tempfile

torch = None
transformers = None

RESULTS = []


def report(ok, what, detail=""):
    RESULTS.append(ok)
    print(f"{'PASS' if ok else 'FAIL'} {what}{': ' + detail if detail else ''}", flush=True)
    return ok


def run(cmd, **kw):
    print("  $ " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, text=True, capture_output=True, **kw)


def tokenizer_dir(root, family):
    names = {"olmoe": ["olmoe", "OLMoE", "olmo"], "qwen3_moe": ["qwen3_moe", "qwen3", "qwen", "Qwen3"]}[family]
    for n in names:
        if os.path.isfile(os.path.join(root, n, "tokenizer.json")):
            return os.path.join(root, n)
    if os.path.isfile(os.path.join(root, "tokenizer.json")):
        return root
    sys.exit(f"--tokenizer {root}: no tokenizer.json in it nor in {', '.join(names)}/ under it")


def vocab_of(tok_dir):
    with open(os.path.join(tok_dir, "tokenizer.json"), encoding="utf-8") as f:
        j = json.load(f)
    ids = list(j.get("model", {}).get("vocab", {}).values()) if isinstance(j.get("model", {}).get("vocab"), dict) else []
    if isinstance(j.get("model", {}).get("vocab"), list):  # unigram: [[piece, score], ...]
        ids = list(range(len(j["model"]["vocab"])))
    ids += [t["id"] for t in j.get("added_tokens", [])]
    n = max(ids) + 1 if ids else 0
    eos = None
    for t in j.get("added_tokens", []):
        if re.search(r"endoftext|</s>|<\|im_end\|>|eos", t["content"]):
            eos = t["id"]
            break
    return n, eos


def make_model(family, vocab, eos):
    common = dict(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, rms_norm_eps=1e-5, router_aux_loss_coef=0.01,
                  output_router_logits=False, tie_word_embeddings=False, initializer_range=0.05)
    if eos is not None:
        common["eos_token_id"] = eos
    if family == "olmoe":
        cfg = transformers.OlmoeConfig(intermediate_size=48, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
                                       rope_theta=10000.0, **common)
        cfg._attn_implementation = "eager"
        return transformers.OlmoeForCausalLM(cfg)
    cfg = transformers.Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                                      num_experts_per_tok=2, norm_topk_prob=True, head_dim=16, rope_theta=1e6,
                                      decoder_sparse_step=1, mlp_only_layers=[], **common)
    cfg._attn_implementation = "eager"
    return transformers.Qwen3MoeForCausalLM(cfg)


def write_jsonl(path, n, seed):
    rnd = random.Random(seed)
    words = ["red", "green", "blue", "cat", "dog", "tree", "sun", "moon", "river", "stone"]
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            a, b = rnd.randrange(10), rnd.randrange(10)
            w = rnd.choice(words)
            f.write(json.dumps({"prompt": f"Add {a} and {b}, then say {w}.", "completion": f" {a + b} {w}"}) + "\n")


def read_shard(path):
    with open(path, "rb") as f:
        head = f.read(1024)
        magic, version, n = struct.unpack("<iii", head[:12])
        body = f.read()
    if (magic, version) == (20240520, 1):
        toks = list(struct.unpack(f"<{n}H", body))
    elif (magic, version) == (20240801, 7):
        toks = list(struct.unpack(f"<{n}I", body))
    else:
        raise ValueError(f"{path}: not an llm.c shard (magic {magic}, version {version})")
    return toks


def mask_path(shard):
    for p in (shard + ".mask", re.sub(r"\.bin$", ".mask", shard)):
        if os.path.isfile(p):
            return p
    return None


def read_mask(path, n):
    with open(path, "rb") as f:
        data = f.read()
    if data[:8] != b"FMMASK01" or struct.unpack("<Q", data[8:16])[0] != n or len(data) != 16 + n:
        raise ValueError(f"{path}: not a loss mask for {n} tokens")
    return list(data[16:])


def write_shard(path, toks):
    with open(path, "wb") as f:
        f.write(struct.pack("<iii", 20240801, 7, len(toks)) + b"\0" * (1024 - 12))
        f.write(struct.pack(f"<{len(toks)}I", *toks))


def windows(toks, mask, T, n_win):
    """eval's windows: inputs toks[wT : wT+T], targets toks[wT+1 : wT+T+1] (-100 where masked)."""
    n_win = min(n_win, (len(toks) - 1) // T)
    x, y = [], []
    for w in range(n_win):
        x.append(toks[w * T:w * T + T])
        y.append([t if (mask is None or mask[w * T + 1 + i]) else -100 for i, t in enumerate(toks[w * T + 1:w * T + T + 1])])
    return torch.tensor(x), torch.tensor(y)


def hf_loss(model, x, y):
    with torch.no_grad():
        logits = model(input_ids=x).logits.float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                             ignore_index=-100, reduction="mean").item(), logits


def fm_eval(fm, ck, data, T, B, n_batches, threads):
    r = run([fm, "eval", "--ckpt", ck, "--data", data, "--seq-len", str(T), "--micro-batch", str(B),
             "--max-batches", str(n_batches), "--threads", str(threads)])
    m = re.search(r"^loss ([-0-9.naninf]+)", r.stdout, re.M)
    if r.returncode != 0 or not m:
        print(r.stdout + r.stderr)
        return None
    return float(m.group(1))


def metrics_losses(run_dir):
    out = []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if "loss" in r:
                out.append(r["loss"])
    return out


def check_family(family, a, work):
    fm = os.path.abspath(a.flatmoe)
    print(f"== {family}", flush=True)
    tok = tokenizer_dir(a.tokenizer, family)
    vocab, eos = vocab_of(tok)
    vocab = (vocab + 63) // 64 * 64
    torch.manual_seed(1234)
    model = make_model(family, vocab, eos).float().eval()
    d32, d16 = os.path.join(work, family + "-fp32"), os.path.join(work, family + "-bf16")
    model.save_pretrained(d32)  # safetensors (transformers' default)
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(d16)
    model16 = copy.deepcopy(model)  # the bf16 folder's values widened to fp32: what flatmoe reads
    with torch.no_grad():
        for p in model16.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    for d in (d32, d16):
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if os.path.isfile(os.path.join(tok, f)):
                shutil.copy(os.path.join(tok, f), d)
    report(any(os.path.isfile(os.path.join(d32, f)) for f in ("model.safetensors", "model.safetensors.index.json")),
           f"{family}: save_pretrained wrote safetensors", ", ".join(sorted(os.listdir(d32))))

    jl = os.path.join(work, family + ".jsonl")
    write_jsonl(jl, a.records, 7)
    prefix = os.path.join(work, family + "-data")
    r = run([fm, "prepare", "--tokenizer", d32, "--input", jl, "--out", prefix])
    shards = sorted(glob.glob(prefix + "_*.bin"))
    if not report(r.returncode == 0 and bool(shards), f"{family}: flatmoe prepare",
                  (r.stdout + r.stderr).strip().splitlines()[-1] if (r.stdout + r.stderr).strip() else ""):
        print(r.stdout + r.stderr)
        return
    shard = shards[0]
    toks = read_shard(shard)
    mp = mask_path(shard)
    mask = read_mask(mp, len(toks)) if mp else None
    frac = (1 - sum(mask) / len(mask)) if mask else 0.0
    report(mask is not None and 0.0 < frac < 1.0, f"{family}: prepare wrote a loss mask",
           f"{mp}: {frac:.1%} of {len(toks)} tokens masked" if mask else "no .mask file")
    report(max(toks) < vocab, f"{family}: token ids < vocab_size", f"max id {max(toks)}, vocab_size {vocab}")

    T, B, nb = a.seq_len, 4, 2
    x, y = windows(toks, mask, T, B * nb)
    for name, d, m in (("fp32", d32, model), ("bf16", d16, model16)):
        hl, _ = hf_loss(m, x, y)
        fl = fm_eval(fm, d, shard, T, B, nb, a.threads)
        report(fl is not None and abs(fl - hl) <= a.tol, f"{family}: eval of the {name} folder = transformers' masked loss",
               f"flatmoe {fl}, transformers {hl:.6f} (tol {a.tol:g})")

    out = os.path.join(work, family + "-run")
    shutil.rmtree(out, ignore_errors=True)
    r = run([fm, "train", "--init-from", d32, "--data", shard, "--seq-len", str(T), "--micro-batch", "8",
             "--steps", str(a.steps), "--lr", "3e-3", "--warmup", "5", "--eval-every", str(a.steps),
             "--threads", str(a.threads), "--quiet", "--out", out])
    if not report(r.returncode == 0, f"{family}: train --init-from", r.stderr.strip()[-300:]):
        print(r.stdout + r.stderr)
        return
    ls = metrics_losses(out)
    first, last = ls[0], sum(ls[-5:]) / len(ls[-5:])
    report(last < first - 0.1, f"{family}: the loss falls", f"step 1 {first:.4f}, mean of the last 5 steps {last:.4f}")

    ck = sorted(glob.glob(os.path.join(out, "step_*")))[-1]
    back = transformers.AutoModelForCausalLM.from_pretrained(ck, attn_implementation="eager").float().eval()
    hl, logits = hf_loss(back, x, y)
    fl = fm_eval(fm, ck, shard, T, B, nb, a.threads)
    report(fl is not None and abs(fl - hl) <= a.tol, f"{family}: the fine-tuned checkpoint in transformers = flatmoe eval",
           f"transformers {hl:.6f}, flatmoe {fl} (tol {a.tol:g})")
    tool = os.path.join(os.path.dirname(fm), "fm_hf_grad_cuda" if fm.endswith("cuda") else "fm_hf_grad")
    if os.path.isfile(tool):
        from safetensors.torch import load_file, save_file
        batch, res = os.path.join(work, "batch.safetensors"), os.path.join(work, "fm.safetensors")
        save_file({"input_ids": x[:2].float().contiguous()}, batch)
        rr = run([tool, ck, batch, res])
        if rr.returncode == 0:
            fl_logits = load_file(res)["logits"].reshape(logits[:2].shape)
            e = ((fl_logits.double() - logits[:2].double()).norm() / logits[:2].double().norm()).item()
            report(e <= (3e-2 if fm.endswith("cuda") else 1e-5), f"{family}: fine-tuned logits, flatmoe vs transformers",
                   f"normalized error {e:.3g}")
        else:
            report(False, f"{family}: {os.path.basename(tool)} on the checkpoint", rr.stderr.strip()[-300:])

    # masked targets carry no loss: change one token that is only a target of the last eval window.
    # Scored with the fine-tuned checkpoint: its peaked predictions make an unmasked target's change
    # move the window's loss well past eval's 4-decimal print (at the random init, in bf16, it may not)
    sub_ck = ck if ck else d32
    if mask is not None:
        n_win = min(B * nb, (len(toks) - 1) // T)
        end = n_win * T  # the last window's last target, never an input of the windows scored
        for want_masked in (True, False):
            top = min(len(toks) - 1, max(end, 64 * T))
            cand = [i for i in range(top, 0, -1) if (mask[i] == 0) == want_masked and i % T == 0]
            if not cand:
                report(False, f"{family}: a {'masked' if want_masked else 'unmasked'} window-final target to change")
                continue
            i = cand[0]
            n_use = i + 1
            sub = os.path.join(work, f"{family}-sub.bin")
            write_shard(sub, toks[:n_use])
            with open(sub + ".mask", "wb") as f:
                f.write(b"FMMASK01" + struct.pack("<Q", n_use) + bytes(mask[:n_use]))
            base = fm_eval(fm, sub_ck, sub, T, 1, i // T, a.threads)
            alt = list(toks[:n_use])
            alt[i] = (alt[i] + 1) % vocab
            write_shard(sub, alt)
            moved = fm_eval(fm, sub_ck, sub, T, 1, i // T, a.threads)
            same = base is not None and moved is not None and base == moved
            report(same if want_masked else (not same and moved is not None),
                   f"{family}: changing a{' masked' if want_masked else 'n unmasked'} target "
                   f"{'does not move' if want_masked else 'moves'} the loss", f"token {i}: {base} -> {moved}")


def main():
    global torch, transformers
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--flatmoe", required=True, help="the flatmoe binary (CPU build, or flatmoe-cuda)")
    ap.add_argument("--tokenizer", required=True, help="folder with tokenizer.json, or with per-family folders")
    ap.add_argument("--work", help="working folder (default: a temporary one, removed unless a check fails)")
    ap.add_argument("--families", default="olmoe,qwen3_moe")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--records", type=int, default=400, help="JSONL records")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--tol", type=float, default=None, help="loss tolerance (2e-4 CPU build, 3e-2 CUDA build)")
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()
    if a.tol is None:
        a.tol = 3e-2 if a.flatmoe.endswith("cuda") else 2e-4
    import torch as _t
    import transformers as _tr
    torch, transformers = _t, _tr
    torch.set_num_threads(max(1, os.cpu_count() // 2))
    work = a.work or tempfile.mkdtemp(prefix="hf_finetune_")
    os.makedirs(work, exist_ok=True)
    for fam in a.families.split(","):
        try:
            check_family(fam.strip(), a, work)
        except Exception as e:  # a crash is a failure of that family, the others still run
            report(False, f"{fam}: unexpected error", repr(e))
    n_fail = RESULTS.count(False)
    print(f"{'ALL PASS' if n_fail == 0 else 'FAILED'}: {RESULTS.count(True)} passed, {n_fail} failed"
          f" (work folder {work})")
    if n_fail == 0 and not a.work:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if n_fail else 0


if __name__ == "__main__":
    sys.exit(main())
