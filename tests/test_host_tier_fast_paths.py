"""The coordinator's decode-step fast paths against its general paths.

- two coordinators run one random decode-heavy workload (admissions from shared prompt
  families, mostly steps that schedule every running request with one new token, sometimes a
  step with more tokens or lookahead rows, late and partial worker reports, finishes and
  preemptions, a device pool short enough for hot regions and lost pages): one schedules each
  pass with one `schedule_batch` call and writes the table entries a pass changed alone
  (`BlockTables.set_entries`), the other schedules with `schedule` and an explicit
  `num_tokens` (never the decode fast path) and sets every running request's whole rows
  (`set_row`) before each plan's table update is taken. Their results, plans and states
  (views, tokens, stats, tables, the free queues' LRU order) are equal after every action;
- `BlockTables.set_entries` leaves the table and its changed rows as `set_row` does.
"""

import random

from hypothesis import event, given
from hypothesis import strategies as st

from host_tier.scheduler import Admitted, BlockTables
from tests.test_host_tier_schedule_batch import MAX_LEN, B, make, plan_key, state


def reference():
    """A coordinator whose tables are set whole rows at a time (no `set_entries`), and every
    running request's rows before each update is taken (not only the rows its pass logged
    as changed)."""
    coord = make()
    tables = coord.tables
    tables.set_entries = lambda group, row, entries, blocks: tables.set_row(group, row, blocks)
    take_update = tables.take_update

    def take_every_row():
        for r in coord._requests.values():
            for group, blocks in (("src", r.host_blocks), ("res", r.res_blocks), ("hot", r.hot)):
                tables.set_row(group, r.state_row, blocks)
        return take_update()

    tables.take_update = take_every_row
    return coord


ACTIONS = {"admit": 10, "step": 60, "deliver": 20, "finish": 4, "preempt": 3}


@given(seed=st.integers(0, 2**32 - 1), num_actions=st.integers(1, 200))
def test_fast_paths_plans_and_state_equal_the_general_paths(seed, num_actions):
    rng = random.Random(seed)
    fast, general = make(), reference()
    both = (fast, general)
    families = [[rng.randrange(5) for _ in range(MAX_LEN)] for _ in range(2)]
    pending: list[int] = []  # spills not reported yet (enqueued and completed together)
    admitted_now: set[str] = set()
    n = 0

    def same(results):
        assert results[0] == results[1], results
        return results[0]

    def step():
        entries = []
        mixed = rng.random() < 0.2  # a step with more tokens or lookahead rows somewhere
        for rid in fast.request_ids:
            if rid in admitted_now:
                continue
            r = fast._requests[rid]
            room = MAX_LEN - len(r.token_ids)
            k = min(rng.choice([1, 1, 2]) if mixed else 1, room)
            if k == 0:
                continue
            la = rng.choice([0, 0, rng.randrange(B)]) if mixed else 0
            entries.append((rid, [rng.randrange(5) for _ in range(k)], la))
        rng.shuffle(entries)
        if not entries and not admitted_now:
            return
        ids = [rid for rid, _, _ in entries]
        lookahead = [la for _, _, la in entries] if mixed else None
        out = fast.schedule_batch(ids, [t for _, t, _ in entries], lookahead)
        ref = []
        for rid, tokens, la in entries:
            known = len(general._requests[rid].token_ids) + len(tokens)
            ref.append(general.schedule(rid, known - general.view(rid).num_computed_tokens,
                                        new_token_ids=tokens, num_lookahead_tokens=la))
        same([out, ref])
        plans = [c.build_plan() for c in both]
        same([plan_key(p) for p in plans])
        pending.extend(r.transfer_id for r in plans[0].restores)
        pending.extend(s.transfer_id for s in plans[0].spills)
        admitted_now.clear()

    def deliver():
        cut = rng.randrange(len(pending) + 1)
        done, pending[:] = pending[:cut], pending[cut:]
        spills = [t for t in done if not fast.spill_planner.is_restore(t)]
        for c in both:
            c.on_transfers(enqueued=done, completed=spills)

    def admit():
        nonlocal n
        prompt = families[rng.randrange(2)][:rng.randrange(1, MAX_LEN - 8)]
        if isinstance(same([c.admit(f"r{n}", prompt) for c in both]), Admitted):
            admitted_now.add(f"r{n}")
        n += 1

    def leave(how):
        """A random running request finishes or is preempted."""
        if fast.request_ids:
            rid = rng.choice(fast.request_ids)
            for c in both:
                getattr(c, how)(rid)
            admitted_now.discard(rid)

    handlers = {"admit": admit, "step": step, "deliver": deliver}
    for action in rng.choices(list(ACTIONS), weights=list(ACTIONS.values()), k=num_actions):
        if action in handlers:
            handlers[action]()
        else:
            leave(action)
        assert state(fast) == state(general)
        for c in both:
            c.check_invariants()
    for name in ("lost_pages", "spills", "hot_grants", "schedule_waits"):
        event(f"{name} > 0: {fast.stats[name] > 0}")


@given(seed=st.integers(0, 2**32 - 1))
def test_set_entries_equals_set_row(seed):
    rng = random.Random(seed)
    width = rng.choice([1, 5, 64, 65, 200])
    by_entries, by_rows = BlockTables(3, width, 2), BlockTables(3, width, 2)
    rows = [[] for _ in range(3)]
    for _ in range(30):
        s = rng.randrange(3)
        blocks = list(rows[s])
        entries = []
        if blocks and rng.random() < 0.8:  # a few entries change (or keep their value)
            entries = [rng.randrange(len(blocks)) for _ in range(rng.randint(1, 3))]
            for i in entries:
                blocks[i] = rng.choice([0, blocks[i], rng.randrange(50)])
            entries += [rng.randrange(len(blocks)) for _ in range(rng.randint(0, 2))]
        else:  # a new row (of another length: set as a whole row)
            blocks = [rng.randrange(50) for _ in range(rng.randint(0, width))]
            entries = list(range(len(blocks)))
        by_entries.set_entries("res", s, entries, blocks)
        by_rows.set_row("res", s, blocks)
        rows[s] = blocks
        a, b = by_entries.take_update(), by_rows.take_update()
        assert a.res.rows.tolist() == b.res.rows.tolist()
        assert a.res.values.tolist() == b.res.values.tolist()
        assert (by_entries.full_update().res.values.tolist()
                == by_rows.full_update().res.values.tolist())
