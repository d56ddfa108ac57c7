"""Time replays of synthetic training-step-like traces through the allocator model.

    python benchmarks/bench_allocator.py     # 2,000 and 20,000 events

Prints, per trace size: a cold replay (fresh allocator), a warm replay (the same allocator
again, holding the segments cached by the previous replay: a training loop's steady state),
the same without the per-event timeline, and a memoised ``simulate()`` call repeated with the
same trace (what a repeated estimate costs).
"""

from __future__ import annotations

import random
import time

import trainmem_nb.engine.allocator as ca

MiB = 1 << 20


def synthetic_step(n_events: int, seed: int = 0) -> tuple:
    """A forward/backward-like trace of n_events events that frees everything it allocates:
    activations kept for backward (freed in reverse order), short-lived temporaries, a few
    large buffers, small (<1 MiB) tensors, gradient buffers."""
    rng = random.Random(seed)
    ev: list = []
    live_acts: list = []
    nid = 0

    def malloc(size: int) -> int:
        nonlocal nid
        ev.append(size)
        nid += 1
        return nid - 1

    def free(i: int) -> None:
        ev.append(~i)

    budget = n_events
    fwd = int(budget * 0.45) // 3
    for _ in range(fwd):                     # forward: keep one activation, use+free a temporary
        kind = rng.random()
        if kind < 0.35:
            s = rng.randrange(4 * 1024, 900 * 1024)            # small pool
        elif kind < 0.75:
            s = rng.randrange(1 * MiB + 1, 10 * MiB)           # 20 MiB segments
        else:
            s = rng.randrange(10 * MiB, 96 * MiB)              # rounded to 2 MiB
        live_acts.append(malloc(s))
        t = malloc(rng.choice((s, s // 2 + 512, 2 * s)))
        free(t)
    grads: list = []
    while live_acts and len(ev) < n_events - 2 * len(grads) - 2 * len(live_acts):
        a = live_acts.pop()                  # backward: gradient temp, free the activation
        g = malloc(rng.randrange(512, 16 * MiB))
        free(a)
        if rng.random() < 0.5:
            grads.append(g)
        else:
            free(g)
    for a in reversed(live_acts):
        free(a)
    for g in grads:
        free(g)
    while len(ev) + 2 <= n_events:           # pad with small malloc/free pairs
        free(malloc(rng.randrange(512, 2 * MiB)))
    return tuple(ev)


def _time(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench(n: int) -> None:
    trace = synthetic_step(n)
    rep = 60 if n <= 2_000 else 12
    cold = _time(lambda: ca.CachingAllocator().replay(trace), rep)
    warm_alloc = ca.CachingAllocator()
    warm_alloc.replay(trace)
    sim = _time(lambda: warm_alloc.replay(trace, memo=False), rep)
    sim_nt = _time(lambda: warm_alloc.replay(trace, timeline=False, memo=False), rep)
    memo = _time(lambda: warm_alloc.replay(trace), 200)
    es_alloc = ca.CachingAllocator("expandable_segments:True")
    es_alloc.replay(trace)
    sim_es = _time(lambda: es_alloc.replay(trace, memo=False), rep)
    ms_alloc = ca.CachingAllocator("max_split_size_mb:128,roundup_power2_divisions:4")
    ms_alloc.replay(trace)
    sim_ms = _time(lambda: ms_alloc.replay(trace, memo=False), rep)
    ca.simulate(trace)
    smemo = _time(lambda: ca.simulate(trace), 200)
    r = ca.simulate(trace)
    m = len(trace)
    print(f"{m:>6} events (peak reserved {r.peak_reserved / MiB:.0f} MiB, peak allocated "
          f"{r.peak_allocated / MiB:.0f} MiB, {r.final['num_device_alloc']} segments)")
    print(f"    cold replay, fresh allocator        {cold * 1e3:8.3f} ms  ({cold / m * 1e9:5.0f} ns/event)")
    print(f"    warm replay, simulated (memo=False) {sim * 1e3:8.3f} ms  ({sim / m * 1e9:5.0f} ns/event)")
    print(f"      same, timeline=False              {sim_nt * 1e3:8.3f} ms  ({sim_nt / m * 1e9:5.0f} ns/event)")
    print(f"      expandable_segments:True          {sim_es * 1e3:8.3f} ms  ({sim_es / m * 1e9:5.0f} ns/event)")
    print(f"      max_split_size_mb:128,rp2:4       {sim_ms * 1e3:8.3f} ms  ({sim_ms / m * 1e9:5.0f} ns/event)")
    print(f"    warm repeated replay (memo hit)     {memo * 1e3:8.3f} ms")
    print(f"    simulate() repeated (memo hit)      {smemo * 1e3:8.3f} ms")


def main() -> None:
    print("times are the best of several runs, per replay of the whole trace")
    for n in (2_000, 20_000):
        bench(n)


if __name__ == "__main__":
    main()
