"""Random interleavings of admissions, growth, commits, rollbacks and releases on a prefix-caching manager.

Sequences come from a two-letter alphabet in blocks of 2 slots, so prefixes collide all the time: admissions
share cached blocks, releases park blocks in the LRU list, small pools force evictions. Beside the manager the
machine simulates the model: a step "runs" by writing each row's new tokens into the slots of its reserved
table (``slots``), and a rolled-back step either ran (its writes stay, as on a device) or did not. The oracle:
after every operation the invariant validators find nothing, and every committed slot of every resident holds
exactly that request's own token, which a wrongly shared, wrongly evicted or wrongly restored block breaks.
Releasing everything leaves every block free or cached (so ``free_blocks`` is the whole pool). Speculative
decodes write draft tokens past the sequence and commit only the accepted ones: a block that only the rejected
drafts filled is never published, and the slot oracle proves no admission ever reads one.
"""

from __future__ import annotations

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pagedgen.cache import CacheCandidate, PagedCacheManager
from pagedgen.cache.prefix import BlockHashes
from pagedgen.engine.invariants import validate_cache, validate_prefix_content
from pagedgen.errors import CacheError

BS = 2
STEMS = ([0, 1, 0, 1, 1, 0, 1, 1], [1, 1, 0, 0, 1, 1], [0, 1, 0, 0, 1])  # shared prefixes, often cut short
tokens_st = st.builds(
    lambda stem, cut, tail: (stem[:cut] + tail) or [0],
    st.sampled_from(STEMS),
    st.integers(0, 8),
    st.lists(st.integers(0, 1), max_size=3),
)


class PrefixCacheMachine(RuleBasedStateMachine):
    manager: PagedCacheManager | None = None

    @initialize(num_blocks=st.integers(2, 16), max_batch_size=st.integers(1, 4))
    def setup(self, num_blocks: int, max_batch_size: int) -> None:
        self.manager = PagedCacheManager(num_blocks, BS, max_batch_size, prefix_caching=True)
        self.slots: dict[int, int] = {}  # flat slot -> token the simulated model wrote there
        self.tokens: dict[int, list[int]] = {}  # resident -> its sequence (committed and pending)
        self.hashes: dict[int, BlockHashes] = {}
        self.pending: dict[int, list[int]] = {}  # candidates of the live reservation -> their sequences
        self.reservation = None
        self.next_id = 0

    def _candidate(self, rid: int, tokens: list[int], is_new: bool) -> CacheCandidate:
        hashes = self.hashes.get(rid) or BlockHashes(tokens, BS)
        return CacheCandidate(rid, len(tokens), is_new, hashes)

    def _step(self, data, candidates: list[CacheCandidate], sequences: dict[int, list[int]]) -> None:
        plan = self.manager.plan_step_resources(candidates)
        for _rid in plan.short_of_blocks:
            event("short of blocks")
        if not plan.selected:
            return
        reservation = self.manager.reserve(plan.selected)
        if reservation.evicted:
            event("evicted")
        if reservation.pinned_blocks():
            event("hit")
        self.reservation = reservation
        self.pending = {c.request_id: sequences[c.request_id] for c in plan.selected}
        if data.draw(st.booleans(), label="model runs"):
            self._run_model()

    def _run_model(self) -> None:
        """Write every row's uncommitted tokens through its reserved table, as the model would."""
        for row in self.reservation.rows:
            seq = self.pending[row.request_id]
            for position in range(row.committed_slots, row.required_slots):
                block = row.blocks[position // BS]
                self.slots[block * BS + position % BS] = seq[position]
        self.ran = True

    # ---- operations ----

    @rule(data=st.data(), prompts=st.lists(tokens_st, min_size=1, max_size=3))
    def admit(self, data, prompts) -> None:
        if self.reservation is not None:
            return
        candidates, sequences = [], {}
        for prompt in prompts:
            self.next_id += 1
            sequences[self.next_id] = list(prompt)
            candidates.append(self._candidate(self.next_id, sequences[self.next_id], True))
        self.ran = False
        self._step(data, candidates, sequences)

    @rule(data=st.data(), prompts=st.lists(tokens_st, min_size=1, max_size=2))
    def engine_step(self, data, prompts) -> None:
        """A whole step: admit, run the model, commit (what makes later admissions hit)."""
        if self.reservation is None:
            self.admit(data, prompts)
        self.commit(data)

    @rule(data=st.data(), extra=tokens_st)
    def grow(self, data, extra) -> None:
        if self.reservation is not None or not self.tokens:
            return
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.tokens[rid] += extra  # the request's input grows (its digests follow the same list)
        self.ran = False
        self._step(data, [self._candidate(rid, self.tokens[rid], False)], {rid: self.tokens[rid]})

    @rule(data=st.data(), drafts=st.lists(st.integers(0, 1), min_size=1, max_size=4))
    def speculate(self, data, drafts) -> None:
        """A decode that verifies drafts: its reservation also holds the drafts' slots, the model writes the
        drafts there, and the commit narrows to the accepted prefix. The sequence then grows by the accepted
        drafts and one more token (the replacement, unlike the rejected draft, or the bonus), so a block the
        rejected drafts filled holds other tokens than the sequence's and must never be published."""
        if self.reservation is not None:
            return
        tables = self.manager.tables()
        decodes = sorted(rid for rid, t in tables.items() if t.committed_slots >= len(self.tokens[rid]) - 1)
        if not decodes:
            return
        rid = data.draw(st.sampled_from(decodes))
        seq = self.tokens[rid]
        if tables[rid].committed_slots == len(seq):
            seq.append(data.draw(st.integers(0, 1), label="sampled"))  # the token its last step sampled
        self.ran = False
        self._step(
            data, [CacheCandidate(rid, len(seq) + len(drafts), False, self.hashes[rid])], {rid: seq + drafts}
        )
        if self.reservation is None:
            return
        if not self.ran:
            self._run_model()
        accepted = data.draw(st.integers(0, len(drafts)), label="accepted")
        last = data.draw(st.integers(0, 1)) if accepted == len(drafts) else 1 - drafts[accepted]
        event(f"speculate: {accepted} of {len(drafts)} accepted")
        committed = len(seq) + accepted
        if (len(seq) + len(drafts)) // BS > committed // BS:
            event("speculate: rejected drafts filled a block")
        # The engine appends the outputs first (commit_staged), then commits the cache, which names the blocks
        # it filled from the request's digests: extended in place, they cover the accepted tokens only.
        seq += drafts[:accepted] + [last]
        self.reservation.commit({rid: committed})
        self.reservation = None

    @rule(data=st.data())
    def commit(self, data) -> None:
        if self.reservation is None:
            return
        if not self.ran:
            self._run_model()
        advance = {}
        for row in self.reservation.rows:
            if data.draw(st.booleans(), label="narrow"):
                advance[row.request_id] = data.draw(st.integers(row.committed_slots, row.required_slots))
        self.reservation.commit(advance)
        for row in self.reservation.rows:
            self.tokens[row.request_id] = self.pending[row.request_id]
            self.hashes.setdefault(row.request_id, BlockHashes(self.tokens[row.request_id], BS))
        self.reservation = None

    @rule()
    def discard(self) -> None:
        """Roll back; the evicted cached blocks come back only if the model never wrote into them."""
        if self.reservation is None:
            return
        event(f"discard (model ran: {self.ran})")
        self.reservation.discard(restore_evicted=not self.ran)
        self.reservation = None  # a resident's grown input stays pending, as a request's would

    @rule(data=st.data())
    def deallocate(self, data) -> None:
        if not self.tokens:
            return
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        if self.reservation is not None:
            with pytest.raises(CacheError, match="reservation is live"):
                self.manager.deallocate(rid)
            return
        assert self.manager.deallocate(rid)
        del self.tokens[rid]
        self.hashes.pop(rid, None)

    # ---- checks ----

    @invariant()
    def consistent(self) -> None:
        if self.manager is None:
            return
        m = self.manager
        assert validate_cache(m) == []
        hashes = {rid: BlockHashes(self.tokens[rid], BS) for rid in m.resident_ids()}
        assert validate_prefix_content(m, hashes) == []
        for rid, table in m.tables().items():
            seq = self.tokens[rid]
            for position in range(table.committed_slots):
                slot = table.blocks[position // BS] * BS + position % BS
                assert self.slots.get(slot) == seq[position], (rid, position)
        stats = m.stats()
        assert stats.free_blocks + stats.reserved_blocks + stats.owned_blocks == m.num_blocks

    def teardown(self) -> None:
        if self.manager is None:
            return
        if self.reservation is not None:
            self.reservation.discard()
        for rid in list(self.tokens):
            assert self.manager.deallocate(rid)
        assert validate_cache(self.manager) == []
        stats = self.manager.stats()
        assert stats.free_blocks == self.manager.num_blocks and stats.owned_blocks == 0
        assert stats.cached_blocks == stats.prefix_blocks


PrefixCacheMachine.TestCase.settings = settings(max_examples=600, stateful_step_count=30)
test_prefix_cache_state_machine = PrefixCacheMachine.TestCase
