#!/usr/bin/env python3
"""Writes COUNT documents of 3 to MAXLEN random byte tokens (seed 7) as an llm.c shard PREFIX.bin
with its FMDOCS01 document index PREFIX.docs (the layout docs/formats.md gives and
tests/cli_pack.sh writes): the packed-documents input of tests/mpi_train_sp.sh and
tests/gpu/cli_cuda_sp.sh.

  python3 tests/packed_docs.py PREFIX COUNT MAXLEN
"""
import random
import struct
import sys

prefix, count, maxlen = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
r = random.Random(7)
docs = [[r.randrange(256) for _ in range(r.randint(3, maxlen))] for _ in range(count)]
toks = [t for d in docs for t in d]
with open(prefix + ".bin", "wb") as f:
    f.write(struct.pack("<256i", 20240801, 7, len(toks), *([0] * 253)))
    f.write(struct.pack("<%dI" % len(toks), *toks))
starts, at = [], 0
for d in docs:
    starts.append(at)
    at += len(d)
with open(prefix + ".docs", "wb") as f:
    f.write(b"FMDOCS01" + struct.pack("<QQ", len(toks), len(starts)) + struct.pack("<%dQ" % len(starts), *starts))
