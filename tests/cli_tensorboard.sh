#!/usr/bin/env bash
# train --tensorboard DIR (issue 28): the event file is a TFRecord stream of Event protos that a
# reader written here from the format's specification (tensorflow/core/lib/io/record_writer.cc,
# event.proto, summary.proto; no TensorFlow or TensorBoard installed) parses: every record's
# length and data CRC-32C check out, the first record is file_version "brain.Event:2", and each
# step's Event holds the loss, lr and grad norm of metrics.jsonl's step record (as fp32), the
# tokens/s, the expert load of every layer and the memory bounds; a resumed run appends a new file.
source "$(dirname "$0")/lib_cli.sh"
cfg="$ROOT/tests/data/micro.json"
common=(--config "$cfg" --data "$TEXT" --seq-len 32 --micro-batch 2 --steps 4 --warmup 1 --threads 2 --quiet
        --eval-every 2 --eval-batches 1)
"$FM" train "${common[@]}" --out "$TMP/run" --tensorboard "$TMP/tb" --exit-after 3 || bad "train --tensorboard failed"
"$FM" train "${common[@]}" --out "$TMP/run" --tensorboard "$TMP/tb" --resume || bad "resumed train --tensorboard failed"
[ "$(ls "$TMP/tb" | grep -c '^events\.out\.tfevents\.')" -ge 1 ] && ok || bad "no events.out.tfevents.* file in $TMP/tb"
if python3 - "$TMP/tb" "$TMP/run/metrics.jsonl" <<'PY'
import glob, json, math, os, struct, sys

def crc32c(data):
    c = 0xFFFFFFFF
    for b in data:
        c ^= b
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
    return c ^ 0xFFFFFFFF

def masked(data):
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF

def varint(b, i):
    v = s = 0
    while True:
        x = b[i]; i += 1
        v |= (x & 0x7F) << s; s += 7
        if not x & 0x80: return v, i

def fields(b):  # protobuf message -> list of (field, wire type, value)
    i, out = 0, []
    while i < len(b):
        key, i = varint(b, i)
        f, w = key >> 3, key & 7
        if w == 0: v, i = varint(b, i)
        elif w == 1: v = b[i:i + 8]; i += 8
        elif w == 5: v = b[i:i + 4]; i += 4
        elif w == 2:
            n, i = varint(b, i); v = b[i:i + n]; i += n
        else: raise SystemExit("wire type %d" % w)
        out.append((f, w, v))
    return out

events = []
files = sorted(glob.glob(os.path.join(sys.argv[1], "events.out.tfevents.*")))
assert len(files) == 2, "expected one event file per invocation, found %s" % files
for path in files:
    data = open(path, "rb").read()
    i, first = 0, True
    while i < len(data):
        hdr = data[i:i + 8]
        (n,) = struct.unpack("<Q", hdr)
        (hc,) = struct.unpack("<I", data[i + 8:i + 12])
        assert hc == masked(hdr), "%s: bad length CRC at byte %d" % (path, i)
        body = data[i + 12:i + 12 + n]
        (dc,) = struct.unpack("<I", data[i + 12 + n:i + 16 + n])
        assert dc == masked(body), "%s: bad data CRC at byte %d" % (path, i)
        i += 16 + n
        ev = {"values": {}}
        for f, w, v in fields(body):
            if f == 1: ev["wall_time"] = struct.unpack("<d", v)[0]
            elif f == 2: ev["step"] = v
            elif f == 3: ev["file_version"] = v.decode()
            elif f == 5:
                for sf, sw, sv in fields(v):
                    assert sf == 1
                    tag = val = None
                    for vf, vw, vv in fields(sv):
                        if vf == 1: tag = vv.decode()
                        elif vf == 2: val = struct.unpack("<f", vv)[0]
                    ev["values"][tag] = val
        if first:
            assert ev.get("file_version") == "brain.Event:2", "first record: %s" % ev
            first = False
        else:
            assert abs(ev["wall_time"] - __import__("time").time()) < 3600, "wall_time %s" % ev["wall_time"]
            events.append(ev)
steps = [json.loads(l) for l in open(sys.argv[2]) if '"type":"step"' in l]
assert [e["step"] for e in events] == [1, 2, 3, 4], "event steps %s" % [e["step"] for e in events]
f32 = lambda x: struct.unpack("<f", struct.pack("<f", x))[0]
for e, r in zip(events, steps):
    v = e["values"]
    for tag, key in (("train/loss", "loss"), ("train/lr", "lr"), ("train/grad_norm", "grad_norm")):
        assert v[tag] == f32(r[key]), "step %d %s: %r vs metrics %r" % (e["step"], tag, v[tag], r[key])
    assert v["train/tokens_per_s"] > 0
    for l, x in enumerate(r["expert_load_max_mean"]):  # metrics.jsonl rounds them to 4 decimals
        assert abs(v["expert_load/layer_%02d" % l] - x) <= 5.01e-5, "layer %d load %r vs %r" % (l, v["expert_load/layer_%02d" % l], x)
    if "val_loss" in r: assert v["val/loss"] == f32(r["val_loss"])
assert any(t.startswith("memory/bound_bytes/") for t in events[0]["values"]), "no memory bounds on step 1"
print("tensorboard: %d events read back, %d scalars in the first" % (len(events), len(events[0]["values"])))
PY
then ok; else bad "the event files do not read back"; fi
expect_fail "tensorboard into a file" "--tensorboard" "$FM" train "${common[@]}" --out "$TMP/r2" --tensorboard "$TMP/run/metrics.jsonl"
finish
