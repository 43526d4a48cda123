"""How many block-wide reductions the top-k's select needs, by pivot rule (a NumPy simulation, no kernel; 2026-12-07).

`radix_steps` counts the steps of `ops/triton/topk.py: _select_threshold` as shipped (three pivots a step at the
quarter points of the remaining key range, i.e. 2 bits of the order-preserving uint32 key; early stop once exactly kk
keys lie at or above the threshold). `interp_steps` puts the three pivots around a linear interpolation of the kk-th
key inside the bracket (key space; one extra min/max reduction first; a quartering step when a step shrinks the
bracket less than 2x), `value_steps` the same in float value space. 20 rows per (distribution, N), kk = N / 16.
Rows: standard normal; Quest's bound sum_d max(q_d min_d, q_d max_d) over 16 random normal keys a block (D = 128), and
the same with 2 % of blocks scaled 3x (heavy tail); lognormal(0, 2); minus exponential. Output: sim_steps.txt.
"""
import numpy as np
rng = np.random.default_rng(0)

def keys_of(x):
    b = x.astype(np.float32).view(np.int32).astype(np.int64)
    k = np.where(b < 0, b ^ 0x7FFFFFFF, b) & 0xFFFFFFFF
    return (k ^ 0x80000000).astype(np.int64)

def radix_steps(keys, kk):
    t, n_t, shift, steps = 0, len(keys), 30, 0
    while shift >= 0 and n_t != kk:
        one = 1 << shift
        c = [(keys >= t + j * one).sum() for j in (1, 2, 3)]
        inc = sum(ci >= kk for ci in c)
        if inc: n_t = c[inc - 1]
        t += inc << shift; shift -= 2; steps += 1
    return steps

def interp_steps(keys, kk, spread=1.0, minmax=True):
    # bracket [lo, hi): count(>=lo) >= kk > count(>=hi)
    steps = 0
    if minmax:
        lo, hi = int(keys.min()), int(keys.max()) + 1; steps += 1
    else:
        lo, hi = 0, 1 << 32
    c_lo, c_hi = len(keys), 0
    while hi - lo > 1 and c_lo != kk:
        n = c_lo - c_hi
        w = hi - lo
        e = lo + w * (c_lo - kk + 0.5) / n
        d = w * spread * max(np.sqrt(n), 1.0) / n
        piv = sorted({min(max(int(p), lo + 1), hi - 1) for p in (e - d, e, e + d)})
        # safeguard: if the interpolated bracket would not shrink, quarter
        c = [(keys >= p).sum() for p in piv]
        steps += 1
        new_lo, new_hi, cl, ch = lo, hi, c_lo, c_hi
        for p, ci in zip(piv, c):
            if ci >= kk and p > new_lo: new_lo, cl = p, ci
        for p, ci in zip(reversed(piv), reversed(c)):
            if ci < kk and p < new_hi: new_hi, ch = p, ci
        if (new_hi - new_lo) * 2 > w:  # poor shrink: quarter the new bracket next time
            lo, hi, c_lo, c_hi = new_lo, new_hi, cl, ch
            w = hi - lo
            piv = [lo + w * j // 4 for j in (1, 2, 3)]
            piv = sorted({min(max(p, lo + 1), hi - 1) for p in piv})
            c = [(keys >= p).sum() for p in piv]; steps += 1
            for p, ci in zip(piv, c):
                if ci >= kk and p > lo: lo, c_lo = p, ci
            for p, ci in zip(reversed(piv), reversed(c)):
                if ci < kk and p < hi: hi, c_hi = p, ci
        else:
            lo, hi, c_lo, c_hi = new_lo, new_hi, cl, ch
    return steps

def quest_rows(N, D=128, heavy=False):
    q = rng.standard_normal(D)
    k = rng.standard_normal((N, 16, D))
    if heavy:
        k[rng.random(N) < 0.02] *= 3
    return (np.maximum(q * k.min(1), q * k.max(1))).sum(1)

for name, gen in [("gauss", lambda N: rng.standard_normal(N)), ("quest", quest_rows), ("quest_heavy", lambda N: quest_rows(N, heavy=True)),
                  ("lognormal", lambda N: rng.lognormal(0, 2, N)), ("exp_neg", lambda N: -rng.exponential(1, N))]:
    for N, kk in [(8193, 512), (2049, 128)]:
        r, i1, i2 = [], [], []
        for _ in range(20):
            x = gen(N).astype(np.float32)
            ks = keys_of(x)
            r.append(radix_steps(ks, kk)); i1.append(interp_steps(ks, kk)); i2.append(interp_steps(ks, kk, spread=2.0))
        print(f"{name:12s} N={N:5d}: radix {np.mean(r):.1f} (max {max(r)}), interp {np.mean(i1):.1f} (max {max(i1)}), interp2 {np.mean(i2):.1f} (max {max(i2)})")

def value_steps(x, kk, spread=1.0):
    x = x.astype(np.float32)
    lo, hi = float(x.min()), float(np.nextafter(x.max(), np.float32(np.inf)))
    c_lo, c_hi, steps = len(x), 0, 1
    while c_lo != kk and np.nextafter(np.float32(lo), np.float32(hi)) < hi:
        n = c_lo - c_hi; w = hi - lo
        e = lo + w * (c_lo - kk + 0.5) / n
        d = w * spread * max(np.sqrt(n), 1.0) / n
        piv = sorted({float(np.clip(np.float32(p), np.nextafter(np.float32(lo), np.float32(hi)), np.nextafter(np.float32(hi), np.float32(lo)))) for p in (e - d, e, e + d)})
        c = [(x >= p).sum() for p in piv]; steps += 1
        nl, nh, cl, ch = lo, hi, c_lo, c_hi
        for p, ci in zip(piv, c):
            if ci >= kk and p > nl: nl, cl = p, ci
        for p, ci in zip(reversed(piv), reversed(c)):
            if ci < kk and p < nh: nh, ch = p, ci
        shrink = (nh - nl) / w
        lo, hi, c_lo, c_hi = nl, nh, cl, ch
        if shrink > 0.5:  # quarter next
            w = hi - lo
            piv = sorted({float(np.float32(lo + w * j / 4)) for j in (1, 2, 3)})
            piv = [p for p in piv if lo < p < hi]
            c = [(x >= p).sum() for p in piv]; steps += 1
            for p, ci in zip(piv, c):
                if ci >= kk and p > lo: lo, c_lo = p, ci
            for p, ci in zip(reversed(piv), reversed(c)):
                if ci < kk and p < hi: hi, c_hi = p, ci
    return steps

print("value-space interpolation")
for name, gen in [("gauss", lambda N: rng.standard_normal(N)), ("quest", quest_rows), ("quest_heavy", lambda N: quest_rows(N, heavy=True)),
                  ("lognormal", lambda N: rng.lognormal(0, 2, N)), ("exp_neg", lambda N: -rng.exponential(1, N))]:
    for N, kk in [(8193, 512), (2049, 128)]:
        v1, v2 = [], []
        for _ in range(20):
            x = gen(N).astype(np.float32)
            v1.append(value_steps(x, kk)); v2.append(value_steps(x, kk, 0.5))
        print(f"{name:12s} N={N:5d}: value {np.mean(v1):.1f} (max {max(v1)}), value s=0.5 {np.mean(v2):.1f} (max {max(v2)})")
