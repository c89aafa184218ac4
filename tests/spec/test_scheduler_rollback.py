"""The scheduler with draft tokens, driven without a model (property test): we play a model
whose next token is a fixed function of the history, write each scheduled token into a fake KV
cache slot by slot, and check that every slot the model would read holds the sequence's own
token: rejected drafts are never read back, never cached; and no block leaks."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from yaie.cache.block_pool import BlockPool
from yaie.cache.radix_cache import RadixCache
from yaie.engine.scheduler import Scheduler
from yaie.engine.sequence import Sequence, SequenceStatus
from yaie.sampling_params import SamplingParams

BLOCK = 4
VOCAB = 5


def true_next(tokens: list[int]) -> int:
    """The pretend model's greedy choice after `tokens`."""
    return (sum(tokens) * 7 + len(tokens)) % VOCAB


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10), min_size=1, max_size=5),
    max_tokens=st.integers(1, 12),
    # A sequence alone must fit the pool (the engine refuses one that cannot): its longest
    # prompt (20 tokens) and max_tokens take 8 blocks; drafts take only free blocks.
    num_blocks=st.integers(8, 30),
    budget=st.integers(4, 24),
    guesses=st.lists(st.lists(st.integers(0, VOCAB - 1), max_size=4), min_size=1, max_size=50),
)
# Two sequences that each need the whole pool: they can only take turns, by preemption.
@example(prompts=[[0] * 10], max_tokens=12, num_blocks=8, budget=4, guesses=[[]])
def test_kv_read_is_always_verified(
    prompts: list[list[int]], max_tokens: int, num_blocks: int, budget: int, guesses: list[list[int]]
) -> None:
    pool = BlockPool(num_blocks)
    cache = RadixCache(pool, BLOCK)
    drafter = GuessingDrafter(guesses, max_tokens)
    scheduler = Scheduler(pool, BLOCK, 8, budget, prefix_cache=cache, drafter=drafter)
    kv: dict[int, int] = {}  # slot -> token whose K/V it holds
    seqs = []
    for i, prompt in enumerate(prompts * 2):  # each prompt twice: the second may hit the cache
        seq = Sequence(f"s{i}", prompt * 2, SamplingParams(max_tokens=max_tokens))
        scheduler.add(seq)
        seqs.append(seq)

    step = 0
    while scheduler.has_unfinished():
        step += 1
        assert step < 2000, "no progress"
        drafter.step = step
        out = scheduler.schedule()
        assert out.num_batched_tokens <= budget
        for item in out.scheduled:  # the forward: read the context, write the new slots
            seq, done, n = item.seq, item.seq.num_computed_tokens, item.num_new_tokens
            assert done == item.num_computed_tokens
            tokens = seq.all_token_ids + list(item.spec_token_ids)
            for pos in range(done):
                assert kv[_slot(seq, pos)] == tokens[pos], "read a K/V that is not the sequence's"
            for pos in range(done, done + n):
                kv[_slot(seq, pos)] = tokens[pos]
        finished: dict[Sequence, SequenceStatus] = {}
        for item in out.scheduled:  # verification and output processing
            if not item.samples:
                continue
            seq = item.seq
            for draft in [*item.spec_token_ids, None]:
                token = true_next(seq.all_token_ids)
                seq.append_token(token)
                if seq.num_output_tokens >= max_tokens:
                    finished[seq] = SequenceStatus.FINISHED_LENGTH
                    break
                if token != draft:
                    break
        scheduler.update(out, finished)
        assert all(seq.status is SequenceStatus.FINISHED_LENGTH for seq in finished)
        for seq in scheduler.running:
            assert len(seq.block_table) == scheduler.blocks_needed(seq.num_computed_tokens)

    for seq in seqs:  # every generated token is the pretend model's: drafts changed nothing
        for pos in range(seq.num_prompt_tokens, seq.num_tokens):
            assert seq.all_token_ids[pos] == true_next(seq.all_token_ids[:pos])
        blocks = cache.match_prefix(seq.all_token_ids)  # what the cache holds for it
        for index, block in enumerate(blocks):
            for offset in range(BLOCK):
                assert kv[block * BLOCK + offset] == seq.all_token_ids[index * BLOCK + offset]
        pool.free(blocks)
    assert pool.num_used == cache.num_cached_blocks  # nothing but the cache holds a block


class GuessingDrafter:
    """Drafts the step's guess for every decoding sequence, as many of its tokens as the
    sequence's max_tokens leaves room for (the scheduler may keep fewer)."""

    def __init__(self, guesses: list[list[int]], max_tokens: int) -> None:
        self.guesses, self.max_tokens, self.step = guesses, max_tokens, 0

    def propose(self, seqs: list[Sequence], room: int) -> list[list[int]]:
        drafts = []
        for seq in seqs:
            left = self.max_tokens - seq.num_output_tokens - 1
            drafts.append(self.guesses[self.step % len(self.guesses)][: max(0, left)])
        return drafts


def _slot(seq: Sequence, pos: int) -> int:
    return seq.block_table[pos // BLOCK] * BLOCK + pos % BLOCK
