#!/usr/bin/env python3
"""v4's synchronization protocol on the CPU (no GPU): the producer thread and the two ping-pong
consumer warpgroups of v4_pingpong.cuh as coroutines over modelled mbarriers, TMA loads that land
at random later times and TMA stores that read their buffer at random later times, run in random
interleavings over tile lists like the lab's (k-blocks per tile 0..40, beta 0 and 1, partial
tiles). Checks: no deadlock, every stage a consumer reads holds the k-block it expects, every old C
a consumer reads is its own tile's, a TMA store never reads a buffer that was overwritten before
it read it. Exit 1 on the first violation, naming it. Run: python3 v4_protocol_sim.py

mbarrier model (PTX ISA): phase counter ph (starts 0); wait(parity P) passes when ph % 2 != P; a
phase completes when the pending arrivals reach the count and the transaction bytes reach 0."""
import random
import sys

STAGES = 4
ORDER = "--no-order" not in sys.argv  # --no-order: without the mainloop order (must fail)


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


def fail(msg):
    print("FAIL v4 protocol:", msg)
    sys.exit(1)


def run(tiles, src, rng):
    """tiles: [(nk, tma_tile)] of one CTA, in order; src: beta != 0 (the SRC kernel)."""
    full = [Bar(1) for _ in range(STAGES)]
    empty = [Bar(4) for _ in range(STAGES)]
    cfull, cempty, order = [Bar(1), Bar(1)], [Bar(1), Bar(1)], [Bar(4), Bar(4)]
    stage = [None] * STAGES  # what each stage holds: (tile, kb)
    cbuf = [None, None]  # what each C buffer holds
    events = []  # pending async work: callables
    store_pending = [[], []]  # per warpgroup: TMA stores not yet read their buffer

    def producer():
        it, cn = 0, [0, 0]
        for ti, (nk, _) in enumerate(tiles):
            j = ti % 2
            for kb in range(nk):
                s = it % STAGES
                while not empty[s].done(((it // STAGES) & 1) ^ 1):
                    yield
                full[s].expect_tx(1)

                def land(s=s, ti=ti, kb=kb):
                    stage[s] = (ti, kb)
                    full[s].complete_tx(1)
                events.append(land)
                it += 1
            if src:
                n = cn[j]
                cn[j] += 1
                while not cempty[j].done((n & 1) ^ 1):
                    yield
                if store_pending[j]:
                    fail(f"old C of tile {ti} loaded into buffer {j} before its TMA store read it")
                cfull[j].expect_tx(1)

                def cland(j=j, ti=ti):
                    cbuf[j] = ("old", ti)
                    cfull[j].complete_tx(1)
                events.append(cland)
        return

    def release(s, ti, kb):  # the stage must still hold what its wgmmas read
        if stage[s] != (ti, kb):
            fail(f"stage {s} overwritten ({stage[s]}) before tile {ti} k-block {kb} released it")
        empty[s].arrive(4)

    def consumer(wg):
        it, cn, own = 0, 0, 0
        for ti, (nk, tma_tile) in enumerate(tiles):
            if ti % 2 != wg:
                it += nk
                continue
            if ORDER:
                if wg == 1:
                    while not order[1].done(own & 1):
                        yield
                elif own > 0:
                    while not order[0].done((own - 1) & 1):
                        yield
            own += 1
            prev = -1
            for kb in range(nk):
                s = it % STAGES
                while not full[s].done((it // STAGES) & 1):
                    yield
                if stage[s] != (ti, kb):
                    fail(f"warpgroup {wg} read stage {s} holding {stage[s]}, wanted tile {ti} k-block {kb}")
                yield  # the wgmmas (one k-block stays in flight: the previous stage is released)
                if prev >= 0:
                    release(prev, ti, kb - 1)
                prev = s
                it += 1
            if ORDER:
                order[wg ^ 1].arrive(4)
            yield
            if prev >= 0:
                release(prev, ti, nk - 1)
            if src:
                while not cfull[wg].done(cn & 1):
                    yield
                cn += 1
                if cbuf[wg] != ("old", ti):
                    fail(f"warpgroup {wg} tile {ti} read old C {cbuf[wg]}")
            elif tma_tile:
                while store_pending[wg]:  # bulk_wait_read0 then the warpgroup barrier
                    yield
            yield
            if tma_tile:
                cbuf[wg] = ("new", ti)
                store_pending[wg].append(ti)

                def sread(wg=wg, ti=ti):
                    if cbuf[wg] != ("new", ti):
                        fail(f"TMA store of tile {ti} read buffer {wg} holding {cbuf[wg]}")
                    store_pending[wg].remove(ti)
                events.append(sread)
                if src:
                    while store_pending[wg]:
                        yield
                    cempty[wg].arrive()
            elif src:
                cempty[wg].arrive()

    agents = [producer(), consumer(0), consumer(1)]
    alive = [True] * 3
    idle = 0
    while any(alive) or events:
        progressed = False
        choices = [i for i in range(3) if alive[i]] + (["ev"] if events else [])
        c = rng.choice(choices)
        if c == "ev":
            events.pop(rng.randrange(len(events)))()
            progressed = True
        else:
            try:
                next(agents[c])
                progressed = True  # a yield may be a spin; the idle counter catches a deadlock
            except StopIteration:
                alive[c] = False
        idle = 0 if events else idle + 1
        if idle > 200000:
            fail(f"deadlock (tiles {tiles}, src {src}): agents alive {alive}")
    for wg in range(2):
        if store_pending[wg]:
            fail("TMA stores left unread at exit")


def main():
    rng = random.Random(14)
    runs = 0
    for trial in range(3000):
        ntiles = rng.randrange(0, 9)
        tiles = [(rng.choice([0, 1, 2, 3, 4, 5, 8, 16, 40]), rng.random() < 0.8) for _ in range(ntiles)]
        for src in (False, True):
            run(tiles, src, rng)
            runs += 1
    print(f"v4 protocol: {runs} random runs, no deadlock, every stage / old C / store read as intended")


if __name__ == "__main__":
    main()
