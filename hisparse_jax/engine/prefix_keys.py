"""`IndexKeyStore`: the index keys of published pages, on the host (prefix caching).

The host tier's prefix cache (`host_tier/scheduler/prefix_cache.py`) publishes a request's full
pages of KV rows and serves later prompts that start with them. The model's indexer keys are no
part of those pages: they live in a dense per-seat device cache (`DecodeCache.index_keys[g]`,
[seats, max_model_len, index_dim]) that the next occupant of the seat overwrites, and they
cannot be recomputed without running the prefix again. So the engine keeps a host copy of
every published page's keys, one [B, index_dim] array per index group, named like the page:
by its chained content hash (`host_tier.scheduler.prefix_cache.page_hash`).

Lifecycle of an entry (the engine drives it, `hisparse_jax/engine/engine.py`):

  * `stage`: a page of a running request sealed (its B tokens computed and recorded, its keys
    final: never a speculative draft's row, which the next step may rewrite): the
    engine copies its keys from the request's seat, while the seat still holds them, and
    names the request an owner (it may publish the page later: its host copy completes
    after the forward; a finished request's last copies may complete after its seat is
    reused, which is why keys are taken when the page seals, not when it publishes);
  * `published`: the coordinator published the page (`Coordinator.listen(on_publish=...)`):
    the entry lives while the page does;
  * `unpublished`: the page's host block was handed out again (the page is evicted): the entry
    goes unless an owner may still publish the same hash;
  * `prune`: owners that can no longer publish (preempted, aborted, finished with every copy
    reported) are dropped, and with the last one every entry that is not published.

So the store holds the published pages' keys plus those of sealed pages of requests that may
still publish them; it never grows past that (no unbounded growth). A prefix hit reads the keys
of its pages (`get`) and the engine writes them into the new seat before the prefill.
Scheduler side: numpy and the standard library only.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable, Iterable

import numpy as np


class IndexKeyStore:
    """Host copies of the index keys of published (and about to be published) pages.

    Attributes:
      keys: page hash -> per index group, the page's keys [B, index_dim] (or a function
        returning them while their copy to the host is in flight: `get` resolves it).
      published: hashes of entries whose page is published now.
      owners: request id -> hashes it staged that it may still publish.
    """

    def __init__(self) -> None:
        self.keys: dict[bytes, tuple[np.ndarray, ...]] = {}
        self.published: set[bytes] = set()
        self.owners: dict[Hashable, set[bytes]] = collections.defaultdict(set)
        self._owned: collections.Counter[bytes] = collections.Counter()  # owners per hash

    def __len__(self) -> int:
        return len(self.keys)

    def __contains__(self, page_hash: bytes) -> bool:
        return page_hash in self.keys

    def get(self, page_hash: bytes) -> tuple[np.ndarray, ...] | None:
        """The page's keys per index group, or None when none are kept (a key kept as a
        function, still being copied to the host, is called once and kept as its value)."""
        keys = self.keys.get(page_hash)
        if callable(keys):
            keys = self.keys[page_hash] = keys()
        return keys

    def stage(self, request_id: Hashable, page_hash: bytes,
              keys: tuple[np.ndarray, ...] | Callable[[], tuple[np.ndarray, ...]]) -> None:
        """Keeps the keys of a sealed page of running request `request_id` (the first copy of
        a hash wins, as in the host pool) until it is published or its owners are gone;
        `keys` may be a function that returns them (a copy still in flight)."""
        self.keys.setdefault(page_hash, keys)
        hashes = self.owners[request_id]
        if page_hash not in hashes:
            hashes.add(page_hash)
            self._owned[page_hash] += 1

    def on_publish(self, page_hash: bytes) -> bool:
        """The page was published; False when its keys are not kept (the caller copies them)."""
        if page_hash not in self.keys:
            return False
        self.published.add(page_hash)
        return True

    def on_unpublish(self, page_hash: bytes) -> None:
        """The page was evicted: its keys go, unless an owner may publish the hash again."""
        self.published.discard(page_hash)
        if not self._owned[page_hash]:
            self._owned.pop(page_hash, None)
            self.keys.pop(page_hash, None)

    def prune(self, gone: Iterable[Hashable], publishes: Callable[[Hashable], bool]) -> None:
        """Drops the owners among `gone` (requests no longer running) that can no longer
        publish (`publishes(request_id)` False), and with them the entries that are neither
        published nor owned by anyone else."""
        for request_id in list(gone):
            if request_id not in self.owners or publishes(request_id):
                continue
            for h in self.owners.pop(request_id):
                self._owned[h] -= 1
                if not self._owned[h]:
                    del self._owned[h]
                    if h not in self.published:
                        self.keys.pop(h, None)
