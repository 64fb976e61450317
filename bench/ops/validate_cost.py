"""What the data-plane ops' default value checks (`validate=None`) cost, against
`validate=False` in the same run, at engine-like sizes (`hisparse_jax/ops/_values.py`).

  PYTHONPATH=. python3 -m bench.ops --validate-cost      (or python3 -m bench.ops.validate_cost)

Writes `bench/results/validate_cost-<backend>.json` (`--out PATH`: elsewhere). Per op
(resolve_residency at N=64, K=2048, H=4096, B=64 with 5% turnover; gather_compact_group of
its swap plan into 2 layers; mirror_rows_group of 16 pages into 2 layers; sparse_mla_decode
at N=64, K=2048, 576-wide bf16 rows, 128 heads on a GPU, 16 off it):

  * host_check: the host value check alone (`_values.*_host` on the arrays where they live:
    the device -> host copy included), median us;
  * eager: one public call outside jit, default vs validate=False (the difference is what a
    caller outside jit pays by default);
  * jit: the op inside a jitted function, default (checkify debug checks, which make the
    function dispatch through jax's Python path) vs validate=False;
  * checkified (not sparse_mla_decode: it has no traced check): the jitted default under
    `checkify.checkify`, the device cost of the checks when asked for;
  * debug_check_dispatch: a tiny jitted function with and without one debug check (the
    fixed dispatch cost of the effect, what "jit" adds per call whatever the op).
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

import hisparse_jax as hj
from bench._common import HelpFormatter, time_fn
from bench.ops import BLOCK, INTERPRET, SMALL, WIDTH, Run, rand_bf16, sharding
from hisparse_jax.ops import _values

HOST, DEVICE = sharding("pinned_host"), sharding("device")
N, K, HOT, CONTEXT = (4, 64, 128, 2048) if SMALL else (64, 2048, 4096, 65536)
HEADS = 16 if SMALL or INTERPRET else 128


def _pair(run_default, run_off, iters: int) -> dict[str, Any]:
    """Median us of both paths (alternating twice, the lower median of each kept), and the
    difference."""
    a = [time_fn(run_default, iters=iters) for _ in range(2)]
    b = [time_fn(run_off, iters=iters) for _ in range(2)]
    default = min(x["median_us"] for x in a)
    off = min(x["median_us"] for x in b)
    return {"default_us": default, "validate_false_us": off, "cost_us": default - off}


def _timed(fn, iters: int) -> dict[str, Any]:
    return {"median_us": time_fn(fn, iters=iters)["median_us"]}


def _jit_pair(op, args, iters: int, checkified: bool = True) -> dict[str, Any]:
    """`_pair` of op(*args, validate=v) jitted (jit and, if asked, checkified)."""
    default = jax.jit(functools.partial(op, validate=None))
    off = jax.jit(functools.partial(op, validate=False))
    out = {"jit": _pair(lambda: default(*args), lambda: off(*args), iters)}
    if checkified:
        checked = checkify.checkify(default, errors=checkify.user_checks)
        out["checkified"] = _pair(lambda: checked(*args)[1], lambda: off(*args), iters)
    return out


def resolve_inputs(rng):
    """A warm hot state and a 5%-turnover selection (`resolve_residency.bench_turnover`)."""
    cfg = hj.HiSparseConfig(top_k=K, hot_size=HOT, block_size=BLOCK, max_num_reqs=N)
    pages = CONTEXT // BLOCK
    src = (1 + np.arange(N * pages).reshape(N, pages)).astype(np.int32)
    hot = (1 + np.arange(N * cfg.hot_blocks).reshape(N, cfg.hot_blocks)).astype(np.int32)
    kw = dict(state_rows=jnp.arange(N, dtype=jnp.int32), hot_block_table=jnp.asarray(hot),
              source_block_table=jnp.asarray(src), block_size=BLOCK,
              host_rows=(N * pages + 1) * BLOCK)
    sel = np.stack([rng.choice(CONTEXT, K, replace=False) for _ in range(N)]).astype(np.int32)
    drift = sel.copy()
    for r in range(N):
        fresh = np.setdiff1d(rng.choice(CONTEXT, K // 5, replace=False), sel[r])[:K // 20]
        drift[r, rng.choice(K, fresh.size, replace=False)] = fresh
    _, warm = hj.resolve_residency(hj.init_hot_state(cfg), jnp.asarray(sel), validate=False,
                                   **kw)
    return warm, jnp.asarray(drift), kw, int(N * cfg.hot_blocks + 1)


def bench_resolve(warm, drift, kw) -> dict[str, Any]:
    args = (warm, drift, kw["state_rows"], kw["hot_block_table"], kw["source_block_table"],
            BLOCK, kw["host_rows"])
    out: dict[str, Any] = {"N": N, "K": K, "H": HOT, "B": BLOCK}
    out["host_check"] = _timed(lambda: _values.resolve_host(*args), 10)
    call = functools.partial(hj.resolve_residency, warm, drift, **kw)
    out["eager"] = _pair(lambda: call(validate=None), lambda: call(validate=False), 10)

    def op(state, topk, validate):
        return hj.resolve_residency(state, topk, validate=validate, **kw)
    out.update(_jit_pair(op, (warm, drift), 10))
    return out


def bench_copies(rng, plan, num_blocks: int) -> dict[str, Any]:
    """gather_compact_group of the resolve's swap plan, and mirror_rows_group of 16 pages,
    both into 2 layers."""
    src, dst, counts = plan
    host_rows = 1 << (10 if SMALL else 16)                   # a 75 MB pool per layer
    src = jnp.where(src >= 0, src % host_rows, -1)          # only destinations must differ
    pools = tuple(jax.device_put(rand_bf16(rng, (host_rows, WIDTH)), HOST) for _ in range(2))
    caches = [tuple(jax.device_put(jnp.zeros((num_blocks, BLOCK, WIDTH), jnp.bfloat16), DEVICE)
                    for _ in range(2))]
    out: dict[str, Any] = {"misses": int(jnp.sum(counts)), "plan_shape": list(src.shape)}
    out["gather_host_check"] = _timed(
        lambda: _values.plan_host(src, dst, counts, num_blocks * BLOCK), 10)

    def gather(validate):
        caches[0] = hj.ops.gather_compact_group(pools, caches[0], src, dst, counts,
                                                validate=validate)
        return caches[0]
    out["gather_eager"] = _pair(lambda: gather(None), lambda: gather(False), 10)
    pages = min(16, num_blocks, host_rows // BLOCK)
    dev = jnp.asarray((rng.permutation(num_blocks)[:pages, None] * BLOCK
                       + np.arange(BLOCK)).reshape(-1).astype(np.int32))
    host = jnp.asarray((rng.permutation(host_rows // BLOCK)[:pages, None] * BLOCK
                        + np.arange(BLOCK)).reshape(-1).astype(np.int32))
    out["mirror_host_check"] = _timed(
        lambda: _values.mirror_host(dev, host, num_blocks * BLOCK, host_rows), 10)
    holder = [pools]

    def mirror(validate):
        holder[0] = hj.ops.mirror_rows_group(caches[0], holder[0], dev, host,
                                             validate=validate)
        return holder[0]
    out["mirror_eager"] = _pair(lambda: mirror(None), lambda: mirror(False), 10)
    return out


def bench_attention(rng, num_blocks: int) -> dict[str, Any]:
    q = jnp.asarray(rand_bf16(rng, (N, HEADS, WIDTH)))
    kv = jax.device_put(rand_bf16(rng, (num_blocks, BLOCK, WIDTH)), DEVICE)
    rows = jnp.asarray(rng.integers(0, num_blocks * BLOCK, (N, K)).astype(np.int32))
    out: dict[str, Any] = {"N": N, "K": K, "heads": HEADS, "rows_in_cache": num_blocks * BLOCK}
    out["host_check"] = _timed(lambda: _values.attention_host(rows, num_blocks * BLOCK), 20)

    def op(q, kv, rows, validate):
        return hj.sparse_mla_decode(q, kv, rows, sm_scale=0.07, validate=validate)
    out["eager"] = _pair(lambda: op(q, kv, rows, None), lambda: op(q, kv, rows, False), 10)
    out.update(_jit_pair(op, (q, kv, rows), 10, checkified=False))
    return out


def bench_dispatch() -> dict[str, Any]:
    """The fixed cost of a debug check in a jitted function (its effect sends the call
    through jax's Python dispatch path): a tiny function with and without one."""
    x = jnp.arange(8, dtype=jnp.int32)

    def body(x, check):
        if check:
            checkify.debug_check(jnp.all(x >= 0), "x must be >= 0")
        return x + 1
    checked = jax.jit(functools.partial(body, check=True))
    plain = jax.jit(functools.partial(body, check=False))
    return {"jit": _pair(lambda: checked(x), lambda: plain(x), 200)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--out", type=Path, default=None,
                   help="result file (default: bench/results/validate_cost-<backend>.json)")
    args = p.parse_args(argv)
    run = Run("validate_cost", sweep_budget_s=0.0, path=args.out)
    rng = np.random.default_rng(0)
    warm, drift, kw, num_blocks = resolve_inputs(rng)
    res, _ = hj.resolve_residency(warm, drift, validate=False, **kw)
    plan = (res.swap_src, res.swap_dst, res.swap_counts)
    run.record("resolve_residency", lambda: bench_resolve(warm, drift, kw))
    run.record("copies", lambda: bench_copies(rng, plan, num_blocks))
    run.record("sparse_mla_decode", lambda: bench_attention(rng, num_blocks))
    run.record("debug_check_dispatch", bench_dispatch)
    for name, fig in run.results.items():
        for key, val in (fig.items() if isinstance(fig, dict) else ()):
            if isinstance(val, dict) and "cost_us" in val:
                run.table.append(f"{name:18s} {key:18s} default {val['default_us']:9.1f} us, "
                                 f"validate=False {val['validate_false_us']:9.1f} us, cost "
                                 f"{val['cost_us']:8.1f} us")
            elif isinstance(val, dict) and "median_us" in val:
                run.table.append(f"{name:18s} {key:18s} {val['median_us']:9.1f} us")
    run.finish()


if __name__ == "__main__":
    main()
