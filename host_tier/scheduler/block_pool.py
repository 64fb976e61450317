"""`BlockPool`: a fixed set of block ids with reference counts and an eviction-ordered free queue.

One pool manages the device blocks (resident pages and hot regions share it), another the host
blocks of the pinned pool. Standard library only: the pool hands out ids; it never touches bytes.

Construction costs O(1) whatever the size (a host pool may hold 10**9 blocks): the pool keeps no
per-block structure up front. The free queue is the range of never-used blocks (`_next_fresh ..
num_blocks - 1`, ascending, minus the few taken out of it by `touch`) followed by the released
blocks in release order; reference counts are kept for referenced blocks only. That is exactly the
queue a list of every block would give: nothing is ever put before a never-used block.

Invariants (checked by `check_invariants`):
  - Block 0 is the null block: never handed out, never reference counted, never free.
  - Every other block is either free (reference count 0, in the free queue) or referenced
    (count > 0, not in the queue); never both, never neither.
  - The free queue is in eviction order: `allocate` hands out its head, `free` and `unpin`
    append to its tail, so a block released later is reused later.
  - A content hash names at most one block and a block carries at most one hash; a block keeps
    its hash while free (a cached, evictable page) and loses it when handed out again.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable, Iterable

from host_tier.sizes import is_int

NULL_BLOCK = 0

OnReuse = Callable[[int], None]
"""Called with a block id when the pool hands out a block that was unpinned."""


class PoolExhaustedError(RuntimeError):
    """`allocate` was asked for more blocks than are free. Callers check `num_free` first."""


class BlockPool:
    """Block ids `0 .. num_blocks-1` with reference counts; id 0 is the null block.

    Args:
      num_blocks: size of the id space, the null block included (so `num_blocks - 1` usable).
      name: used in error messages ("device pool", "host pool").
    """

    def __init__(self, num_blocks: int, *, name: str = "block pool") -> None:
        if not is_int(num_blocks) or num_blocks < 2:
            raise ValueError(
                f"{name}: num_blocks must be an int >= 2 (block 0 is the null block), "
                f"got {num_blocks!r}")
        self.name = name
        self.num_blocks = int(num_blocks)
        # Reference counts of referenced blocks only (a block not named has count 0).
        self._ref: dict[int, int] = {}
        # The free queue, head first: never-used blocks `_next_fresh .. num_blocks - 1`
        # (ascending, minus `_fresh_taken`), then the released blocks in release order.
        self._next_fresh = 1
        self._fresh_taken: set[int] = set()  # never-used blocks `touch` took out of the range
        self._released: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._num_free = self.num_blocks - 1
        self._watchers: dict[int, list[OnReuse]] = {}
        self._hash_of_block: dict[int, Hashable] = {}
        self._block_of_hash: dict[Hashable, int] = {}
        # Called with a content hash when its block is handed out again (the published page is
        # evicted), after the pool's bookkeeping; None: nobody listens.
        self.on_unpublish: Callable[[Hashable], None] | None = None

    # ------------------------------------------------------------------ queries

    @property
    def num_usable(self) -> int:
        """Blocks that can ever be handed out: every block but the null block."""
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out now (free and unpinned blocks alike)."""
        return self._num_free

    def ref_count(self, block: int) -> int:
        return self._ref.get(self._check_id(block, "block"), 0)

    def is_free(self, block: int) -> bool:
        block = self._check_id(block, "block")
        return block != NULL_BLOCK and block not in self._ref

    def free_queue(self) -> list[int]:
        """The free blocks in eviction order (head first). A copy, for tests and debugging:
        O(num_free), so not for a pool of 10**9 never-used blocks."""
        fresh = [b for b in range(self._next_fresh, self.num_blocks)
                 if b not in self._fresh_taken]
        return fresh + list(self._released)

    def has_watchers(self, block: int) -> bool:
        return bool(self._watchers.get(self._check_id(block, "block")))

    # ------------------------------------------------------------------ operations

    def allocate(self, num: int) -> list[int]:
        """Hands out `num` blocks from the head of the free queue, each with reference count 1.

        A handed-out block loses its content hash (the cached page is evicted) and fires the
        `on_reuse` watchers registered by `unpin`, after the pool's own bookkeeping is done.
        Watchers must not call `allocate`.

        Raises:
          ValueError: `num` is negative.
          PoolExhaustedError: fewer than `num` blocks are free (nothing is handed out).
        """
        if not is_int(num) or num < 0:
            raise ValueError(f"{self.name}: allocate(num) needs an int >= 0, got {num!r}")
        if num > self._num_free:
            raise PoolExhaustedError(
                f"{self.name}: cannot allocate {num} blocks, only {self._num_free} are free")
        num = int(num)
        blocks = []
        fired: list[tuple[int, list[OnReuse]]] = []
        ref, released = self._ref, self._released
        for _ in range(num):
            if self._next_fresh < self.num_blocks and (
                    not self._fresh_taken or self._take_fresh_head()):
                # A never-used block: no hash, no watcher.
                block = self._next_fresh
                self._next_fresh += 1
                ref[block] = 1
                blocks.append(block)
                continue
            block, _ = released.popitem(last=False)
            ref[block] = 1
            if self._hash_of_block:
                self._drop_hash(block)
            watchers = self._watchers.pop(block, None)
            if watchers:
                fired.append((block, watchers))
            blocks.append(block)
        self._num_free -= num
        for block, watchers in fired:
            for on_reuse in watchers:
                on_reuse(block)
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        """Drops one reference from each block, in order; a block reaching 0 joins the queue tail.

        Pass blocks in eviction order (the first is reused first). Null blocks are skipped.

        Raises:
          ValueError: a block id is out of range, or a block is already free (double free).
        """
        for block in blocks:
            self._release(block, "free")

    def unpin(self, blocks: Iterable[int], on_reuse: OnReuse) -> None:
        """Releases a reference like `free`, but the caller keeps reading the block.

        The block counts as free once its count reaches 0 and may be handed out; until then its
        content is untouched. When `allocate` hands it out, `on_reuse(block)` fires (once per
        distinct watcher), so the reader can stop reading it. Null blocks are skipped.
        """
        if not callable(on_reuse):
            raise ValueError(f"{self.name}: unpin(on_reuse) must be callable, got {on_reuse!r}")
        for block in blocks:
            block = self._check_id(block, "unpin(blocks)")
            if block == NULL_BLOCK:
                continue
            self._release(block, "unpin")
            watchers = self._watchers.setdefault(block, [])
            if on_reuse not in watchers:
                watchers.append(on_reuse)

    def touch(self, blocks: Iterable[int]) -> None:
        """Adds a reference to each block; a free block leaves the queue (a prefix hit or a pin).

        Registered `on_reuse` watchers stay: they fire if the block is handed out after being
        released again. Null blocks are skipped.
        """
        for block in blocks:
            block = self._check_id(block, "touch(blocks)")
            if block == NULL_BLOCK:
                continue
            count = self._ref.get(block, 0)
            if count == 0:
                self._take_free(block)
            self._ref[block] = count + 1

    # ------------------------------------------------------------------ content hashes

    def cache(self, block: int, block_hash: Hashable) -> bool:
        """Publishes `block` under `block_hash` for prefix reuse.

        Returns False (and changes nothing) when another block already holds that hash: the
        first published copy wins, so block tables never need to change.

        Raises:
          ValueError: `block` is null, free, or already published under a different hash.
        """
        block = self._check_id(block, "cache(block)")
        if block == NULL_BLOCK:
            raise ValueError(f"{self.name}: the null block cannot be published")
        if block not in self._ref:
            raise ValueError(f"{self.name}: block {block} is free; only held blocks are published")
        current = self._hash_of_block.get(block)
        if current is not None:
            if current != block_hash:
                raise ValueError(
                    f"{self.name}: block {block} is already published under another hash")
            return True
        if block_hash in self._block_of_hash:
            return False
        self._hash_of_block[block] = block_hash
        self._block_of_hash[block_hash] = block
        return True

    def unpublish_all(self) -> None:
        """Forgets every content hash (no page is published any more; `on_unpublish` fires
        for each): e.g. after the pool's contents were lost."""
        for block in list(self._hash_of_block):
            self._drop_hash(block)

    def lookup(self, block_hash: Hashable) -> int | None:
        """The block published under `block_hash`, or None."""
        return self._block_of_hash.get(block_hash)

    def block_hash(self, block: int) -> Hashable | None:
        return self._hash_of_block.get(self._check_id(block, "block"))

    def published_blocks(self) -> dict[int, Hashable]:
        """Block id -> hash of every published block (a copy)."""
        return dict(self._hash_of_block)

    # ------------------------------------------------------------------ checks

    def check_invariants(self, expected_refs: dict[int, int] | None = None) -> None:
        """Raises AssertionError when a module invariant is broken.

        O(referenced + released blocks + len(expected_refs)): never-used blocks are checked as
        one range.

        Args:
          expected_refs: optional block id -> number of holders the caller accounts for;
            every block not named must then be free. Catches leaks and double frees.
        """
        assert NULL_BLOCK not in self._ref, f"{self.name}: null block is reference counted"
        assert NULL_BLOCK not in self._released, f"{self.name}: null block in the free queue"
        assert 1 <= self._next_fresh <= self.num_blocks, (
            f"{self.name}: never-used range starts at {self._next_fresh}")
        for block in self._fresh_taken:
            assert self._next_fresh <= block < self.num_blocks, (
                f"{self.name}: taken never-used block {block} is outside the range")
        num_fresh = self.num_blocks - self._next_fresh - len(self._fresh_taken)
        assert self._num_free == num_fresh + len(self._released), (
            f"{self.name}: free count {self._num_free} != {num_fresh} never-used + "
            f"{len(self._released)} released")
        assert self._num_free + len(self._ref) == self.num_blocks - 1, (
            f"{self.name}: {self._num_free} free + {len(self._ref)} referenced blocks != "
            f"{self.num_blocks - 1} usable (a block is both or neither)")
        for block in self._released:
            assert block not in self._ref, (
                f"{self.name}: block {block} has reference count {self._ref[block]} but is in "
                "the free queue")
            assert block < self._next_fresh or block in self._fresh_taken, (
                f"{self.name}: released block {block} is also never used")
        for block, ref in self._ref.items():
            assert ref > 0, f"{self.name}: block {block} has reference count {ref}"
            assert block < self._next_fresh or block in self._fresh_taken, (
                f"{self.name}: block {block} has reference count {ref} but is in the free "
                "queue")
        if expected_refs is not None:
            for block in sorted(set(self._ref) | {b for b, n in expected_refs.items() if n}):
                ref = self._ref.get(block, 0)
                want = expected_refs.get(block, 0)
                assert ref == want, (
                    f"{self.name}: block {block} has reference count {ref}, holders account "
                    f"for {want} ({'leak' if ref > want else 'double free or missing pin'})")
        for block, block_hash in self._hash_of_block.items():
            assert self._block_of_hash.get(block_hash) == block, (
                f"{self.name}: hash index disagrees for block {block}")
        assert len(self._hash_of_block) == len(self._block_of_hash), (
            f"{self.name}: hash index sizes differ")

    # ------------------------------------------------------------------ internals

    def _release(self, block: int, verb: str) -> None:
        block = self._check_id(block, f"{verb}(blocks)")
        if block == NULL_BLOCK:
            return
        count = self._ref.get(block, 0)
        if count == 0:
            raise ValueError(f"{self.name}: {verb} of block {block}, which is already free "
                             "(double free)")
        if count == 1:
            del self._ref[block]
            self._released[block] = None
            self._num_free += 1
        else:
            self._ref[block] = count - 1

    def _take_free(self, block: int) -> None:
        """Takes the free block `block` out of the free queue (it becomes referenced)."""
        if block in self._released:
            del self._released[block]
        else:  # never used: a hole in the never-used range
            self._fresh_taken.add(block)
        self._num_free -= 1

    def _take_fresh_head(self) -> bool:
        """Skips never-used blocks that `touch` took; True when a never-used block is left."""
        while self._next_fresh in self._fresh_taken:
            self._fresh_taken.discard(self._next_fresh)
            self._next_fresh += 1
        return self._next_fresh < self.num_blocks

    def _drop_hash(self, block: int) -> None:
        block_hash = self._hash_of_block.pop(block, None)
        if block_hash is not None:
            del self._block_of_hash[block_hash]
            if self.on_unpublish is not None:
                self.on_unpublish(block_hash)

    def _check_id(self, block: int, what: str) -> int:
        if not is_int(block) or not 0 <= block < self.num_blocks:
            raise ValueError(
                f"{self.name}: {what} must be a block id in [0, {self.num_blocks}), "
                f"got {block!r}")
        return int(block)
