"""`Coordinator.schedule_batch` against `schedule`, and the block tables' incremental `set_row`.

- three coordinators run one random workload (admissions from shared prompt families: prefix
  hits and copy-on-write restores; decode steps with one new token, several tokens or none;
  lookahead rows; requests left out of a pass; finishes, preemptions and aborts; late and
  partial worker reports; a device pool short enough for hot regions, unpinned and lost pages
  and waits): one schedules each pass with one `schedule_batch` call, one with a `schedule`
  call per request, one with `schedule` and an explicit `num_tokens` (never the decode fast
  path). Their results, plans and states (views, tokens, stats, tables, the free queues' LRU
  order) are equal after every action;
- a batch with one bad entry raises ValueError naming it, and changes nothing;
- `BlockTables.set_row` keeps the table equal to its rows padded with 0 and marks exactly the
  rows that changed, whatever changes (grown, shrunk, entries anywhere).
"""

import random

import numpy as np
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from host_tier.plan import GROUPS
from host_tier.scheduler import Admitted, BlockTables, Coordinator, Wait

B = 4
MAX_LEN = 40


def make():
    return Coordinator(block_size=B, num_gpu_blocks=26, num_host_blocks=48, hot_blocks=2,
                       max_num_reqs=5, max_model_len=MAX_LEN)


def plan_key(plan):
    tables = {g: (getattr(plan.tables, g).rows.tolist(), getattr(plan.tables, g).values.tolist())
              for g in GROUPS}
    return (plan.step, plan.writes, tables, plan.hot_resets, plan.hot_invalidations,
            plan.restores, plan.spills)


def state(coord):
    """Everything the coordinator decides, LRU order of the free queues included."""
    full = coord.tables.full_update()
    return (
        {rid: (coord.view(rid), coord._requests[rid].token_ids.tolist())
         for rid in coord.request_ids},
        dict(coord.stats),
        {g: getattr(full, g).values.tolist() for g in GROUPS},
        [(pool.num_free, list(pool._released), pool._next_fresh, sorted(pool._fresh_taken),
          dict(pool._ref)) for pool in (coord.device_pool, coord.host_pool)],
        coord.num_dirty_sealed_pages, coord.spill_planner.num_retries,
        coord.spill_planner.num_in_flight,
    )


class Trio:
    """Three coordinators that must stay equal: scheduled by `schedule_batch`, by per-request
    `schedule`, and by `schedule` with `num_tokens` (its general path)."""

    def __init__(self):
        self.batched, self.single, self.general = make(), make(), make()
        self.all = (self.batched, self.single, self.general)

    def same(self, results):
        assert all(r == results[0] for r in results), results
        return results[0]

    def call(self, method, *args, **kwargs):
        return self.same([getattr(c, method)(*args, **kwargs) for c in self.all])

    def schedule(self, entries):
        """entries: (request id, new tokens, lookahead) in pass order."""
        ids = [rid for rid, _, _ in entries]
        tokens = [t for _, t, _ in entries]
        lookahead = [la for _, _, la in entries]
        out = self.batched.schedule_batch(ids, tokens, lookahead)
        single = [self.single.schedule(rid, new_token_ids=t, num_lookahead_tokens=la)
                  for rid, t, la in entries]
        general = []
        for rid, t, la in entries:
            known = len(self.general._requests[rid].token_ids) + len(t)
            n = known - self.general.view(rid).num_computed_tokens
            general.append(self.general.schedule(rid, n, new_token_ids=t,
                                                 num_lookahead_tokens=la))
        return self.same([out, single, general])

    def check(self):
        states = [state(c) for c in self.all]
        assert states[1] == states[0] and states[2] == states[0]
        for c in self.all:
            c.check_invariants()


ACTIONS = {"admit": 12, "step": 50, "deliver": 20, "finish": 4, "preempt": 3, "abort": 3,
           "bad_batch": 5}


@given(seed=st.integers(0, 2**32 - 1), num_actions=st.integers(1, 150))
def test_schedule_batch_plans_and_state_equal_per_request_schedule(seed, num_actions):
    rng = random.Random(seed)
    actions = rng.choices(list(ACTIONS), weights=list(ACTIONS.values()), k=num_actions)
    trio = Trio()
    families = [[rng.randrange(5) for _ in range(MAX_LEN)] for _ in range(2)]
    pending: list[tuple[list[int], list[int]]] = []  # (enqueued, completed) not reported yet
    admitted_now: set[str] = set()
    n = 0

    def step():
        entries = []
        for rid in trio.batched.request_ids:
            if rid in admitted_now or rng.random() < 0.1:  # admitted in this pass, left out
                continue
            r = trio.batched._requests[rid]
            room = MAX_LEN - len(r.token_ids)
            uncomputed = len(r.token_ids) - r.num_computed
            k = rng.choice([1, 1, 1, 1, 2, 3, 0])  # decode, accepted drafts, none new
            k = min(k, room)
            if k == 0 and uncomputed == 0:
                continue  # nothing to schedule
            la = rng.choice([0, 0, 0, rng.randrange(B)])
            entries.append((rid, [rng.randrange(5) for _ in range(k)], la))
        rng.shuffle(entries)
        results = trio.schedule(entries)
        assert all(x is None or isinstance(x, Wait) for x in results)
        plans = [c.build_plan() for c in trio.all]
        key = plan_key(plans[0])
        assert all(plan_key(p) == key for p in plans[1:])
        spills = [s.transfer_id for s in plans[0].spills]
        pending.append(([r.transfer_id for r in plans[0].restores] + spills, spills))
        admitted_now.clear()

    def deliver():
        enqueued, completed = [], []
        for enq, done in pending:
            cut = rng.randrange(len(enq) + 1)
            enqueued += enq[:cut]
            completed += [t for t in done if t in enq[:cut] and rng.random() < 0.7]
        rest = []
        for enq, done in pending:
            left_enq = [t for t in enq if t not in enqueued]
            left_done = [t for t in done if t not in completed]
            if left_enq or left_done:
                rest.append((left_enq, left_done))
        pending[:] = rest
        trio.call("on_transfers", enqueued=enqueued, completed=completed)

    def bad_batch():
        """A batch with one bad entry among good ones raises and changes nothing."""
        ids = list(trio.batched.request_ids)
        if not ids:
            return
        entries = [(rid, [1], 0) for rid in ids]
        i = rng.randrange(len(entries) + 1)
        bad = rng.choice(["unknown", "twice", "token", "lookahead", "too_long"])
        if bad == "unknown":
            entries.insert(i, ("nobody", [1], 0))
        elif bad == "twice":
            entries.insert(i, entries[i % len(entries)])
        elif bad == "token":
            entries.insert(i, (entries.pop(i % len(entries))[0], [-1 - (1 << 63)], 0))
        elif bad == "lookahead":
            entries.insert(i, (entries.pop(i % len(entries))[0], [1], B))
        else:
            entries.insert(i, (entries.pop(i % len(entries))[0], [1] * (MAX_LEN + 1), 0))
        before = state(trio.batched)
        with pytest.raises(ValueError, match="schedule_batch"):
            trio.batched.schedule_batch(*(list(x) for x in zip(*entries, strict=True)))
        assert state(trio.batched) == before

    for action in actions:
        running = list(trio.batched.request_ids)
        if action == "admit":
            family = families[rng.randrange(2)]
            result = trio.call("admit", f"r{n}", family[:rng.randrange(1, MAX_LEN - 8)])
            if isinstance(result, Admitted):
                admitted_now.add(f"r{n}")
            n += 1
        elif action == "step":
            step()
        elif action == "deliver":
            deliver()
        elif action == "bad_batch":
            bad_batch()
        elif running:
            rid = rng.choice(running)
            trio.call(action, rid)
            admitted_now.discard(rid)
        trio.check()
    for name in ("schedule_waits", "hot_grants", "lost_pages", "copy_on_write", "spills"):
        event(f"{name} > 0: {trio.batched.stats[name] > 0}")


def test_a_bad_entry_is_named_and_nothing_changes():
    coord = make()
    for rid in ("a", "b"):
        coord.admit(rid, [1, 2, 3, 4, 5])
    coord.build_plan()
    before = state(coord)
    cases = [
        ((["a", "b"], [[1]]), "new_token_ids has 1 entries"),
        ((["a", "b"], [[1], [1]], [0]), "num_lookahead_tokens has 1 entries"),
        ((["a", "a"], [[1], [1]]), "names request 'a' twice"),
        ((["a", "c"], [[1], [1]]), r"schedule_batch\[1\]: request_id 'c' is not admitted"),
        ((["a", "b"], [[1], [1.5]]), r"new_token_ids\[0\] must be an int64"),
        ((["a", "b"], [[1], [1]], [0, B]), r"schedule_batch\[1\]: num_lookahead_tokens"),
        ((["a", "b"], [[1], []]), r"schedule_batch\[1\]: num_tokens must be in \[1, 0\]"),
        ((["a", "b"], [[1], [1] * MAX_LEN]), r"schedule_batch\[1\]: request 'b' would hold"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            coord.schedule_batch(*args)
        assert state(coord) == before
    assert coord.schedule_batch(["b", "a"], [[7], [8]]) == [None, None]
    assert [w.request_id for w in coord.build_plan().writes] == ["b", "a"]


@given(seed=st.integers(0, 2**32 - 1))
def test_set_row_matches_padded_rows_and_marks_exactly_the_changed_rows(seed):
    rng = random.Random(seed)
    width = rng.choice([1, 5, 64, 65, 200, 300])
    tables = BlockTables(3, width, 2)
    expected = np.zeros((3, width), np.int32)
    rows = [[] for _ in range(3)]
    for _ in range(30):
        s = rng.randrange(3)
        blocks = list(rows[s])
        change = rng.choice(["grow", "shrink", "set", "zeros", "same", "new"])
        if change == "grow" and len(blocks) < width:
            blocks += [rng.randrange(50) for _ in range(rng.randint(1, width - len(blocks)))]
        elif change == "shrink":
            del blocks[rng.randrange(len(blocks) + 1):]
        elif change == "set" and blocks:
            for _ in range(rng.randint(1, 3)):
                blocks[rng.randrange(len(blocks))] = rng.randrange(50)
        elif change == "zeros" and len(blocks) < width:
            blocks += [0] * rng.randint(1, width - len(blocks))
        elif change == "new":
            blocks = [rng.randrange(50) for _ in range(rng.randint(0, width))]
        row = np.zeros(width, np.int32)
        row[:len(blocks)] = blocks
        changed = not np.array_equal(row, expected[s])
        expected[s] = row
        tables.set_row("src", s, tuple(blocks) if rng.random() < 0.3 else blocks)
        rows[s] = blocks
        update = tables.take_update()
        assert update.src.rows.tolist() == ([s] if changed else [])
        np.testing.assert_array_equal(tables.full_update().src.values, expected)
