"""resolve_residency benchmark: the Triton kernel's tuning sweep, then kernel vs jnp reference.

Run on the GPU machine: `PYTHONPATH=. python3 -m bench.ops.resolve_residency` (a few minutes
on an H200). Writes `bench/results/resolve_residency-<backend>.json`; each figure carries its
baseline from the same run and the ratio, plus the issue's target.

  * the position map rule (`resolve_residency_mapped`, the default with a map) against the
    search rule's default kernel at N=64 and 256, both checked exact first, and
    `MAPPED_VARIANTS` (`bench_mapped`); HISPARSE_RESOLVE_MAPPED_ONLY=1 runs only this and
    writes `resolve_residency_mapped-<backend>.json`;
  * sweep: `RESOLVE_VARIANTS` at N=64 and N=256 (K=2048, H=4096); each candidate is first
    checked for exact equality (all 8 outputs) with the jnp reference over 4 chained decode
    steps from a cold state, then timed; the best by the sum of device time / target over
    the two N is printed as `BEST_TUNING resolve_residency <repr>`;
  * per N in {1, 8, 64, 256}: wall time of one public call (launch included, warm state) and
    device time per step (`fori_loop` chain of 100 dependent steps in one jit, minus one
    step) for the kernel's default tuning (`DEFAULT`) and the reference;
  * turnover: wall time of one public call per backend at N in {1, 8, 64, 256}, a warm state
    replayed with 5% of every row's top-k replaced (context 65,536);
  * union (`query_rows_per_request=2`, one speculative token), G in {8, 64} requests, K=2048,
    H=6144: device time per step of the union resolve (kernel, reference) and of the per-row
    ablation (two single-row kernel calls on the carried state), and the hit rate and rows
    copied per step of both (`bench_union`).
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import hisparse_jax as hj
from bench._common import time_fn
from bench.ops import BLOCK, INTERPRET, SMALL, Run, chain_us, pick_best, unrolled_us
from pallas_kernels.resolve_residency import reference
from pallas_kernels.resolve_residency import triton as kernel
from pallas_kernels.resolve_residency.triton import ResolveTuning

# The candidates of the sweep. The kernel is latency-bound: its time is a chain of dependent
# global round trips, dominated by the probe rounds (hash build, then one lookup per LRU
# chunk, each as long as the longest probe in the chunk). A sparser table (table_factor 8:
# load <= 1/8) shortens the longest linear-probe chain; chunk = H walks the LRU in one pass
# (walk and reorder fused); 16 warps keep the 4096-wide chunk at 8 values per thread (no
# spills); cached_loads lets the random probes of the row's table hit L1 instead of L2.
RESOLVE_VARIANTS: dict[str, ResolveTuning] = {
    "w8_c1024_t2": ResolveTuning(num_warps=8, chunk=1024, table_factor=2, cached_loads=False),
    "w8_c4096_t8": ResolveTuning(num_warps=8, chunk=4096, table_factor=8, cached_loads=False),
    "w16_c4096_t8": ResolveTuning(num_warps=16, chunk=4096, table_factor=8,
                                  cached_loads=False),
    "w16_c4096_t8_l1": ResolveTuning(num_warps=16, chunk=4096, table_factor=8,
                                     cached_loads=True),
    "w16_c4096_t4": ResolveTuning(num_warps=16, chunk=4096, table_factor=4,
                                  cached_loads=False),
    # Issue 14: 32 warps (4 values per thread per 4096-wide vector, shorter per-thread work
    # between the barriers) and a sparser table.
    "w32_c4096_t8": ResolveTuning(num_warps=32, chunk=4096, table_factor=8,
                                  cached_loads=False),
    "w32_c4096_t8_l1": ResolveTuning(num_warps=32, chunk=4096, table_factor=8,
                                     cached_loads=True),
    "w16_c4096_t16": ResolveTuning(num_warps=16, chunk=4096, table_factor=16,
                                   cached_loads=False),
    # Two rows per SM at N=256: 8 warps and a 2048-wide walk chunk take 128 registers per
    # thread, so two CTAs fit an SM (the default's 109 x 512 threads fit one: 1.94 waves).
    # Measured: the same kernel time as the default (`bench/NOTES-data_plane.md`).
    "w8_c2048_t8": ResolveTuning(num_warps=8, chunk=2048, table_factor=8, cached_loads=False),
}
NAMES = ("attention_rows", "valid_counts", "swap_src", "swap_dst", "swap_counts", "num_hits",
         "slot_rows", "lru")
TARGET_DEVICE_US = {64: 30.0, 256: 50.0}    # issue 14: device us per step at N=64, 256
SWEEP_BUDGET_S = 90.0                       # no new sweep candidate after this


def _inputs(n, k, hot, rng, steps):
    src_blocks = 3 * k // BLOCK
    src_table = 1 + rng.permutation(n * src_blocks).reshape(n, src_blocks).astype(np.int32)
    hot_table = 1 + rng.permutation(n * (hot // BLOCK)).reshape(n, hot // BLOCK)
    res_table = np.where(rng.random((n, src_blocks)) < 0.1,
                         rng.integers(1, 1 << 14, (n, src_blocks)), 0).astype(np.int32)
    # Decode-like drift: each step keeps ~90% of the previous selection.
    positions = src_blocks * BLOCK
    sel = [np.stack([rng.choice(positions, k, replace=False) for _ in range(n)])]
    for _ in range(steps - 1):
        nxt = sel[-1].copy()
        for r in range(n):
            fresh = np.setdiff1d(np.arange(positions), nxt[r])
            change = rng.choice(k, k // 10, replace=False)
            nxt[r, change] = rng.choice(fresh, k // 10, replace=False)
        sel.append(nxt)
    return (jnp.asarray(np.stack(sel).astype(np.int32)), jnp.asarray(src_table),
            jnp.asarray(hot_table.astype(np.int32)), jnp.asarray(res_table),
            (n * src_blocks + 1) * BLOCK)


def _step(tuning, tables, host_rows, rows_per_request=1):
    """(slot_rows, lru, topk) -> the 8 outputs of one resolve; tuning None = reference."""
    state_rows, hot_table, src_table, res_table = tables
    kw = dict(block_size=BLOCK, host_rows=host_rows, query_rows_per_request=rows_per_request)
    if tuning is None:
        return lambda slots, lru, topk: reference.resolve_residency(
            slots, lru, topk, state_rows, hot_table, src_table, res_table, **kw)
    return lambda slots, lru, topk: kernel.resolve_residency(
        slots, lru, topk, state_rows, hot_table, src_table, res_table, interpret=INTERPRET,
        tuning=tuning, **kw)


def _chain(step_fn, num_state: int = 2):
    """jit (*state, topks, iters) -> outputs of the last of `iters` chained steps; the state
    is the `num_state` outputs after the six results (2: slot_rows, lru; 3 for the map rule:
    and pos_slot)."""
    @jax.jit
    def chained(*args):
        *state, topks, iters = args

        def body(i, carry):
            return tuple(step_fn(*carry[6:6 + num_state], topks[i % topks.shape[0]]))
        first = step_fn(*state, topks[0])
        return jax.lax.fori_loop(1, iters, body, tuple(first))
    return chained


def sweep(run: Run, rng) -> dict[str, Any]:
    k, hot = (64, 128) if SMALL else (2048, 4096)
    sizes = (2,) if SMALL else (64, 256)
    targets = {**TARGET_DEVICE_US, 2: 1.0}      # 2: the small CPU shape
    chain = 3 if SMALL else 51
    out: dict[str, Any] = {"K": k, "H": hot, "sizes": list(sizes), "candidates": {}}
    inputs = {}
    for n in sizes:
        topks, src_table, hot_table, res_table, host_rows = _inputs(n, k, hot, rng, 4)
        tables = (jnp.arange(n, dtype=jnp.int32), hot_table, src_table, res_table)
        state = hj.init_hot_state(hj.HiSparseConfig(top_k=k, hot_size=hot, block_size=BLOCK,
                                                    max_num_reqs=n))
        ref = _chain(_step(None, tables, host_rows))(state.slot_rows, state.lru, topks,
                                                     jnp.int32(4))
        inputs[n] = (topks, tables, host_rows, state, [np.asarray(x) for x in ref])
    for name, tuning in RESOLVE_VARIANTS.items():
        entry: dict[str, Any] = {"tuning": repr(tuning)}
        out["candidates"][name] = entry
        if run.over_budget() and name != next(iter(RESOLVE_VARIANTS)):
            entry["error"] = "skipped: time budget"
            continue
        t0 = time.perf_counter()
        try:
            entry["exact"] = True
            for n in sizes:
                topks, tables, host_rows, state, want = inputs[n]
                chained = _chain(_step(tuning, tables, host_rows))
                got = chained(state.slot_rows, state.lru, topks, jnp.int32(4))
                bad = [nm for nm, g, w in zip(NAMES, got, want, strict=True)
                       if not np.array_equal(np.asarray(g), w)]
                if bad:
                    entry["exact"] = False
                    entry[f"N{n}_mismatch"] = bad
                    break
                # Timing starts from the state after the 4 checked steps (warm LRU).
                timing = chain_us(chained, (got[6], got[7], topks), chain)
                entry[f"N{n}"] = timing
                entry[f"N{n}_device_us"] = timing["us_per_step"]
            if entry["exact"]:
                entry["score"] = sum(entry[f"N{n}_device_us"] / targets[n] for n in sizes)
        except Exception as e:  # noqa: BLE001 - a failing candidate must not stop the sweep
            entry["error"] = f"{type(e).__name__}: {e}"[:2000]
        finally:
            entry["seconds"] = round(time.perf_counter() - t0, 2)
        run.table.append(f"  resolve {name:14s} " + (
            " ".join(f"N={n}: {entry[f'N{n}_device_us']:6.1f} us" for n in sizes)
            if "score" in entry else str(entry.get("error") or entry)[:100]))
        print(run.table[-1], flush=True)
    best = pick_best(out["candidates"], lambda r: r["score"])
    out["best"] = best
    if best is not None:
        tuning = RESOLVE_VARIANTS[best]
        run.best["resolve_residency"] = tuning
        for n in sizes:                     # the best again, as straight-line launches
            topks, tables, host_rows, state, want = inputs[n]
            step_fn = _step(tuning, tables, host_rows)

            def step(carry, i, step_fn=step_fn, topks=topks):
                return tuple(step_fn(carry[6], carry[7], topks[i % topks.shape[0]]))
            first = tuple(jnp.asarray(w) for w in want)
            try:
                out[f"best_N{n}_device_us_unrolled"] = unrolled_us(step, first,
                                                                   3 if SMALL else 16)
            except Exception as e:  # noqa: BLE001
                out[f"best_N{n}_unrolled_error"] = f"{type(e).__name__}: {e}"[:2000]
        run.table.append(f"  resolve best {best}: " + ", ".join(
            f"N={n} {out.get(f'best_N{n}_device_us_unrolled', float('nan')):.1f} us unrolled"
            f" (target {targets[n]})" for n in sizes))
        print(run.table[-1], flush=True)
    return out


def _device_us_per_step(step_fn, state, topks, chain_iters: int) -> float:
    """Device us per step of `step_fn(slot_rows, lru, topk) -> outputs (state last two)`:
    `chain_iters` dependent steps (topks cycled) in one jit, minus one step."""
    @functools.partial(jax.jit, static_argnames=("iters",))
    def chained(state, topks, *, iters):
        def body(i, st):
            outs = step_fn(st.slot_rows, st.lru, topks[i % topks.shape[0]])
            return hj.HotState(outs[-2], outs[-1])
        return jax.lax.fori_loop(0, iters, body, state)
    t1 = time_fn(lambda: chained(state, topks, iters=1), iters=5)
    tn = time_fn(lambda: chained(state, topks, iters=chain_iters), iters=5)
    return (tn["median_us"] - t1["median_us"]) / (chain_iters - 1)


def bench_n(run: Run, n: int, rng, steps: int = 8) -> dict[str, Any]:
    """Kernel (default tuning) and reference at batch size n: public-call wall time and
    device time per step."""
    k, hot = (64, 128) if SMALL else (2048, 4096)
    cfg = hj.HiSparseConfig(top_k=k, hot_size=hot, block_size=BLOCK, max_num_reqs=n)
    topks, src_table, hot_table, res_table, host_rows = _inputs(n, k, hot, rng, steps)
    tables = (jnp.arange(n, dtype=jnp.int32), hot_table, src_table, res_table)
    kw = dict(state_rows=tables[0], hot_block_table=hot_table, source_block_table=src_table,
              resident_block_table=res_table, block_size=BLOCK, host_rows=host_rows)
    out: dict[str, Any] = {"N": n, "K": k, "H": hot}
    chain_iters = 3 if SMALL else 100
    for backend, tuning in (("triton", kernel.DEFAULT), ("reference", None)):
        # Wall time of one public call (launch overhead included), state warmed up.
        state = hj.init_hot_state(cfg)
        for step in range(steps):
            _, state = hj.resolve_residency(state, topks[step], backend=backend,
                                            validate=False, **kw)
        call = functools.partial(hj.resolve_residency, state, topks[0], backend=backend,
                                 validate=False, **kw)
        out[backend] = time_fn(call, iters=20)

        # Device time per step: `chain_iters` dependent steps inside one jit.
        out[f"{backend}_device_us_per_step"] = _device_us_per_step(
            _step(tuning, tables, host_rows), state, topks, chain_iters)
    dev_k, dev_r = out["triton_device_us_per_step"], out["reference_device_us_per_step"]
    out["tuning"] = repr(kernel.DEFAULT)
    target = TARGET_DEVICE_US.get(n)
    out.update(speedup_vs_reference_device=dev_r / dev_k,
               speedup_vs_reference_wall=out["reference"]["median_us"]
               / out["triton"]["median_us"],
               target_device_us=target, target_speedup=5.0 if n == 64 else None)
    run.table.append(f"resolve N={n:3d}: {dev_k:7.1f} us/step device "
                     f"({out['triton']['median_us']:.0f} us wall), ref {dev_r:7.1f} us -> "
                     f"{out['speedup_vs_reference_device']:.1f}x"
                     + (f" (target <= {target} us)" if target else ""))
    return out


def bench_turnover(run: Run, n: int, rng) -> dict[str, Any]:
    """Public-op wall time per backend: a warm state replayed with 5% of every row's top-k
    replaced (the realistic mix of hits and misses)."""
    k, hot, context = (64, 128, 2048) if SMALL else (2048, 4096, 65536)
    cfg = hj.HiSparseConfig(top_k=k, hot_size=hot, block_size=BLOCK, max_num_reqs=n)
    pages = context // BLOCK
    src = (1 + np.arange(n * pages).reshape(n, pages)).astype(np.int32)
    hot_table = (1 + np.arange(n * cfg.hot_blocks).reshape(n, cfg.hot_blocks)).astype(np.int32)
    kw = dict(state_rows=jnp.arange(n, dtype=jnp.int32), hot_block_table=jnp.asarray(hot_table),
              source_block_table=jnp.asarray(src), block_size=BLOCK,
              host_rows=(n * pages + 1) * BLOCK, validate=False)  # the op alone
    sel = np.stack([rng.choice(context, k, replace=False) for _ in range(n)]).astype(np.int32)
    drift = sel.copy()
    for r in range(n):
        k_new = k // 20
        fresh = np.setdiff1d(rng.choice(context, 4 * k_new, replace=False), sel[r])[:k_new]
        drift[r, rng.choice(k, k_new, replace=False)] = fresh
    sel, drift = jnp.asarray(sel), jnp.asarray(drift)
    out: dict[str, Any] = {"N": n, "K": k, "H": hot}
    for backend in ("triton", "reference"):
        _, warm = hj.resolve_residency(hj.init_hot_state(cfg), sel, backend=backend, **kw)
        res, _ = hj.resolve_residency(warm, drift, backend=backend, **kw)
        t = time_fn(lambda warm=warm, backend=backend: hj.resolve_residency(
            warm, drift, backend=backend, **kw), iters=10 if n >= 64 else 20)
        out[backend] = {"misses": int(res.swap_counts.sum()), **t}
    out["speedup_vs_reference_wall"] = (out["reference"]["median_us"]
                                        / out["triton"]["median_us"])
    run.table.append(f"resolve turnover N={n:3d}: {out['triton']['median_us']:8.1f} us wall, "
                     f"ref {out['reference']['median_us']:8.1f} us "
                     f"({out['triton']['misses']} misses in the step)")
    return out


def _union_inputs(requests: int, r: int, k: int, hot: int, rng, steps: int,
                  new_share: float = 0.1):
    """Decode-like rows of r query rows per request: row 0 drifts like `_inputs`; each
    other row repeats row 0 with `new_share` of its positions replaced (speculative rows of
    one request select mostly the same positions). Returns (topks int32[steps, G*r, K],
    tables per query row (state_rows, hot, src, res), host_rows)."""
    topks, src_table, hot_table, res_table, host_rows = _inputs(requests, k, hot, rng, steps)
    sel = np.asarray(topks)
    positions = src_table.shape[1] * BLOCK
    rows = np.repeat(sel, r, axis=1)                                   # [steps, G*r, K]
    for step in range(steps):
        for grp in range(requests):
            fresh = np.setdiff1d(np.arange(positions), sel[step, grp])
            for j in range(1, r):
                change = rng.choice(k, int(k * new_share), replace=False)
                rows[step, grp * r + j, change] = rng.choice(fresh, change.size, replace=False)
    tables = (jnp.repeat(jnp.arange(requests, dtype=jnp.int32), r),
              *(jnp.repeat(t, r, axis=0) for t in (hot_table, src_table, res_table)))
    return jnp.asarray(rows.astype(np.int32)), tables, host_rows


def _ablation_step(tuning, tables, host_rows, r):
    """The per-row ablation as a step: r single-row resolves (rows j, j + r, ...) in a row on
    the carried state; returns the last one's outputs."""
    first = tuple(t[::r] for t in tables)
    single = _step(tuning, first, host_rows)

    def step(slots, lru, topk):
        for j in range(r):
            outs = single(slots, lru, topk[j::r])
            slots, lru = outs[6], outs[7]
        return outs
    return step


def bench_union(run: Run, requests: int, rng, r: int = 2, steps: int = 8) -> dict[str, Any]:
    """r = 2 query rows per request (one speculative token), K = 2048, H = 3 * K: device time
    per step of the union resolve (kernel, reference) and of the per-row ablation (kernel:
    r single-row calls on the carried state), and the hit rate and rows copied per step of
    both over `steps` drifting steps from a cold state (union: num_hits / swap_counts per
    request; ablation: summed over its r calls, so a position both rows select counts twice,
    a hit on the second call: compare rows copied, not only hit rates)."""
    k = 64 if SMALL else 2048
    hot = 3 * k
    cfg = hj.HiSparseConfig(top_k=k, hot_size=hot, block_size=BLOCK, max_num_reqs=requests,
                            num_speculative_tokens=r - 1)
    topks, tables, host_rows = _union_inputs(requests, r, k, hot, rng, steps)
    state_rows, hot_table, src_table, res_table = tables
    kw = dict(hot_block_table=hot_table, source_block_table=src_table,
              resident_block_table=res_table, block_size=BLOCK, host_rows=host_rows,
              validate=False)
    out: dict[str, Any] = {"requests": requests, "r": r, "K": k, "H": hot, "steps": steps}
    counts = {"union": [0, 0], "per_row": [0, 0]}                # hits, misses
    union_state = ablation_state = hj.init_hot_state(cfg)
    for step in range(steps):
        res, union_state = hj.resolve_residency(union_state, topks[step], state_rows=state_rows,
                                                query_rows_per_request=r, **kw)
        counts["union"][0] += int(res.num_hits.sum())
        counts["union"][1] += int(res.swap_counts.sum())
        for j in range(r):
            rows = slice(j, None, r)
            res, ablation_state = hj.resolve_residency(
                ablation_state, topks[step][rows], state_rows=state_rows[rows],
                **{name: v[rows] if name.endswith("table") else v for name, v in kw.items()})
            counts["per_row"][0] += int(res.num_hits.sum())
            counts["per_row"][1] += int(res.swap_counts.sum())
    for mode, (hits, misses) in counts.items():
        out[mode] = {"hits": hits, "rows_copied_per_step": misses / steps,
                     "hit_rate": hits / max(hits + misses, 1)}
    chain_iters = 3 if SMALL else 100
    warm = union_state
    for name, step_fn in (("union_triton", _step(kernel.DEFAULT, tables, host_rows, r)),
                          ("union_reference", _step(None, tables, host_rows, r)),
                          ("per_row_triton", _ablation_step(kernel.DEFAULT, tables, host_rows,
                                                            r))):
        out[f"{name}_device_us_per_step"] = _device_us_per_step(step_fn, warm, topks,
                                                                chain_iters)
    run.table.append(
        f"resolve union r={r} G={requests:3d}: {out['union_triton_device_us_per_step']:7.1f} us"
        f"/step device (ref {out['union_reference_device_us_per_step']:7.1f}, per-row "
        f"{out['per_row_triton_device_us_per_step']:7.1f}); hit rate "
        f"{out['union']['hit_rate']:.3f} vs per-row {out['per_row']['hit_rate']:.3f}, rows "
        f"copied/step {out['union']['rows_copied_per_step']:.0f} vs "
        f"{out['per_row']['rows_copied_per_step']:.0f}")
    return out


# Tunings of the position map kernel timed beside its default (`bench_mapped`): no hash table
# (table_factor unused); 8 / 32 warps per row and volatile scratch loads.
MAPPED_VARIANTS: dict[str, ResolveTuning] = {
    "w8_c4096_l1": ResolveTuning(num_warps=8, chunk=4096),
    "w32_c4096_l1": ResolveTuning(num_warps=32, chunk=4096),
    "w16_c4096": ResolveTuning(num_warps=16, chunk=4096, cached_loads=False),
}


def _mapped_step(tuning, tables, host_rows):
    """(slot_rows, lru, pos_slot, topk) -> the 9 outputs of one resolve under the position
    map rule; tuning None = its reference."""
    state_rows, hot_table, src_table, res_table = tables
    kw = dict(block_size=BLOCK, host_rows=host_rows)
    if tuning is None:
        return lambda slots, lru, pmap, topk: reference.resolve_residency_mapped(
            slots, lru, pmap, topk, state_rows, hot_table, src_table, res_table, **kw)
    return lambda slots, lru, pmap, topk: kernel.resolve_residency_mapped(
        slots, lru, pmap, topk, state_rows, hot_table, src_table, res_table,
        interpret=INTERPRET, tuning=tuning, **kw)


def bench_mapped(run: Run, rng) -> dict[str, Any]:
    """The position map rule (`resolve_residency_mapped`) against the search kernel's
    default, same inputs and warm state, N=64 and 256 (K=2048, H=4096): both checked exact
    first (the map rule's kernel against its reference and against the search reference
    over 4 chained steps from an empty state), then device us per step, chained and
    unrolled."""
    k, hot = (64, 128) if SMALL else (2048, 4096)
    sizes = (2,) if SMALL else (64, 256)
    chain = 3 if SMALL else 51
    unrolled = 3 if SMALL else 16
    out: dict[str, Any] = {"K": k, "H": hot, "tuning": repr(kernel.DEFAULT)}
    for n in sizes:
        topks, src_table, hot_table, res_table, host_rows = _inputs(n, k, hot, rng, 4)
        tables = (jnp.arange(n, dtype=jnp.int32), hot_table, src_table, res_table)
        state = hj.init_hot_state(hj.HiSparseConfig(top_k=k, hot_size=hot, block_size=BLOCK,
                                                    max_num_reqs=n))
        pmap = jnp.full((n, src_table.shape[1] * BLOCK), -1, jnp.int16)
        four = jnp.int32(4)
        s_step = _step(kernel.DEFAULT, tables, host_rows)
        m_step = _mapped_step(kernel.DEFAULT, tables, host_rows)
        search = _chain(s_step)
        mapped = _chain(m_step, num_state=3)
        want = [np.asarray(x) for x in _chain(_step(None, tables, host_rows))(
            state.slot_rows, state.lru, topks, four)]
        want_map = [np.asarray(x) for x in _chain(_mapped_step(None, tables, host_rows),
                                                  num_state=3)(
            state.slot_rows, state.lru, pmap, topks, four)]
        got_search = search(state.slot_rows, state.lru, topks, four)
        got = mapped(state.slot_rows, state.lru, pmap, topks, four)
        entry: dict[str, Any] = {
            "mapped_equals_its_reference": all(
                np.array_equal(np.asarray(a), b) for a, b in zip(got, want_map, strict=True)),
            "mapped_equals_search_reference": all(
                np.array_equal(np.asarray(a), b) for a, b in zip(got[:8], want, strict=True)),
            "search_equals_reference": all(
                np.array_equal(np.asarray(a), b) for a, b in zip(got_search, want,
                                                                 strict=True)),
            "hit_rate_last_checked_step": float(np.sum(want[5]) / max(
                1, np.sum(want[5]) + np.sum(want[4]))),
            "map_bytes_per_state_row": int(pmap.shape[1] * 2),
        }
        out[f"N{n}"] = entry
        if not (entry["mapped_equals_its_reference"] and entry["mapped_equals_search_reference"]
                and entry["search_equals_reference"]):
            raise AssertionError(f"N={n}: not exact: {entry}")
        entry["search_device_us"] = chain_us(search, (got_search[6], got_search[7], topks),
                                             chain)
        entry["mapped_device_us"] = chain_us(mapped, (got[6], got[7], got[8], topks), chain)
        entry["search_device_us_unrolled"] = unrolled_us(
            lambda c, i, f=s_step, tk=topks: tuple(f(c[6], c[7], tk[i % tk.shape[0]])),
            tuple(got_search), unrolled)
        entry["mapped_device_us_unrolled"] = unrolled_us(
            lambda c, i, f=m_step, tk=topks: tuple(f(c[6], c[7], c[8], tk[i % tk.shape[0]])),
            tuple(got), unrolled)
        for name, tuning in ({} if SMALL else MAPPED_VARIANTS).items():
            try:
                chained = _chain(_mapped_step(tuning, tables, host_rows), num_state=3)
                again = chained(state.slot_rows, state.lru, pmap, topks, four)
                if not all(np.array_equal(np.asarray(a), b)
                           for a, b in zip(again, want_map, strict=True)):
                    entry[f"variant_{name}"] = "not exact"
                    continue
                entry[f"variant_{name}_device_us"] = chain_us(
                    chained, (again[6], again[7], again[8], topks), chain)["us_per_step"]
            except Exception as e:  # noqa: BLE001 - a failing candidate must not stop the run
                entry[f"variant_{name}"] = f"{type(e).__name__}: {e}"[:500]
        base = entry["search_device_us"]["us_per_step"]
        fig = entry["mapped_device_us"]["us_per_step"]
        entry.update(speedup_chained=base / fig,
                     speedup_unrolled=entry["search_device_us_unrolled"]
                     / entry["mapped_device_us_unrolled"],
                     target_device_us=TARGET_DEVICE_US.get(n))
        run.table.append(
            f"  resolve N={n}: map rule {fig:6.1f} us chained / "
            f"{entry['mapped_device_us_unrolled']:6.1f} unrolled; search default {base:6.1f} / "
            f"{entry['search_device_us_unrolled']:6.1f} -> {entry['speedup_chained']:.2f}x / "
            f"{entry['speedup_unrolled']:.2f}x (target {TARGET_DEVICE_US.get(n)}); variants "
            + ", ".join(f"{v} {entry.get(f'variant_{v}_device_us', float('nan')):.1f}"
                        for v in ({} if SMALL else MAPPED_VARIANTS)))
        print(run.table[-1], flush=True)
    return out


def main() -> None:
    rng = np.random.default_rng(0)
    if os.environ.get("HISPARSE_RESOLVE_MAPPED_ONLY") == "1":   # the map rule alone: ~1 min
        run = Run("resolve_residency_mapped", sweep_budget_s=SWEEP_BUDGET_S)
        run.record("mapped_vs_search", lambda: bench_mapped(run, rng))
        run.finish(())
        return
    run = Run("resolve_residency", sweep_budget_s=SWEEP_BUDGET_S)
    run.table.append("position map rule against the search rule (device us per step):")
    run.record("mapped_vs_search", lambda: bench_mapped(run, rng))
    run.table.append("tuning sweep (device us per step):")
    run.record("sweep_resolve", lambda: sweep(run, rng))
    jax.clear_caches()
    for n in ((2,) if SMALL else (1, 8, 64, 256)):
        run.record(f"resolve_N{n}", lambda n=n: bench_n(run, n, rng))
    for n in ((2,) if SMALL else (1, 8, 64, 256)):
        run.record(f"turnover_N{n}", lambda n=n: bench_turnover(run, n, rng))
    for g in ((2,) if SMALL else (8, 64)):
        run.record(f"union_r2_G{g}", lambda g=g: bench_union(run, g, rng))
    run.finish(("resolve_residency",))


if __name__ == "__main__":
    main()
