"""Prefix caching on the bundled model (GitHub issue 5): greedy outputs are the same with the
cache on and off, the cache really hits, a small pool evicts without leaking or stalling, and
requests that ask for prompt logprobs compute their whole prompt.

The shared `llm` fixture (cache on, roomy pool) is compared with `uncached`, the same model with
prefix caching off; `small` has the cache on and a 40-block pool. Every test uses texts of its
own, so what one test leaves in a shared cache cannot be what another test's hits are counted on.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest

from tests.engine.engine_helpers import assert_no_leak
from yaie import LLM, SamplingParams
from yaie.cache.radix_cache import RadixCache
from yaie.outputs import RequestOutput

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=16)
MAX_STEPS = 2000  # far more than any test here needs; a scheduler that stops progressing fails, not hangs

BAKERY = (
    "You are a careful assistant for a small bakery called The Rolling Pin. The bakery opens at seven in "
    "the morning and closes at six in the evening, every day except Monday. It sells sourdough loaves, rye "
    "bread, croissants, cinnamon buns, apple pie by the slice, and three kinds of cookies: oatmeal, "
    "chocolate chip and ginger. Prices: a sourdough loaf costs five euros, rye bread four euros, a "
    "croissant two euros, a cinnamon bun three euros, a slice of pie four euros, and cookies one euro "
    "each. Orders for birthday cakes need two days' notice. The bakery is at 12 Mill Street, next to the "
    "post office. Gluten-free bread is baked on Fridays only, and vegan cinnamon buns are sold on weekends. "
    "Answer customers politely and briefly, and never invent products that are not on the list."
)
LIBRARY = (
    "You help visitors of the Northfield public library. The library has three floors: children's books "
    "and picture books on the ground floor, fiction and audio books on the first floor, and reference "
    "works, maps and the quiet study room on the second floor. Members may borrow up to eight items at a "
    "time for three weeks, and renew them twice online. Late returns cost twenty cents a day per item. "
    "Printing costs ten cents a page in black and white and fifty cents in colour. Wi-Fi is free; the "
    "password is on the card at the front desk. The library is closed on public holidays. Keep answers "
    "short and friendly, and send questions you cannot answer to the librarian at the front desk."
)
GARDEN = (
    "You are the help desk of Green Row community garden. Plots are four metres by two and cost thirty "
    "euros a season; the season runs from March to October. Gardeners must water their own plots, keep "
    "paths clear and compost weeds in the bins by the gate. Tools are in the blue shed, whose code "
    "changes every month and is posted in the members' newsletter. No pesticides are allowed. Work days "
    "are the first Saturday of every month from nine until noon, with coffee and cake afterwards. The "
    "waiting list for a plot is about one year. Answer in one or two sentences and be encouraging."
)
QUESTIONS = (
    "When do you open?",
    "How much is a croissant?",
    "Can I order a birthday cake for tomorrow?",
    "Where are you?",
    "Do you sell bagels?",
    "What cookies do you have?",
    "Are you open on Monday?",
    "What is the cheapest thing you sell?",
)


@pytest.fixture(scope="module")
def uncached() -> LLM:
    """The same model and pool size with prefix caching off: the reference for every output."""
    return LLM(num_kv_blocks=1024, enable_prefix_caching=False, quantization="none")


def chat(llm: LLM, system: str, *turns: str) -> list[int]:
    """Token ids of a conversation: `turns` alternate user and assistant messages, user first."""
    messages = [{"role": "system", "content": system}]
    roles = ("user", "assistant")
    messages += [{"role": roles[i % 2], "content": turn} for i, turn in enumerate(turns)]
    return llm.encode_chat(messages)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def token_ids(outputs: Sequence[RequestOutput]) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in outputs]


def block_size(llm: LLM) -> int:
    return llm.engine.config.block_size


def assert_valid_hit(output: RequestOutput, block: int, at_least: int = 1) -> None:
    """A cache hit covers whole blocks, at least `at_least` tokens, and never the whole prompt."""
    cached = output.num_cached_tokens
    assert cached >= at_least, (cached, at_least)
    assert cached % block == 0, cached
    assert cached < len(output.prompt_token_ids), (cached, len(output.prompt_token_ids))


def prefill_tokens(llm: LLM) -> int:
    return llm.engine.stats().num_computed_prompt_tokens


def test_requests_sharing_a_long_system_prompt(llm: LLM, uncached: LLM) -> None:
    block = block_size(llm)
    prompts = [chat(llm, BAKERY, question) for question in QUESTIONS[:5]]
    shared = common_prefix_len(prompts[0], prompts[1])
    assert shared >= 180  # the ~180-token system text and the template around it

    first = llm.generate(prompts[:1], GREEDY)
    before = prefill_tokens(llm)
    rest = llm.generate(prompts[1:], GREEDY)
    computed = prefill_tokens(llm) - before

    assert token_ids(first + rest) == token_ids(uncached.generate(prompts, GREEDY))
    for output in rest:
        assert_valid_hit(output, block, at_least=shared // block * block)
    # The hits are real: only the tokens the cache did not cover went through the model.
    assert computed == sum(len(o.prompt_token_ids) - o.num_cached_tokens for o in rest)
    assert_no_leak(llm)


def test_prompts_sharing_a_part_that_ends_mid_block(llm: LLM, uncached: LLM) -> None:
    block = block_size(llm)
    text = LIBRARY + " Also, the reading garden behind the building opens in May."
    shared_len = 5 * block + 7
    shared = llm.tokenizer(text).input_ids[:shared_len]
    endings = [
        " Which floor has the maps?",
        " How long can I keep a book?",
        " What does colour printing cost?",
    ]
    variants = [shared + llm.tokenizer(ending).input_ids for ending in endings]
    assert len({variant[shared_len] for variant in variants}) == len(endings)  # they part at shared_len

    [first] = llm.generate([shared], GREEDY)
    # Submitted together after it: the variants, and the very same prompt once more.
    later = llm.generate([*variants, shared], GREEDY)
    expected = uncached.generate([shared, *variants, shared], GREEDY)

    assert token_ids([first, *later]) == token_ids(expected)
    # Only the 5 full blocks of the shared part can be reused: the 6th holds tokens where they differ.
    for output in later[:-1]:
        assert output.num_cached_tokens == 5 * block
    # The same prompt again: all cached but its last token (here mid-block), rounded down to blocks.
    assert later[-1].num_cached_tokens == (shared_len - 1) // block * block
    assert_no_leak(llm)


def test_multi_turn_chat_reuses_the_whole_first_turn(llm: LLM, uncached: LLM) -> None:
    block = block_size(llm)
    turn1 = chat(llm, GARDEN, "How big is a plot?")
    [answer1] = llm.generate([turn1], GREEDY)
    [expected1] = uncached.generate([turn1], GREEDY)
    assert token_ids([answer1]) == token_ids([expected1])

    answer = answer1.outputs[0]
    turn2 = chat(llm, GARDEN, "How big is a plot?", answer.text, "And what does it cost?")
    history = turn1 + answer.token_ids
    assert turn2[: len(history)] == history  # the template re-encodes turn 1 to the same tokens
    [answer2] = llm.generate([turn2], GREEDY)
    [expected2] = uncached.generate([turn2], GREEDY)

    assert token_ids([answer2]) == token_ids([expected2])
    # Every token of turn 1 whose KV was computed is reused: all but the last answer token (it was
    # sampled, never fed back), rounded down to whole blocks.
    assert_valid_hit(answer2, block, at_least=(len(history) - 1) // block * block)
    assert expected2.num_cached_tokens == 0
    assert_no_leak(llm)


def test_concurrent_requests_with_the_same_prefix(llm: LLM, uncached: LLM) -> None:
    """Submitted together, more prompt tokens than one step's budget: the first step's requests
    all compute the prefix (nothing is cached yet), the later ones find it once those finish."""
    block = block_size(llm)
    system = f"{LIBRARY} {GARDEN}"  # a prefix no other test has cached
    questions = [*QUESTIONS, "Is the garden open in winter?", "Can children join?"]
    prompts = [chat(llm, system, question) for question in questions]
    # The first step's budget holds ~7 of these prompts, so the last ones wait a step or two.
    assert sum(map(len, prompts[:8])) > llm.engine.config.max_num_batched_tokens
    shared = common_prefix_len(prompts[0], prompts[-1])

    outputs = llm.generate(prompts, GREEDY)
    expected = uncached.generate(prompts, GREEDY)

    assert token_ids(outputs) == token_ids(expected)
    assert outputs[0].num_cached_tokens == 0
    hits = [output for output in outputs if output.num_cached_tokens]
    assert hits, [output.num_cached_tokens for output in outputs]
    for output in hits:
        assert_valid_hit(output, block, at_least=shared // block * block)
    assert all(output.num_cached_tokens == 0 for output in expected)
    assert_no_leak(llm)


SMALL_POOL = 40  # blocks: 640 tokens


@pytest.fixture(scope="module")
def small() -> LLM:
    """The bundled model with prefix caching on and a tiny KV pool."""
    return LLM(num_kv_blocks=SMALL_POOL, max_num_seqs=16, quantization="none")


def steps(llm: LLM) -> Iterator[list[RequestOutput]]:
    """Step the engine until no request is left, yielding each step's outputs; fails (instead of
    hanging) when the requests stop making progress."""
    engine = llm.engine
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            return
        yield engine.step()
    stuck = engine.scheduler
    waiting = [(request.request_id, len(request.block_table)) for request in stuck.waiting]
    pytest.fail(
        f"unfinished after {MAX_STEPS} steps: {len(stuck.running)} running, waiting (id, blocks held) "
        f"{waiting}, {engine.block_pool.num_free} blocks free"
    )


def run_together(
    llm: LLM, prompts: Sequence[list[int]], params: SamplingParams
) -> tuple[list[RequestOutput], int]:
    """Submit every prompt at once and step the engine until all finish, like `LLM.generate`.

    Also returns a lower bound on the blocks the prefix cache evicted: blocks leave the tree only by
    eviction, so whatever it lost during a step was evicted (a step may add some, too).
    """
    engine = llm.engine
    cache = engine.scheduler.prefix_cache
    assert isinstance(cache, RadixCache)
    ids = [engine.add_request(f"pressure-{index}", prompt, params) for index, prompt in enumerate(prompts)]
    done: dict[str, RequestOutput] = {}
    evicted = 0
    before = cache.num_cached_blocks
    for outputs in steps(llm):
        done.update((output.request_id, output) for output in outputs if output.finished)
        evicted += max(0, before - cache.num_cached_blocks)
        before = cache.num_cached_blocks
    return [done[request_id] for request_id in ids], evicted


def test_small_pool_under_heavy_prefix_traffic(small: LLM, uncached: LLM) -> None:
    cache = small.engine.scheduler.prefix_cache
    assert isinstance(cache, RadixCache)
    cache.reset()
    block = block_size(small)
    systems = [BAKERY[:320], LIBRARY[:320], GARDEN[:320]]
    prompts = [chat(small, systems[i % 3], QUESTIONS[i // 3]) for i in range(24)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    # Each request holds ~7 blocks at its peak; all 24 together would need ~4x the pool.
    assert sum(len(prompt) + 16 for prompt in prompts) > 3 * SMALL_POOL * block

    outputs, evicted = run_together(small, prompts, params)
    expected = uncached.generate(prompts, params)

    assert token_ids(outputs) == token_ids(expected)
    assert all(output.outputs[0].finish_reason == "length" for output in outputs)
    assert evicted > 0
    hit = [index for index, output in enumerate(outputs) if output.num_cached_tokens]
    assert {index % 3 for index in hit} == {0, 1, 2}  # every system prompt was found again
    for index in hit:
        assert_valid_hit(outputs[index], block)
    assert_no_leak(small)  # every used block is held by the tree alone...
    cache.reset()
    assert small.engine.block_pool.num_free == SMALL_POOL  # ...and the tree held one reference each


def test_waiting_choices_holding_a_shared_prompt_do_not_stall_the_queue(small: LLM) -> None:
    """An n > 1 request's later choices wait holding their first choice's prompt blocks. Queued
    behind a request that needs more blocks than the rest of the pool, they must not wait forever.

    Fails today: the scheduler admits strictly in queue order, so once the first choice finishes
    the big request waits for blocks that only the choices queued behind it can give back.
    """
    engine = small.engine
    text = small.tokenizer("The history of Venice is long and full of surprises. " * 60).input_ids
    shared, big = text[:300], text[5:505]  # 18 full blocks that the choices share; 32 blocks
    group = engine.add_request("group", shared, SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=8))
    engine.add_request("big", big, SamplingParams(temperature=0, max_tokens=4))
    done: dict[str, RequestOutput] = {}
    try:
        for outputs in steps(small):
            done.update((output.request_id, output) for output in outputs if output.finished)
    finally:
        for request_id in (group, "big"):
            engine.abort(request_id)  # leave the shared engine clean if this failed
    assert [len(choice.token_ids) for choice in done[group].outputs] == [8, 8, 8, 8]
    assert len(done["big"].outputs[0].token_ids) == 4
    assert_no_leak(small)


def test_prompt_logprobs_bypass_the_cache(llm: LLM, uncached: LLM) -> None:
    prompt = chat(llm, LIBRARY.replace("Northfield", "Southbank"), "Can I print in colour?")
    [warm] = llm.generate([prompt], GREEDY)
    [hit] = llm.generate([prompt], GREEDY)
    assert hit.num_cached_tokens > 0  # the prompt is in the cache...

    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=3)
    before = prefill_tokens(llm)
    [output] = llm.generate([prompt], params)
    computed = prefill_tokens(llm) - before
    [expected] = uncached.generate([prompt], params)

    # ...but a request for prompt logprobs computes all of it.
    assert output.num_cached_tokens == 0
    assert computed == len(prompt)
    assert token_ids([output]) == token_ids([expected]) == [warm.outputs[0].token_ids[:4]]
    got, want = output.prompt_logprobs, expected.prompt_logprobs
    assert got is not None and want is not None
    assert len(got) == len(want) == len(prompt)
    assert got[0] is None and want[0] is None
    for position, (mine, theirs) in enumerate(zip(got[1:], want[1:], strict=True), start=1):
        assert mine is not None and theirs is not None
        assert mine.token_id == theirs.token_id == prompt[position]
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
        assert [t for t, _ in mine.top] == [t for t, _ in theirs.top]
        assert [lp for _, lp in mine.top] == pytest.approx([lp for _, lp in theirs.top], abs=1e-4)
    assert_no_leak(llm)


MUSEUM = (
    "You answer questions for the Harbour Museum of Ships. The museum is open from ten to five, "
    "Tuesday to Sunday. Tickets cost eight euros, children under twelve go free. The steam tug Ada "
    "can be boarded on the hour; the lighthouse lens gallery is on the top floor. Keep it short."
)


def test_prefix_cache_hits_do_not_cross_tenants(llm: LLM) -> None:
    """A tenant's prompts are matched only by its own (and, with a cache_salt, by the same salt):
    a hit would tell one client that another sent the same prompt (issue #38)."""
    engine = llm.engine
    prompt = chat(llm, MUSEUM, "Can I board the tug?")

    def run(request_id: str, tenant: str, cache_salt: str | None = None) -> RequestOutput:
        engine.add_request(request_id, prompt, GREEDY, tenant=tenant, cache_salt=cache_salt)
        finished = [output for outputs in steps(llm) for output in outputs if output.finished]
        [output] = finished
        return output

    first = run("museum-alice", "alice")
    assert first.num_cached_tokens == 0
    other = run("museum-bob", "bob")
    assert other.num_cached_tokens == 0, "bob's prompt was served from alice's cache"
    salted = run("museum-alice-salted", "alice", cache_salt="user-7")
    assert salted.num_cached_tokens == 0, "a salted prompt was served from the unsalted cache"
    again = run("museum-alice-again", "alice")
    block = block_size(llm)
    assert_valid_hit(again, block, at_least=(len(prompt) - 1) // block * block)
    assert token_ids([first]) == token_ids([other]) == token_ids([salted]) == token_ids([again])
    assert_no_leak(llm)
