"""Test support: reference copy functions and a simulated serving loop with ground truth (jax).

`mirror_rows_reference` / `restore_rows_reference` are jnp twins of the data-plane copy contract
(see `host_tier/worker/transfer.py`). They compute on a device copy of the pool, so they are for
CPU tests and small pools only. The real ops (`hisparse_jax.ops.mirror_rows` / `restore_rows`)
are passed in by the caller: this module does not import the data plane.

`SimulatedServer` drives a `Coordinator` and a `TransferEngine` the way a serving loop does, with
a toy model whose KV row for position t is a known function of the token prefix `tokens[:t+1]`.
After every step it checks that every row a request can read (resident, hot or host) holds
exactly what was written for that token. It can inject copy faults (`spill_fault_rate`,
`restore_fault_rate`: a copy call raises before it touches anything), which the transfer engine
reports failed: the coordinator spills failed pages again, and requests whose restore failed are
aborted at once, as an engine would.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from host_tier.plan import StepPlan
from host_tier.scheduler.block_pool import NULL_BLOCK
from host_tier.scheduler.coordinator import Coordinator
from host_tier.scheduler.records import Admitted, Wait
from host_tier.sizes import cdiv, pow2_bucket
from host_tier.worker.device_tables import DeviceBlockTables
from host_tier.worker.host_pool import HostPool
from host_tier.worker.transfer import MIN_ROWS_BUCKET, MirrorFn, RestoreFn, TransferEngine


def _copy_rows(src: jax.Array, dst: jax.Array, src_rows: jax.Array,
               dst_rows: jax.Array) -> jax.Array:
    width = dst.shape[-1]
    flat_src = src.reshape(-1, width)
    flat_dst = dst.reshape(-1, width)
    ok = ((src_rows >= 0) & (src_rows < flat_src.shape[0])
          & (dst_rows >= 0) & (dst_rows < flat_dst.shape[0]))
    rows = flat_src[jnp.clip(src_rows, 0, flat_src.shape[0] - 1)].astype(dst.dtype)
    index = jnp.where(ok, dst_rows, flat_dst.shape[0])  # out of range: dropped
    return flat_dst.at[index].set(rows, mode="drop").reshape(dst.shape)


@functools.cache
def _mirror_jit(host_sharding: jax.sharding.Sharding):
    device = next(iter(host_sharding.device_set))
    on_device = jax.sharding.SingleDeviceSharding(device, memory_kind="device")

    def mirror(kv_cache, host_pool, device_rows, host_rows):
        host_pool = jax.device_put(host_pool, on_device)
        return _copy_rows(kv_cache, host_pool, device_rows, host_rows)

    return jax.jit(mirror, donate_argnums=(1,), out_shardings=host_sharding)


@functools.cache
def _restore_jit(device_sharding: jax.sharding.Sharding):
    device = next(iter(device_sharding.device_set))
    on_device = jax.sharding.SingleDeviceSharding(device, memory_kind="device")

    def restore(host_pool, kv_cache, host_rows, device_rows):
        host_pool = jax.device_put(host_pool, on_device)
        return _copy_rows(host_pool, kv_cache, host_rows, device_rows)

    return jax.jit(restore, donate_argnums=(1,), out_shardings=device_sharding)


def mirror_rows_reference(kv_cache: jax.Array, host_pool: jax.Array, device_rows: jax.Array,
                          host_rows: jax.Array) -> jax.Array:
    """Host row `host_rows[i]` := device row `device_rows[i]`; bad entries skipped; donates
    `host_pool` and returns it in its memory kind."""
    return _mirror_jit(host_pool.sharding)(kv_cache, host_pool, device_rows, host_rows)


def restore_rows_reference(host_pool: jax.Array, kv_cache: jax.Array, host_rows: jax.Array,
                           device_rows: jax.Array) -> jax.Array:
    """Device row `device_rows[i]` := host row `host_rows[i]`; bad entries skipped; donates
    `kv_cache`."""
    return _restore_jit(kv_cache.sharding)(host_pool, kv_cache, host_rows, device_rows)


@functools.partial(jax.jit, donate_argnums=(0,))
def _write_rows(kv_cache: jax.Array, rows: jax.Array, values: jax.Array) -> jax.Array:
    width = kv_cache.shape[-1]
    flat = kv_cache.reshape(-1, width)
    index = jnp.where(rows >= 0, rows, flat.shape[0])
    return flat.at[index].set(values, mode="drop").reshape(kv_cache.shape)


def _pad(values: np.ndarray, fill: int | float) -> np.ndarray:
    """`values` padded along axis 0 with `fill`, like the engine's row lists."""
    n = values.shape[0]
    out = np.full((pow2_bucket(n, MIN_ROWS_BUCKET),) + values.shape[1:], fill, values.dtype)
    out[:n] = values
    return out


class InjectedFault(RuntimeError):
    """A copy fault `SimulatedServer` injects."""


@dataclasses.dataclass
class _SimRequest:
    tokens: list[int]
    keys: list[int]  # keys[t]: 64-bit fingerprint of tokens[:t+1]


class SimulatedServer:
    """A serving loop around a `Coordinator` and `TransferEngine` with a ground-truth model.

    The KV row of layer l at position t of a request is `[k1, k2, t, l]` (float32, exact), where
    k1, k2 are 20-bit fingerprints of `tokens[:t+1]`: requests sharing a prefix write the same
    rows, as a real model would. The hot region is modelled by a slot -> host row map per state
    row, filled with real host -> device copies.

    `mirror_fn` / `restore_fn` are the engine's copies (see `host_tier/worker/transfer.py`);
    they default to the jnp references above. Pass the data plane's
    (`hisparse_jax.ops.mirror_rows` / `restore_rows`) to test it end to end.
    `resident_prefix_hits` goes to the coordinator (hit pages restored into resident blocks).
    `layers_per_array` packs the pool (`HostPool`: that many layers side by side per array).
    """

    def __init__(self, *, block_size: int = 4, num_gpu_blocks: int = 24,
                 num_host_blocks: int = 40, hot_size: int = 8, top_k: int = 4,
                 max_num_reqs: int = 6, max_model_len: int = 48, num_layers: int = 2,
                 row_width: int = 4, mirror_fn: MirrorFn | None = None,
                 restore_fn: RestoreFn | None = None, seed: int = 0,
                 spill_fault_rate: float = 0.0, restore_fault_rate: float = 0.0,
                 resident_prefix_hits: bool = False, layers_per_array: int = 1) -> None:
        if row_width < 4:
            raise ValueError("SimulatedServer.row_width must be >= 4")
        self.B = block_size
        self.top_k = top_k
        self.hot_size = hot_size
        self.max_model_len = max_model_len
        self.num_layers = num_layers
        self.row_width = row_width
        hot_blocks = cdiv(hot_size, block_size)
        self.coord = Coordinator(block_size=block_size, num_gpu_blocks=num_gpu_blocks,
                                 num_host_blocks=num_host_blocks, hot_blocks=hot_blocks,
                                 max_num_reqs=max_num_reqs, max_model_len=max_model_len,
                                 resident_prefix_hits=resident_prefix_hits)
        self.pool = HostPool(num_layers=num_layers, block_size=block_size, row_width=row_width,
                             dtype=np.float32, num_blocks=num_host_blocks,
                             layers_per_array=layers_per_array)
        # Faults come from their own generator: without them the run is the same as before.
        self.fault_rng = random.Random(seed ^ 0x5EED)
        self.fault_rates = {"spill_faults": spill_fault_rate,
                            "restore_faults": restore_fault_rate}
        self.engine = TransferEngine(
            self.pool, mirror_fn=self._faulty(mirror_fn or mirror_rows_reference, "spill_faults"),
            restore_fn=self._faulty(restore_fn or restore_rows_reference, "restore_faults"))
        self.restore_fn = restore_fn or restore_rows_reference
        self.tables = DeviceBlockTables(max_num_reqs, self.coord.max_pages, hot_blocks)
        device = jax.devices()[0]
        self.kv = [jax.device_put(np.zeros((num_gpu_blocks, block_size, row_width), np.float32),
                                  device) for _ in range(num_layers)]
        self.requests: dict[Hashable, _SimRequest] = {}
        self.hot: dict[int, dict[int, int]] = {}  # state row -> {slot: host row}
        self.hot_lru: dict[int, list[int]] = {}  # state row -> slots, oldest first
        self.backlog_enqueued: list[int] = []
        self.backlog_completed: list[int] = []
        self.rng = random.Random(seed)
        self.counters = dict(steps=0, writes=0, hot_hits=0, hot_misses=0, waits=0,
                             checked_rows=0, stall_preemptions=0, spill_faults=0,
                             restore_faults=0, failed_transfers=0, aborted_on_failure=0)
        self._admitted_this_pass: set[Hashable] = set()
        self._pass_open = False  # decisions made that the worker has not received yet
        self.preempted: list[list[int]] = []  # token lists of preempted requests, to resume
        # Worker-side record, independent of the coordinator: the last spill into each host
        # block, and the spills whose completion was delivered to the coordinator.
        self.last_spill_into: dict[int, int] = {}
        self.delivered_completions: set[int] = set()

    def _faulty(self, copy_fn, counter: str):
        """`copy_fn`, raising `InjectedFault` (before touching anything) at the fault rate."""

        def copy(*args):
            rate = self.fault_rates[counter]
            if rate and self.fault_rng.random() < rate:
                self.counters[counter] += 1
                raise InjectedFault(f"injected {counter[:-1]}")
            return copy_fn(*args)

        return copy

    # ------------------------------------------------------------------ ground truth

    def truth(self, request_id: Hashable, positions: np.ndarray, layer: int) -> np.ndarray:
        keys = np.array(self.requests[request_id].keys, np.uint64)[positions]
        out = np.zeros((positions.shape[0], self.row_width), np.float32)
        out[:, 0] = (keys & np.uint64(0xFFFFF)).astype(np.float32)
        out[:, 1] = ((keys >> np.uint64(20)) & np.uint64(0xFFFFF)).astype(np.float32)
        out[:, 2] = positions
        out[:, 3] = layer
        return out

    def _extend_keys(self, req: _SimRequest) -> None:
        key = req.keys[-1] if req.keys else 0x9E3779B97F4A7C15
        for tok in req.tokens[len(req.keys):]:
            key = (key * 0x100000001B3 ^ (tok + 0x51ED27)) & 0xFFFFFFFFFFFFFFFF
            key ^= key >> 29
            req.keys.append(key)

    # ------------------------------------------------------------------ scheduler actions

    def admit(self, request_id: Hashable, prompt: Sequence[int],
              num_new_tokens: int | None = None) -> Admitted | Wait:
        result = self.coord.admit(request_id, prompt, num_new_tokens=num_new_tokens)
        if isinstance(result, Admitted):
            req = _SimRequest(tokens=list(prompt), keys=[])
            self._extend_keys(req)
            self.requests[request_id] = req
            self._admitted_this_pass.add(request_id)
            self._pass_open = True
        else:
            self.counters["waits"] += 1
        return result

    def release(self, request_id: Hashable, how: str) -> list[int]:
        """finish / cancel / preempt / abort; returns the request's tokens. Preempted requests'
        tokens are also kept in `preempted`, to be resumed (re-admitted) later."""
        getattr(self.coord, how)(request_id)
        self._admitted_this_pass.discard(request_id)
        tokens = self.requests.pop(request_id).tokens
        if how == "preempt":
            self.preempted.append(tokens)
        return tokens

    def step(self, *, max_chunk: int | None = None, preempt_on_stall: bool = True) -> StepPlan:
        """One pass: schedule every running request, then build and execute the plan.

        Like a real scheduler, when every running request had to wait and no copy is in flight
        that could release blocks, the most recently admitted waiting request is preempted.
        """
        scheduled = bool(self._admitted_this_pass)
        waited = []
        for rid in list(self.coord.request_ids):
            if rid in self._admitted_this_pass:
                continue
            req = self.requests[rid]
            computed = self.coord.view(rid).num_computed_tokens
            if computed < len(req.tokens):  # rest of a chunked prompt
                todo = len(req.tokens) - computed
                n = min(todo, max_chunk) if max_chunk else todo
                result = self.coord.schedule(rid, n)
            elif len(req.tokens) >= self.max_model_len:
                self.release(rid, "finish")
                continue
            else:
                token = self.rng.randrange(5)
                result = self.coord.schedule(rid, new_token_ids=[token])
                if result is None:
                    req.tokens.append(token)
                    self._extend_keys(req)
            if result is None:
                scheduled = True
            else:
                self.counters["waits"] += 1
                waited.append(rid)
        if (preempt_on_stall and waited and not scheduled
                and not self.coord.has_pending_transfers() and not self.engine.num_in_flight
                and not self.coord.spill_planner.num_retries):  # the plan below spills those
            self.release(waited[-1], "preempt")
            self.counters["stall_preemptions"] += 1
        self._admitted_this_pass.clear()
        plan = self.coord.build_plan()
        self._pass_open = False
        self.execute(plan)
        return plan

    def deliver(self, fraction: float = 1.0) -> None:
        """Hands a random subset of the worker's reports to the coordinator, shuffled."""
        report = self.engine.poll()
        self._take_failures(report.failed)
        self.backlog_enqueued += report.enqueued
        self.backlog_completed += report.completed
        enq = [t for t in self.backlog_enqueued if self.rng.random() < fraction]
        done = [t for t in self.backlog_completed if self.rng.random() < fraction]
        self.rng.shuffle(enq)
        self.rng.shuffle(done)
        self.backlog_enqueued = [t for t in self.backlog_enqueued if t not in set(enq)]
        self.backlog_completed = [t for t in self.backlog_completed if t not in set(done)]
        self.coord.on_transfers(enqueued=enq, completed=done)
        self.delivered_completions.update(done)

    def drain(self) -> None:
        """Waits for every copy and delivers every report."""
        report = self.engine.poll(wait=True)
        self._take_failures(report.failed)
        self.backlog_enqueued += report.enqueued
        self.backlog_completed += report.completed
        self.coord.on_transfers(enqueued=self.backlog_enqueued, completed=self.backlog_completed)
        self.delivered_completions.update(self.backlog_completed)
        self.backlog_enqueued = []
        self.backlog_completed = []

    # ------------------------------------------------------------------ worker

    def execute(self, plan: StepPlan) -> None:
        self.counters["steps"] += 1
        published = self.coord.host_pool.published_blocks()
        for spill in plan.spills:
            assert spill.host_block not in published, "spill into a published host block"
            self.last_spill_into[spill.host_block] = spill.transfer_id
        self.tables.apply(plan.tables)
        tables = self.tables.as_numpy()
        for row in plan.hot_resets:
            self.hot[row] = {}
            self.hot_lru[row] = []
        for inv in plan.hot_invalidations:
            slots = self.hot.setdefault(inv.state_row, {})
            for slot, g in list(slots.items()):
                if g // self.B in inv.host_blocks:
                    del slots[slot]
                    self.hot_lru[inv.state_row].remove(slot)
        self.kv = self.engine.before_forward(plan, self.kv)
        self._forward(plan, tables)
        self.engine.after_forward(plan, self.kv)
        self._read_hot(tables)
        report = self.engine.poll()
        self._take_failures(report.failed)
        self.backlog_enqueued += report.enqueued
        self.backlog_completed += report.completed

    def _take_failures(self, failed: Sequence[int]) -> None:
        """Failed transfers go to the coordinator at once (before any later completion, as the
        transfer engine's reports order them); requests whose restore failed are aborted."""
        if not failed:
            return
        self.counters["failed_transfers"] += len(failed)
        self.coord.on_transfers(failed=failed)
        for rid in self.coord.failed_requests():
            self.release(rid, "abort")
            self.counters["aborted_on_failure"] += 1

    def _forward(self, plan: StepPlan, tables: dict[str, np.ndarray]) -> None:
        rows, values = [], [[] for _ in range(self.num_layers)]
        for w in plan.writes:
            pos = np.arange(w.start, w.start + w.num_tokens)
            blocks = tables["res"][w.state_row, pos // self.B]
            assert (blocks != NULL_BLOCK).all(), "a written position has no resident page"
            rows.append(blocks * self.B + pos % self.B)
            for layer in range(self.num_layers):
                values[layer].append(self.truth(w.request_id, pos, layer))
            self.counters["writes"] += w.num_tokens
        if not rows:
            return
        flat_rows = _pad(np.concatenate(rows).astype(np.int32), -1)
        for layer in range(self.num_layers):
            vals = _pad(np.concatenate(values[layer]), 0)
            self.kv[layer] = _write_rows(self.kv[layer], jnp.asarray(flat_rows),
                                         jnp.asarray(vals))

    def _read_hot(self, tables: dict[str, np.ndarray]) -> None:
        """The data plane's top-k reads of host-backed positions, through each hot region."""
        src_rows, dst_rows = [], []
        for rid in self.coord.request_ids:
            view = self.coord.view(rid)
            row = view.state_row
            if tables["hot"][row, 0] == NULL_BLOCK:
                continue
            computed = view.num_computed_tokens
            pos = np.arange(computed)
            host_read = pos[tables["res"][row, pos // self.B] == NULL_BLOCK]
            if host_read.size == 0:
                continue
            picks = self.rng.sample(list(host_read), min(self.top_k, host_read.size))
            slots = self.hot.setdefault(row, {})
            lru = self.hot_lru.setdefault(row, [])
            in_use = set()
            for t in picks:
                g = int(tables["src"][row, t // self.B]) * self.B + t % self.B
                assert g >= self.B, "a host-backed position has no host block"
                hit = next((s for s, h in slots.items() if h == g), None)
                if hit is not None:
                    self.counters["hot_hits"] += 1
                    lru.remove(hit)
                    lru.append(hit)
                    in_use.add(hit)
                    continue
                free = [s for s in range(self.hot_size) if s not in slots]
                slot = free[0] if free else next(s for s in lru if s not in in_use)
                if slot in slots:
                    lru.remove(slot)
                slots[slot] = g
                lru.append(slot)
                in_use.add(slot)
                src_rows.append(g)
                dst_rows.append(int(tables["hot"][row, slot // self.B]) * self.B
                                + slot % self.B)
                self.counters["hot_misses"] += 1
        if src_rows:
            src = _pad(np.array(src_rows, np.int32), -1)
            dst = jnp.asarray(_pad(np.array(dst_rows, np.int32), -1))
            for layer in range(self.num_layers):
                self.kv[layer] = self.restore_fn(
                    self.pool.layer(layer), self.kv[layer],
                    jnp.asarray(self.pool.layer_rows(layer, src)), dst)

    # ------------------------------------------------------------------ checks

    def _durable(self, host_block: int) -> bool:
        """Whether the worker's last copy into `host_block` was reported completed."""
        tid = self.last_spill_into.get(host_block)
        return tid is not None and tid in self.delivered_completions

    def verify(self) -> None:
        """Coordinator invariants, tables, and every readable row against ground truth.

        Between an admission and the next `step` the worker has not received the pass's
        decisions yet; only the coordinator-side checks apply then.
        """
        self.coord.check_invariants()
        for block in self.coord.host_pool.published_blocks():
            assert self._durable(block), f"host block {block} is published before its copy " \
                                         "completed"
        if self._pass_open:
            return
        tables = self.tables.as_numpy()
        kv = [np.array(a, copy=True).reshape(-1, self.row_width) for a in self.kv]
        g = self.pool.layers_per_array
        arrays = [np.array(a, copy=True).reshape(-1, g, self.row_width) for a in self.pool.arrays]
        host = [arrays[layer // g][:, layer % g] for layer in range(self.num_layers)]
        B = self.B
        for rid in self.coord.request_ids:
            view = self.coord.view(rid)
            row = view.state_row
            n = view.num_computed_tokens
            # The device tables equal the coordinator's (only changed rows were re-sent).
            for group, blocks in (("src", view.host_blocks), ("res", view.resident_blocks),
                                  ("hot", view.hot_blocks)):
                want = np.zeros(tables[group].shape[1], np.int32)
                want[:len(blocks)] = blocks
                assert np.array_equal(tables[group][row], want), f"{group} table of {rid!r}"
            num_pages = len(view.resident_blocks)
            assert not [p for p in view.unpinned_pages if p >= num_pages - 2], (
                f"{rid!r}: one of its last 2 pages is unpinned")
            for p in range(max(num_pages - 2, 0), num_pages):
                block = view.resident_blocks[p]
                assert block == NULL_BLOCK or self.coord.device_pool.ref_count(block) > 0, (
                    f"{rid!r}: tail page {p} is not pinned")
            if NULL_BLOCK in view.resident_blocks:
                assert (tables["hot"][row] != NULL_BLOCK).all(), (
                    f"{rid!r}: reads pages from host but owns no hot region")
            for p, block in enumerate(view.resident_blocks):
                if block == NULL_BLOCK or p in view.unpinned_pages:
                    assert self._durable(view.host_blocks[p]), (
                        f"{rid!r}: page {p} may be read from host before its copy completed")
            if n == 0:
                continue
            pos = np.arange(n)
            res = tables["res"][row, pos // B]
            src = tables["src"][row, pos // B]
            resident = res != NULL_BLOCK
            assert (src[~resident] != NULL_BLOCK).all(), f"{rid!r}: host read without a block"
            for layer in range(self.num_layers):
                want = self.truth(rid, pos, layer)
                got = np.where(resident[:, None], kv[layer][res * B + pos % B],
                               host[layer][src * B + pos % B])
                bad = np.flatnonzero((got != want).any(axis=1))
                assert bad.size == 0, (
                    f"{rid!r} layer {layer}: positions {bad[:8].tolist()} read "
                    f"{'resident' if resident[bad[0]] else 'host'} rows that do not hold what "
                    f"was written (got {got[bad[0]].tolist()}, want {want[bad[0]].tolist()})")
                # Clean pages: the host copy is complete, even while the page is resident.
                clean = np.array(sorted(view.valid_pages), np.int64)
                if clean.size:
                    cpos = (clean[:, None] * B + np.arange(B)).reshape(-1)
                    cpos = cpos[cpos < n]
                    got = host[layer][src[cpos] * B + cpos % B]
                    assert np.array_equal(got, self.truth(rid, cpos, layer)), (
                        f"{rid!r} layer {layer}: a clean page's host copy is wrong")
                # Hot slots still holding a row of this request hold that row's content.
                page_of_block = {int(b): p for p, b in enumerate(view.host_blocks) if b}
                for slot, g in self.hot.get(row, {}).items():
                    p = page_of_block.get(g // B)
                    t = None if p is None else p * B + g % B
                    if t is None or t >= n or view.hot_blocks == ():
                        continue
                    d = view.hot_blocks[slot // B] * B + slot % B
                    assert np.array_equal(kv[layer][d], self.truth(rid, np.array([t]), layer)[0]
                                          ), f"{rid!r} layer {layer}: hot slot {slot} is stale"
            self.counters["checked_rows"] += n

    def release_all_and_check_leaks(self) -> None:
        """Finishes every request, drains every copy, and requires both pools to be entirely
        free (published host pages stay cached, but unreferenced): nothing leaked."""
        for rid in list(self.coord.request_ids):
            self.release(rid, "finish")
        self.drain()
        self.coord.check_invariants()
        device, host = self.coord.device_pool, self.coord.host_pool
        assert device.num_free == device.num_usable, (
            f"device blocks leaked: {device.num_usable - device.num_free} still referenced")
        assert host.num_free == host.num_usable, (
            f"host blocks leaked: {host.num_usable - host.num_free} still referenced")
        assert not self.coord.has_pending_transfers(), "transfers left in flight"

    def close(self) -> None:
        self.pool.close()


def run_seeded_soak(sim: SimulatedServer, rng: random.Random, steps: int) -> None:
    """Drives `sim` through a fixed random schedule and verifies every step: admissions from
    three prompt families (shared prefixes), resumed preempted requests, finish / cancel /
    preempt, chunked steps and completions delivered late."""
    families = [[rng.randrange(5) for _ in range(48)] for _ in range(3)]
    for i in range(steps):
        roll = rng.random()
        if roll < 0.25:
            prompt = (sim.preempted.pop() if sim.preempted and rng.random() < 0.5
                      else rng.choice(families)[: rng.randint(1, 44)])
            sim.admit(f"r{i}", prompt[:47])
        elif roll < 0.3 and sim.coord.request_ids:
            how = rng.choice(["finish", "cancel", "preempt"])
            sim.release(rng.choice(sim.coord.request_ids), how)
        sim.step(max_chunk=rng.choice([None, 3, 8]))
        sim.deliver(rng.random())
        sim.verify()
