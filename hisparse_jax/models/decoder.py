"""The decode / prefill skeleton of a served sparse-MLA decoder (`SparseDecoder`), shared by
the synthetic model (`synthetic.Transformer`) and the DSA model of real checkpoints
(`dsa.DSAModel`).

A subclass supplies the modules and the static facts; the skeleton runs the layers against
the KV-cache handle (`hisparse_jax.cache.HiSparseKVCache`) and the per-group index-key
caches (`DecodeCache`). What a subclass provides:

  * `spec` (`ModelSpec`): `group_layers` splits the layers into index groups: group g is
    layers [offset_g, offset_g + n_g); its first layer (the leader) owns the indexer and
    the group's one lookup, the other layers attend over the leader's rows (DeepSeek-V3.2:
    groups of one layer; GLM-5: a "full" layer plus the "shared" layers after it).
    `sm_scale` and `kv_lora_rank` (the value width) parameterise the attention. The
    KV-cache handle's groups are the spec's (the engine builds it from `group_layers`).
  * `embed(tokens int32[T]) -> [T, H]`, `blocks` (one per layer), `final_norm`, `lm_head`
    (the logits are `lm_head(final_norm(x))` in float32), `index_dim` (the index-key width).
  * each block: `attn_norm`, `attn` (`project(x, positions) -> (q_resid, q, row)`,
    `attend(q, kv_rows, attention_rows, *, backend, kv_format) -> (out, latent)`,
    `output(latent) -> out`), `indexer` (a leader's: `keys`, `queries`, `select`; None on
    the others), `mlp_norm`, `mlp`. A block's output is x + attn, then + mlp(mlp_norm(.)).
  * `draft_step(hidden, tokens) -> (hidden, logits)` when the spec has a draft (one
    application of the multi-token-prediction module; `draft` loops it).

One decode path for every residency: each layer writes its new row through the handle
(`HiSparseKVCache.write`), the leader layer of each index group picks the top-k (its
indexer, or `DecodeBatch.topk` from an external source) and asks the handle for the rows to
attend (`HiSparseKVCache.lookup`: through the resident table, or through the hot region with
misses copied from the pinned host pool, as the handle's residency type says), and every
layer of the group attends over those rows (`sparse_mla_decode`). The write-back of rows to
the host pool is done page by page by the host tier's spills (`host_tier.TransferEngine`),
once a page is sealed.

Caches are data: `DecodeCache` is passed into `decode` / `prefill` / `prefill_chunk` and
returned, never kept in module variables, so a step jits with the caches donated.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from hisparse_jax.cache import AllResident, CacheBatch, HiSparseKVCache, PendingLookup
from hisparse_jax.index_groups import layers_per_pool_array
from hisparse_jax.models.protocol import DecodeBatch, DecodeCache, ModelSpec
from hisparse_jax.ops import stage_prefill_rows

# --------------------------------------------------------------------------- index groups


@functools.cache
def layer_roles(group_layers: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """(group, member) of each layer, in layer order, for index groups of `group_layers`
    layers (member 0: the group's leader)."""
    return tuple((g, m) for g, n in enumerate(group_layers) for m in range(n))


def check_pool_arrays(num_arrays: int, spec: ModelSpec) -> int:
    """G, the layers each of a host pool's `num_arrays` arrays holds side by side (1: one
    array per layer); ValueError when the arrays do not split the layers into whole index
    groups (`hisparse_jax.index_groups.layers_per_pool_array`)."""
    groups = spec.group_layers
    return layers_per_pool_array(num_arrays, spec.num_layers,
                                 groups[0] if len(set(groups)) == 1 else groups)


# --------------------------------------------------------------------------- the skeleton


class SparseDecoder(nnx.Module):
    """The served decoder's `decode`, `prefill`, `prefill_chunk`, `init_index_keys` and
    `draft` over a subclass's modules (module docstring: what a subclass provides)."""

    spec: ModelSpec
    index_dim: int

    def init_index_keys(self, max_seats: int, max_model_len: int, *, external_topk: bool
                        ) -> tuple[jax.Array, ...]:
        """Zero index-key caches, one per index group: [max_seats, max_model_len, index_dim]
        (kv_dtype), or [1, 1, index_dim] placeholders with an external top-k (the indexer
        never runs then)."""
        spec = self.spec
        shape = ((1, 1, self.index_dim) if external_topk
                 else (max_seats, max_model_len, self.index_dim))
        return tuple(jnp.zeros(shape, jnp.dtype(spec.kv_dtype))
                     for _ in range(spec.num_groups))

    def logits(self, x: jax.Array) -> jax.Array:
        """float32 logits [..., V] of last hidden states x [..., H]."""
        return self.lm_head(self.final_norm(x)).astype(jnp.float32)

    def _finish(self, x: jax.Array, block: nnx.Module, attn_out: jax.Array) -> jax.Array:
        x = x + attn_out
        return x + block.mlp(block.mlp_norm(x))

    def draft(self, hidden: jax.Array, tokens: jax.Array, num_tokens: int) -> jax.Array:
        """Greedy drafts int32[N, num_tokens] of the multi-token-prediction module: hidden
        [N, H] is the last hidden state of position t (`decode`'s aux "hidden"), tokens
        int32[N] the token at t + 1; draft i is the module's guess for position t + 2 + i."""
        if not self.spec.has_draft:
            raise ValueError(f"model {self.spec.name!r} has no MTP module to draft with (its "
                             "spec has has_draft=False)")
        drafts = []
        for _ in range(num_tokens):
            hidden, logits = self.draft_step(hidden, tokens)
            tokens = jnp.argmax(logits, -1).astype(jnp.int32)
            drafts.append(tokens)
        return jnp.stack(drafts, 1)

    def decode(self, cache: DecodeCache, batch: DecodeBatch, *,
               attention_backend: str | None = None, collect_attention: bool = False
               ) -> tuple[jax.Array, DecodeCache, dict]:
        """One decode token per batch row. Returns (logits float32[N, V], new cache, aux).

        Each layer writes its row through `cache.kv.write`; the leader of each index group
        selects the top-k (causal: entries past a row's position are dropped; padding rows
        select nothing) and calls `cache.kv.lookup`, whose rows every layer of the group
        attends over. The residency (`cache.kv.residency`) decides how rows are found.

        Several query rows per request (speculative verification: `CacheBatch.
        rows_per_request` = r adjacent rows of one state row at consecutive positions): each
        row writes its own position and attends causally, so row i sees the rows written by
        rows < i in the same step; a row of position -1 writes and selects nothing.

        aux: "hits" / "misses" int32[num_groups] (hot-region lookups summed over rows; zeros
        when the residency reads no host rows), "hidden" [N, H] (the last hidden state,
        before the final norm: what an MTP module drafts from) and, with
        `collect_attention`, "attention" [L, N, h, kv_lora] (each layer's latent attention
        output).
        """
        spec = self.spec
        kvb = batch.kv
        kv, index_keys = cache.kv, list(cache.index_keys)
        hits, misses, attn = [], [], []
        x = self.embed(batch.tokens)
        lookup = None
        # With an external selection and copy_with_attention, group g + 1 is looked up ahead,
        # before group g attends: its copies from host run in the launch of group g's first
        # attention.
        ahead = batch.topk is not None and kv.copy_with_attention
        pending = None
        if ahead:  # no attention runs before group 0's: its copies run at its lookup
            kv, found = kv.lookup(0, external_topk(batch, 0), kvb)
            pending = PendingLookup(0, found)
        roles = layer_roles(spec.group_layers)
        for layer, block in enumerate(self.blocks):
            g, member = roles[layer]
            leader = member == 0
            h = block.attn_norm(x)
            q_resid, q, row = block.attn.project(h, kvb.positions)
            if leader and ahead:
                kv, lookup = kv.land(pending, kvb)
                pending = None
                if g + 1 < spec.num_groups:
                    kv, pending = kv.lookup_ahead(g + 1, external_topk(batch, g + 1), kvb)
            kv = kv.write(layer, row, kvb)
            if leader and not ahead:
                if batch.topk is not None:
                    topk = external_topk(batch, g)
                else:
                    topk, index_keys[g] = _decode_select(block.indexer, index_keys[g], h,
                                                         q_resid, kvb)
                kv, lookup = kv.lookup(g, topk, kvb)
            if leader:
                hits.append(jnp.sum(lookup.hits))
                misses.append(jnp.sum(lookup.misses))
            # The first attention after a lookup ahead also runs its copies, when they wait
            # for one (`copy_with_attention`); any other attends alone.
            kv, latent, _, pending = kv.attend(
                layer, q, lookup.attention_rows, kvb, sm_scale=spec.sm_scale,
                v_width=spec.kv_lora_rank, backend=attention_backend, pending=pending)
            if collect_attention:
                attn.append(latent)
            x = self._finish(x, block, block.attn.output(latent))
        aux = {"hits": jnp.stack(hits), "misses": jnp.stack(misses), "hidden": x}
        if collect_attention:
            aux["attention"] = jnp.stack(attn)
        return self.logits(x), DecodeCache(kv, tuple(index_keys)), aux

    def prefill(self, cache: DecodeCache, tokens: jax.Array, length: jax.Array,
                state_row: jax.Array, write_rows: jax.Array, *,
                attention_backend: str | None = None, collect_attention: bool = False
                ) -> tuple[jax.Array, DecodeCache, dict]:
        """Prefill one request: tokens int32[T] (padded; the first `length` are real), written
        to flat device rows write_rows int32[T] (-1: not written) and to the index-key cache
        row `state_row` (through `cache.kv.write_rows`: prefill rows always go to resident
        pages). Every query row attends to its own top-k (sparse, the decode rule), over the
        rows just computed as the cache stores them (`HiSparseKVCache.encode`: with
        "fp8_ds_mla" the quantized rows, as upstream, which quantizes at write and attends
        over the stored rows; prefill and every decode residency thus read the same values).
        Returns (logits float32[V] of the last real token, new
        cache, aux with "attention" [L, h, kv_lora] of the last token when collected).
        """
        pos = jnp.arange(tokens.shape[0], dtype=jnp.int32)
        return self._prefill(cache, tokens, pos, length, state_row, write_rows=write_rows,
                             attention_backend=attention_backend,
                             collect_attention=collect_attention)

    def prefill_every_position(self, cache: DecodeCache, tokens: jax.Array,
                               length: jax.Array, state_row: jax.Array,
                               write_rows: jax.Array, *, attention_backend: str | None = None
                               ) -> tuple[jax.Array, DecodeCache]:
        """`prefill`, returning the logits float32[T, V] of every position (padding rows'
        too: ignore them) with the new cache: a scoring pass through the prefill path."""
        pos = jnp.arange(tokens.shape[0], dtype=jnp.int32)
        logits, cache, _ = self._prefill(cache, tokens, pos, length, state_row,
                                         write_rows=write_rows,
                                         attention_backend=attention_backend,
                                         collect_attention=False, every_position=True)
        return logits, cache

    def prefill_chunk(self, cache: DecodeCache, tokens: jax.Array, start: jax.Array,
                      length: jax.Array, state_row: jax.Array, pages: jax.Array, *,
                      host_pages: jax.Array | None = None,
                      host_pools: tuple[jax.Array, ...] = (),
                      attention_backend: str | None = None, collect_attention: bool = False
                      ) -> tuple[jax.Array, DecodeCache, dict]:
        """Prefill one chunk of a request's prompt: tokens int32[T] at positions
        [start, start + T) (padded; the first `length` are real), of the request in state row
        `state_row` whose resident pages are `pages` int32[P] (its block-table row; every page
        up to position start + length - 1 resident: `docs/semantics.md`, chunked prefill).

        The chunk's rows go to its pages (`HiSparseKVCache.write`) and its index keys to
        `cache.index_keys[g][state_row]`, after the earlier chunks' keys; each query row runs
        the indexer over the keys of positions [0, its position] and attends to its own top-k
        through the resident table (`AllResident`: one lookup per index group, read after the
        group's write), i.e. the query rows of a chunk are decode rows of one request at
        consecutive positions. The rows read are the stored ones, earlier chunks' and this
        chunk's alike (this chunk's rows equal `HiSparseKVCache.encode` of its values, what
        `prefill` reads), so a prompt prefilled chunk by chunk reads the values the one-shot
        `prefill` reads, up to rounding: the chunk's matrix products and row reductions run
        over its T rows, and their summation order depends on that shape (`docs/semantics.md`,
        chunked prefill). Padding rows write and select nothing. Returns (logits float32[V] of
        the last real token, new cache, aux with "attention" [L, h, kv_lora] of the last token
        when collected).

        Staging (`host_pages` int32[P], the request's host block of each page, and
        `host_pools`, the pinned host pool's arrays (`HostPool.arrays`);
        `docs/semantics.md`, prefill staging):
        pages before the chunk may then be host-only (null in `pages`). After each group
        leader's selection, the distinct positions the chunk's rows select (at most M =
        min(T * top_k, max_model_len)) are gathered into one compact array [M, Ws] per layer
        of the group: those before the chunk once, by `stage_prefill_rows` (a resident copy
        device to device, else the host pool's), the chunk's own after each layer's write;
        each layer attends over its compact array, the same values in the same order per
        query row as the resident read (and the KV array stays far below the attention
        kernel's 2^31-element limit, whatever the chunk). aux gains "staged_rows_host" /
        "staged_rows_device": the rows staged (counted once per group, not per layer of the
        group), int32 summed over the groups when they are of equal size, else
        int32[num_groups] (the engine weighs each group's rows by its layer count).
        """
        T = tokens.shape[0]
        pos = start + jnp.arange(T, dtype=jnp.int32)
        res = jnp.broadcast_to(pages, (T, pages.shape[0]))
        if host_pages is None:
            src = jnp.zeros_like(res)
        else:
            if host_pages.shape != pages.shape:
                raise ValueError(
                    f"prefill_chunk: staging needs host_pages of the shape of pages "
                    f"{tuple(pages.shape)}, got {tuple(host_pages.shape)}")
            try:
                check_pool_arrays(len(host_pools), self.spec)
            except ValueError as e:
                raise ValueError(f"prefill_chunk: staging: {e}") from None
            src = jnp.broadcast_to(host_pages, res.shape)
        pages_batch = CacheBatch(
            state_rows=jnp.where(jnp.arange(T) < length, state_row, -1), positions=pos,
            src=src, res=res, hot=jnp.zeros((T, 0), jnp.int32),
            host_pools=tuple(host_pools) if host_pages is not None else ())
        return self._prefill(cache, tokens, pos, length, state_row, pages_batch=pages_batch,
                             attention_backend=attention_backend,
                             collect_attention=collect_attention)

    def _prefill(self, cache: DecodeCache, tokens: jax.Array, pos: jax.Array,
                 length: jax.Array, state_row: jax.Array, *, write_rows: jax.Array | None = None,
                 pages_batch: CacheBatch | None = None, attention_backend: str | None,
                 collect_attention: bool, every_position: bool = False
                 ) -> tuple[jax.Array, DecodeCache, dict]:
        """The layers of `prefill` (`write_rows`: rows written by flat row, the indexer over
        the step's own keys, attention over the step's encoded rows) and of `prefill_chunk`
        (`pages_batch`: rows written and read through the request's pages, the indexer over
        the request's index-key row), query rows at positions `pos`. `every_position`: the
        logits [T, V] of every row instead of [V] of the last real one."""
        spec = self.spec
        real = jnp.arange(tokens.shape[0]) < length
        kv, index_keys = cache.kv, list(cache.index_keys)
        staging = pages_batch is not None and bool(pages_batch.host_pools)
        x = self.embed(tokens)
        attn = []
        rows = staged = None
        from_host, from_device = [], []  # staged rows per index group
        roles = layer_roles(spec.group_layers)
        for layer, block in enumerate(self.blocks):
            g, member = roles[layer]
            h = block.attn_norm(x)
            q_resid, q, row = block.attn.project(h, pos)
            if pages_batch is None:
                kv = kv.write_rows(layer, write_rows, row)
            else:
                kv = kv.write(layer, row, pages_batch)
            if member == 0:
                idx = block.indexer
                keys = idx.keys(h, pos)
                index_keys[g] = index_keys[g].at[state_row, pos].set(
                    jnp.where(real[:, None], keys, 0), mode="drop")
                iq, iw = idx.queries(q_resid, h, pos)
                if pages_batch is None:
                    rows = idx.select(iq, iw, keys, pos)
                else:
                    topk = idx.select(iq, iw, index_keys[g][state_row], pos)
                    kv, found = AllResident().lookup(kv, g, topk, pages_batch)
                    rows = found.attention_rows
                    if staging:
                        staged, device_rows, host_rows = _stage_group(
                            kv, g, topk, rows, pos[0], pages_batch, index_keys[g].shape[1])
                        from_host.append(host_rows)
                        from_device.append(device_rows)
            if staged is not None:
                stored, attend_rows = _staged_read(kv.caches[layer], staged, member)
            else:
                stored = kv.encode(row) if pages_batch is None else kv.caches[layer]
                attend_rows = rows
            out, latent = block.attn.attend(q, stored, attend_rows, backend=attention_backend,
                                            kv_format=kv.kv_format)
            if collect_attention:
                attn.append(latent[length - 1])
            x = self._finish(x, block, out)
        aux = {"attention": jnp.stack(attn)} if collect_attention else {}
        if staging:
            aux["staged_rows_host"] = _per_group(from_host, spec)
            aux["staged_rows_device"] = _per_group(from_device, spec)
        new_cache = DecodeCache(kv, tuple(index_keys))
        if every_position:
            return self.logits(x), new_cache, aux
        last = jax.lax.dynamic_index_in_dim(x, length - 1, keepdims=False)
        return self.logits(last[None])[0], new_cache, aux


def external_topk(batch: DecodeBatch, group: int) -> jax.Array:
    """Group `group`'s top-k from the batch's external source: causal entries only, none for
    padding rows."""
    kvb = batch.kv
    topk = batch.topk[group]
    keep = (topk <= kvb.positions[:, None]) & kvb.live[:, None]
    return jnp.where(keep, topk, -1)


def _per_group(counts: list[jax.Array], spec: ModelSpec) -> jax.Array:
    """Staged-row counts of each index group: their int32 sum when the groups are of equal
    size (every row weighs the same), else int32[num_groups]."""
    counts = jnp.stack(counts).astype(jnp.int32)
    return counts.sum() if len(set(spec.group_layers)) == 1 else counts


def _decode_select(indexer: nnx.Module, keys: jax.Array, h: jax.Array, q_resid: jax.Array,
                   kvb: CacheBatch) -> tuple[jax.Array, jax.Array]:
    """A group leader's decode selection: writes the batch rows' index keys into `keys`
    [S, max_model_len, d] (live rows at their positions) and selects each row's top-k over
    its seat's keys (none for padding rows). Returns (topk int32[N, K], the new keys)."""
    live, pos = kvb.live, kvb.positions
    writes = live & (pos >= 0)
    srow = jnp.where(live, kvb.state_rows, 0)
    keys = keys.at[jnp.where(writes, kvb.state_rows, keys.shape[0]),
                   jnp.maximum(pos, 0)].set(indexer.keys(h, pos), mode="drop")
    iq, iw = indexer.queries(q_resid, h, pos)
    topk = indexer.select(iq, iw, keys[srow], pos)
    return jnp.where(live[:, None], topk, -1), keys


# --------------------------------------------------------------------------- prefill staging


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Staged:
    """One index group's selection in a chunk prefill (`_stage_group`): the distinct selected
    positions of the chunk's rows, M of them at most (`positions` int32[M], ascending, -1
    padding), `buffers` [M, Ws] per layer of the group holding the rows of those before the
    chunk (staged), `rows` int32[M] the resident flat row of each (-1: none), and `ids`
    int32[T, K] the union index each query row attends to (-1: no row)."""

    buffers: tuple[jax.Array, ...]
    positions: jax.Array
    rows: jax.Array
    ids: jax.Array
    start: jax.Array


def _stage_group(kv: HiSparseKVCache, group: int, topk: jax.Array, rows: jax.Array,
                 start: jax.Array, batch: CacheBatch, max_len: int
                 ) -> tuple[_Staged, jax.Array, jax.Array]:
    """Gathers the rows a chunk's selection topk int32[T, K] reads (`rows`: their resident
    rows, -1 where not resident) into one compact array per layer of group `group`: the
    distinct selected positions (a mask over the max_len positions, then at most M = min(T
    * K, max_len) of them in ascending order); those before `start` (written by earlier
    chunks or a reused prefix, for every layer of the group) are copied now by
    `stage_prefill_rows` (the resident copy where there is one, else the host's), those of
    the chunk itself are read per layer after its write (`_staged_read`). A position whose
    row exists nowhere (neither resident nor, before the chunk, on the host) is a hole, as
    in the resident read. Returns (the `_Staged`, rows copied device to device, rows
    copied from host)."""
    B = kv.block_size
    T, K = topk.shape
    P = batch.res.shape[1]
    page_of = lambda p: jnp.minimum(jnp.maximum(p, 0) // B, P - 1)
    host_of = lambda p: jnp.take(batch.src[0], page_of(p))
    exists = (rows >= 0) | ((topk < start) & (topk // B < P) & (host_of(topk) > 0))
    want = (topk >= 0) & exists & batch.live[:, None]
    mask = jnp.zeros(max_len, bool).at[jnp.where(want, topk, max_len)].set(True, mode="drop")
    M = min(T * K, max_len)
    (positions,) = jnp.nonzero(mask, size=M, fill_value=-1)
    positions = positions.astype(jnp.int32)
    index_of = jnp.full(max_len, -1, jnp.int32).at[
        jnp.where(positions >= 0, positions, max_len)].set(jnp.arange(M, dtype=jnp.int32),
                                                            mode="drop")
    ids = jnp.where(want, index_of[jnp.where(want, topk, 0)], -1)
    res_block = jnp.take(batch.res[0], page_of(positions))
    union_rows = jnp.where((positions >= 0) & (res_block > 0),
                           res_block * B + jnp.maximum(positions, 0) % B, -1)
    caches = kv.caches[kv.group_slice(group)]
    out = stage_prefill_rows(
        kv.group_pools(group, batch), caches,
        tuple(jnp.zeros((M, cache.shape[-1]), cache.dtype) for cache in caches),
        jnp.where(positions < start, positions, -1), batch.src[0], batch.res[0],
        block_size=B, backend=kv.ops_backend)
    return (_Staged(out.staging, positions, union_rows, ids, start), out.rows_from_device,
            out.rows_from_host)


def _staged_read(cache: jax.Array, staged: _Staged, member: int
                 ) -> tuple[jax.Array, jax.Array]:
    """The rows a staged chunk's query rows attend over: the compact array [M, Ws] of the
    group's distinct selected rows (staged rows before the chunk; the chunk's own rows from
    `cache` [num_blocks, B, Ws], after the layer's write; member: the layer's index in its
    group) and the attention rows int32[T, K] into it (-1: a hole). The values and their
    order per query row are those of the resident read."""
    flat = cache.reshape(-1, cache.shape[-1])
    own = (staged.positions >= staged.start)[:, None]
    compact = jnp.where(own, flat[jnp.maximum(staged.rows, 0)], staged.buffers[member])
    return compact, staged.ids
