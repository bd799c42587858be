#!/usr/bin/env python3
"""v5's synchronization protocol on the CPU (no GPU): the producer thread and the two cooperative
consumer warpgroups of v5_fp8.cuh as coroutines over modelled mbarriers, with TMA loads that land
at random later times and TMA stores that read their shared-memory half at random later times, in
random interleavings over tile lists like the lab's (k-blocks a tile 0..40, beta 0 and 1, partial
m-tiles), for every variant: OVL (promotion of k-block kb-1 after kb's wgmmas are issued; the
stage of kb-1 released after that promotion, since it reads the stage's scales) or not, and CB
0 / 1 / 2 C buffers (per buffer and half: cfull / cempty, v4's protocol; the buffer of a TMA tile
is its TMA-tile count mod CB; partial tiles neither load old C nor touch a buffer; the producer
loads a tile's old C after its k-blocks with 1 buffer, before them with 2).
Checks: no deadlock; every stage read (wgmma operands at issue, scales at promotion) holds the
k-block it should; every old C a warpgroup reads is its own tile's; no old-C load and no epilogue
write lands in a half whose TMA store has not read it; every store reads what its tile wrote.
Exit 1 on the first violation, naming it. Faults that must fail: --early-release (OVL: the stage
released before its promotion read the scales), --no-cempty (old C loaded without waiting for the
store's read). Run: python3 v5_protocol_sim.py [fault]

mbarrier model (PTX ISA): phase counter ph (starts 0); wait(parity P) passes when ph % 2 != P; a
phase completes when the pending arrivals reach the count and the transaction bytes reach 0."""
import random
import sys

FAULT = sys.argv[1] if len(sys.argv) > 1 else None


class Bar:
    def __init__(self, count):
        self.count, self.ph, self.arr, self.tx = count, 0, 0, 0

    def done(self, parity):
        return self.ph % 2 != parity

    def _check(self):
        if self.arr == self.count and self.tx == 0:
            self.ph, self.arr = self.ph + 1, 0

    def arrive(self, n=1):
        self.arr += n
        if self.arr > self.count:
            fail("more arrivals than the count")
        self._check()

    def expect_tx(self, b):  # mbarrier.arrive.expect_tx: one arrival + b bytes expected
        self.tx += b
        self.arrive()

    def complete_tx(self, b):
        self.tx -= b
        self._check()


class Fail(Exception):
    pass


def fail(msg):
    raise Fail(msg)


def run(tiles, src, ovl, cb, rng):
    """tiles: [(nk, tma_tile)] of one CTA, in order; src: beta != 0 (old C by TMA; only with cb > 0)."""
    stages = {0: 6, 1: 5, 2: 4}[cb]
    src = src and cb > 0
    full = [Bar(1) for _ in range(stages)]
    empty = [Bar(8) for _ in range(stages)]  # one arrival per consumer warp: 4 per warpgroup
    cfull = [[Bar(1), Bar(1)] for _ in range(2)]
    cempty = [[Bar(1), Bar(1)] for _ in range(2)]
    stage = [None] * stages  # what each stage holds: (tile, kb)
    cbuf = [[None, None] for _ in range(2)]  # [buffer][half]: what it holds
    events = []  # pending async work: callables
    pend = [[], []]  # per warpgroup (its thread 0's bulk groups): (buffer, tile) stores not yet read

    def producer():
        it, cn = 0, 0

        def old_c(ti):
            nonlocal cn
            b = cn & 1 if cb == 2 else 0
            n = cn >> 1 if cb == 2 else cn
            cn += 1
            for w in range(2):
                if FAULT != "--no-cempty":
                    while not cempty[b][w].done((n & 1) ^ 1):
                        yield
                cfull[b][w].expect_tx(1)

                def cland(b=b, w=w, ti=ti):
                    if any(pb == b for pb, _ in pend[w]):
                        fail(f"old C of tile {ti} landed in buffer {b} half {w} before its TMA store read it")
                    cbuf[b][w] = ("old", ti)
                    cfull[b][w].complete_tx(1)
                events.append(cland)

        for ti, (nk, tt) in enumerate(tiles):
            if src and tt and cb == 2:  # CB 2: the old C before the tile's k-blocks
                yield from old_c(ti)
            for kb in range(nk):
                s = it % stages
                while not empty[s].done(((it // stages) & 1) ^ 1):
                    yield
                full[s].expect_tx(1)

                def land(s=s, ti=ti, kb=kb):
                    stage[s] = (ti, kb)
                    full[s].complete_tx(1)
                events.append(land)
                it += 1
            if src and tt and cb != 2:  # CB 1: after them, as v4
                yield from old_c(ti)

    def check_stage(s, ti, kb, what):
        if stage[s] != (ti, kb):
            fail(f"{what}: stage {s} holds {stage[s]}, wanted tile {ti} k-block {kb}")

    def consumer(wg):
        it, cn = 0, 0
        for ti, (nk, tt) in enumerate(tiles):
            if ovl:
                for kb in range(nk):
                    s = (it + kb) % stages
                    while not full[s].done(((it + kb) // stages) & 1):
                        yield
                    check_stage(s, ti, kb, f"warpgroup {wg} wgmma")
                    yield  # wgmmas of kb issued (they read the stage until the wait below)
                    if kb > 0:
                        sp = (it + kb - 1) % stages
                        check_stage(sp, ti, kb - 1, f"warpgroup {wg} wgmma in flight")  # wait_group 1: kb-1 done
                        if FAULT == "--early-release":
                            empty[sp].arrive(4)
                            yield
                        check_stage(sp, ti, kb - 1, f"warpgroup {wg} promotion's scales")
                        if FAULT != "--early-release":
                            empty[sp].arrive(4)
                if nk > 0:
                    yield  # wait_group 0
                    sp = (it + nk - 1) % stages
                    check_stage(sp, ti, nk - 1, f"warpgroup {wg} last promotion's scales")
                    empty[sp].arrive(4)
            else:
                for kb in range(nk):
                    s = (it + kb) % stages
                    while not full[s].done(((it + kb) // stages) & 1):
                        yield
                    check_stage(s, ti, kb, f"warpgroup {wg} wgmma")
                    yield
                    check_stage(s, ti, kb, f"warpgroup {wg} promotion's scales")
                    empty[s].arrive(4)
            it += nk
            if cb == 0 or not tt:
                yield  # register stores (old C, if any, read from global)
                continue
            b = cn & 1 if cb == 2 else 0
            n = cn >> 1 if cb == 2 else cn
            cn += 1
            if src:
                while not cfull[b][wg].done(n & 1):
                    yield
                if cbuf[b][wg] != ("old", ti):
                    fail(f"warpgroup {wg} tile {ti} read old C {cbuf[b][wg]} from buffer {b}")
            else:
                while pend[wg]:  # thread 0's bulk_wait_read0, then the warpgroup barrier
                    yield
            yield
            if any(pb == b for pb, _ in pend[wg]):
                fail(f"warpgroup {wg} tile {ti} writes buffer {b} before its last TMA store read it")
            cbuf[b][wg] = ("new", ti)
            yield  # fence.proxy.async, barrier, thread 0 issues the two stores
            pend[wg].append((b, ti))

            def sread(wg=wg, b=b, ti=ti):
                if cbuf[b][wg] != ("new", ti):
                    fail(f"TMA store of tile {ti} read buffer {b} half {wg} holding {cbuf[b][wg]}")
                pend[wg].remove((b, ti))
            events.append(sread)
            if src:
                while pend[wg]:  # bulk_wait_read0, then the cempty arrival
                    yield
                cempty[b][wg].arrive()

    agents = [producer(), consumer(0), consumer(1)]
    alive = [True] * 3
    idle = 0
    while any(alive) or events:
        choices = [i for i in range(3) if alive[i]] + (["ev"] if events else [])
        c = rng.choice(choices)
        if c == "ev":
            events.pop(rng.randrange(len(events)))()
        else:
            try:
                next(agents[c])
            except StopIteration:
                alive[c] = False
        idle = 0 if events else idle + 1
        if idle > 200000:
            fail(f"deadlock (tiles {tiles}, src {src}, ovl {ovl}, cb {cb}): agents alive {alive}")
    if pend[0] or pend[1]:
        fail("TMA stores left unread at exit")


def main():
    rng = random.Random(14)
    runs = 0
    try:
        for trial in range(700):
            ntiles = rng.randrange(0, 9)
            tiles = [(rng.choice([0, 1, 2, 3, 4, 5, 8, 16, 40]), rng.random() < 0.8) for _ in range(ntiles)]
            for ovl in (False, True):
                for cb in (0, 1, 2):
                    for src in (False, True):
                        if src and cb == 0:
                            continue
                        run(tiles, src, ovl, cb, rng)
                        runs += 1
    except Fail as e:
        print(f"FAIL v5 protocol{' (' + FAULT + ')' if FAULT else ''}: {e}")
        sys.exit(1)
    print(f"v5 protocol: {runs} random runs (OVL on/off, 0/1/2 C buffers, beta 0/1), no deadlock, every stage / old C / store "
          f"read as intended")


if __name__ == "__main__":
    main()
