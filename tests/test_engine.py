"""Tests for engine/paged.py, the sampler's engine: the paged KV cache, continuous batching, budgets,
preemption.

Whatever the budget, the row cap or the block size, every sample is the one the sampler draws
with everything fitting at once, and that is each prompt's own sample drawn alone: token for
token in float32, log-probs within 1e-4. Budgets here are small enough to force waits and
preemptions (counted), and the pool never holds more than it was given."""

import pytest
import torch
from test_rollout import tiny  # noqa: F401 (the fixture: a family's tiny model, loaded once)
from torch.nn.attention.flex_attention import flex_attention

from conftest import FAMILIES, generate_args, random_ids
from engine.paged import EngineOptions
from engine.speedups import SpeedUps
from rollout import Sampling, generate

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def prompts_of(model, lengths=(7, 12, 3, 9, 20)):
    return [random_ids(1, n, model.config.vocab_size, seed=i)[0].tolist()
            for i, n in enumerate(lengths)]


def assert_same(got, want):
    """Completions equal token for token, log-probs within 1e-4 (prompt indices aside)."""
    for a, b in zip(got, want, strict=True):
        assert (a.tokens, a.finish_reason) == (b.tokens, b.finish_reason)
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def budget(model, blocks, block_size=16):
    """kv_budget in GiB that holds `blocks` blocks (the scratch block included)."""
    cfg = model.config
    return blocks * 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * 4 / 2**30


SAMPLING = [dict(temperature=0.0), dict(temperature=1.0, seed=3, stop_token_ids=[9, 17, 30]),
            dict(temperature=0.8, top_p=0.9, top_k=20, seed=4)]


QUICK = ("llama3", "qwen3_moe")  # the other families in the full tier


@pytest.mark.parametrize("family", [f if f in QUICK else pytest.param(f, marks=pytest.mark.slow)
                                    for f in FAMILIES])
def test_all_rows_at_once_equal_each_prompt_alone(tiny, family):
    """Every family (sliding windows past their width, soft caps, MoE with its routing recorded),
    greedy, sampled, truncated, with stop tokens."""
    model = tiny(family)
    prompts = prompts_of(model)
    for kw in SAMPLING:
        kw = dict(num_samples=3, max_new_tokens=24, compile=False, record_routing=True, **kw)
        together = generate(model, prompts, **generate_args(**kw))
        for i, prompt in enumerate(prompts):
            seed = kw.get("seed", 0) * 1_000_003 + i  # the seed generate gives prompt i
            alone = generate(model, [prompt], **generate_args(**{**kw, "seed": [seed]}))
            assert_same(alone, together[3 * i:3 * i + 3])
            for a, b in zip(alone, together[3 * i:3 * i + 3]):
                assert (a.routing is None) == (model.config.num_experts == 0)
                assert a.routing is None or torch.equal(a.routing, b.routing)


@pytest.mark.parametrize("family", ["llama3", "mistral", "qwen3_moe"])
@pytest.mark.parametrize("limits", [dict(max_rows=1), dict(max_rows=3), dict(blocks=5),
                                    dict(blocks=7), dict(blocks=12, max_rows=5)])
def test_budgets_and_row_caps_keep_every_sample(tiny, family, limits):
    """A pool of one row's worth (5 blocks: 4 for 20 + 40 positions, and the scratch block), a
    few rows' worth, row caps of 1 and 3: admission waits, preemptions, the same samples."""
    model = tiny(family)
    prompts = prompts_of(model)
    kw = dict(num_samples=3, max_new_tokens=40, temperature=1.0, seed=5, stop_token_ids=[9, 17],
              compile=False, record_routing=True)
    want = generate(model, prompts, **generate_args(**kw))
    stats = {}
    blocks = limits.get("blocks")
    got = generate(model, prompts,
                   **generate_args(kv_budget=budget(model, blocks) if blocks else None,
                                   max_rows=limits.get("max_rows"), stats=stats, **kw))
    assert_same(got, want)
    assert [c.prompt_index for c in got] == [c.prompt_index for c in want]
    for a, b in zip(got, want):
        assert a.routing is None or torch.equal(a.routing, b.routing)
    assert stats["waits"] > 0 and stats["blocks_in_use"] == 0
    assert stats["peak_blocks"] <= stats["pool_blocks"] - 1
    if blocks:
        assert stats["pool_blocks"] == blocks and stats["preemptions"] > 0, stats


@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_block_sizes_keep_every_sample(tiny, block_size):
    model = tiny("gemma3")  # sliding layers with a window of 16 and their own rotary base
    prompts = prompts_of(model)
    kw = dict(num_samples=2, max_new_tokens=30, temperature=1.0, seed=6, compile=False)
    stats = {}
    assert_same(generate(model, prompts, **generate_args(block_size=block_size, stats=stats, **kw)),
                generate(model, prompts, **generate_args(**kw)))
    assert stats["blocks_in_use"] == 0


@pytest.mark.parametrize("family", [f if f in QUICK + ("gemma2",) else
                                    pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES])
def test_kept_rows_equal_a_gather_at_every_step(tiny, family, monkeypatch):
    """speed.KeptRowsKVCache, a CPU's cache for eager steps with no budget, keeps the decoding
    rows' keys gathered between steps: the samples of the pool gathered at every step, with rows
    that stop, rows that join mid-decode (a row cap), one-position blocks (the tables widen at
    every step), soft caps and sliding windows. It gathers again only when the rows change or
    their tables widen, and is not taken under a budget."""
    from engine import speedups
    from engine.speed import KeptRowsKVCache
    from model import PagedKVCache
    caches = []

    class Recorded(KeptRowsKVCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            caches.append(self)
    monkeypatch.setattr(speedups, "KeptRowsKVCache", Recorded)
    model = tiny(family)
    prompts, layers = prompts_of(model), model.config.num_layers
    for limits in (dict(stop_token_ids=[9, 17, 30]), dict(max_rows=4, stop_token_ids=[9]),
                   dict(block_size=1)):
        kw = dict(num_samples=3, max_new_tokens=30, temperature=1.0, seed=7, compile=False,
                  record_routing=True, **limits)
        stats = {}
        got = generate(model, prompts, **generate_args(stats=stats, **kw))
        with monkeypatch.context() as gathering:
            gathering.setattr(speedups, "KeptRowsKVCache", PagedKVCache)
            want = generate(model, prompts, **generate_args(**kw))
        assert_same(got, want)
        for a, b in zip(got, want):
            assert a.routing is None or torch.equal(a.routing, b.routing)
        assert layers <= caches[-1].gathers <= layers * stats["decode_steps"], limits
    # Every row to the limit, lengths 3 to 20 + 30 positions: widening at 32 and 48, gathered 3 times
    generate(model, prompts, Sampling(max_new_tokens=30, temperature=1.0), num_samples=3,
             engine=EngineOptions(speed=SpeedUps(compile=False)))
    assert caches[-1].gathers == 3 * layers
    generate(model, prompts, Sampling(max_new_tokens=30), num_samples=3,
             engine=EngineOptions(kv_budget=budget(model, 40), speed=SpeedUps()))
    assert len(caches) == 4  # under a budget the pool alone


@pytest.mark.parametrize("family", ["llama3"] + [pytest.param(f, marks=pytest.mark.slow) for f in
                                                  ("mistral", "gemma2", "gemma3", "qwen3_moe")])
def test_flex_attention_reads_the_pool_as_the_gather_does(tiny, family, monkeypatch):
    """flex_decode.FlexPagedKVCache (decode attention through FlexAttention over the pool in
    place; eager here, so its mask_mod alone decides what each row sees): the samples of the
    gathered path, for each kind of attention (grouped heads, sliding windows past their width,
    Gemma 3's local layers, Gemma 2's soft cap, MoE routing), with rows that stop, a budget that forces waits and preemptions
    (stale keys left in blocks that change hands), one-position blocks, and the steps padded to
    buckets of rows and blocks as CUDA graphs replay them (padding rows see nothing)."""
    from engine import flex_decode
    calls = []
    monkeypatch.setattr(flex_decode, "flex_attention",
                        lambda *args, **kwargs: calls.append(1) or flex_attention(*args, **kwargs))
    model = tiny(family)
    prompts = prompts_of(model)
    for limits in (dict(stop_token_ids=[9, 17, 30]), dict(kv_budget=budget(model, 7)),
                   dict(block_size=1, max_rows=4), dict(cuda_graphs=True, top_k=20)):
        kw = dict(num_samples=3, max_new_tokens=30, temperature=1.0, seed=11, compile=False,
                  record_routing=True, **limits)
        stats = {}
        got = generate(model, prompts, **generate_args(flex_attention=True, stats=stats, **kw))
        want = generate(model, prompts, **generate_args(**kw))
        assert_same(got, want)
        for a, b in zip(got, want):
            assert a.routing is None or torch.equal(a.routing, b.routing)
        if "kv_budget" in limits:
            assert stats["preemptions"] > 0 and stats["waits"] > 0
        assert len(calls) >= model.config.num_layers * stats["decode_steps"]  # every layer's
        calls.clear()


@pytest.mark.slow
def test_flex_attention_in_a_compiled_step(tiny):
    """compile=True with flex_attention=True: the whole decode step through torch.compile, where
    inductor lowers FlexAttention to its fused kernel (a CPU template here, as Triton on CUDA),
    which takes a BlockMask spanning every key of the pool: the eager gathered path's samples."""
    model = tiny("llama3")
    prompts = prompts_of(model, (4, 9, 13))
    kw = dict(num_samples=3, max_new_tokens=20, temperature=1.0, seed=3)
    assert_same(generate(model, prompts, **generate_args(compile=True, flex_attention=True, **kw)),
                generate(model, prompts, **generate_args(compile=False, **kw)))


def test_flex_block_mask_by_hand():
    """Blocks of 4 in a pool of 5, tables 8 wide (a bucket wider than the pool): row 0 holds
    blocks 3, 1 and is at position 5 (it sees pool positions 12-15 and 4, 5); row 1 holds block 2
    (stale keys past its position 1) and sees 8, 9; row 2 pads a bucket (block 0 at position 0)
    and sees nothing. With a window of 2, row 0 sees positions 4 and 5 only, and visits only
    their block, 1."""
    from engine.flex_decode import FlexPagedKVCache
    from model import ModelConfig
    cfg = ModelConfig("llama", 32, 8, 16, 1, 2, 1, 4, 1e-5, 1e4, None, 64, False, False, False,
                      sliding_window=2, layer_types=("sliding",))
    cache = FlexPagedKVCache(cfg, 5, 4, torch.float32, "cpu")
    cache.tables = torch.tensor([[3, 1] + [0] * 6, [2] + [0] * 7, [0] * 8])
    cache.positions = torch.tensor([[5], [1], [0]])
    seen = {}
    for window in (None, 2):
        mask = cache.block_mask(window)
        dense = mask.mask_mod(torch.arange(3)[:, None], 0, 0, torch.arange(20)[None])  # (3, 20)
        seen[window] = [torch.nonzero(r).view(-1).tolist() for r in dense]
        count = mask.kv_num_blocks.view(-1).tolist()
        assert count == ([2, 1, 1] if window is None else [1, 1, 1])
        assert [row[:n] for row, n in zip(mask.kv_indices[:, 0, 0].tolist(), count)] == (
            [[3, 1], [2], [0]] if window is None else [[1], [2], [0]])
    assert seen[None] == [[4, 5, 12, 13, 14, 15], [8, 9], []]
    assert seen[2] == [[4, 5], [8, 9], []]


@pytest.mark.parametrize("block_size", [1, 3, 4])
def test_flex_lists_every_block_a_row_sees_and_no_more(block_size):
    """A compiled FlexAttention kernel visits only the blocks a BlockMask lists (eager, as in the
    other CPU tests, reads the mask_mod over the whole pool and would not notice a block missing
    from the list). For random rows of a pool (prompt blocks shared at one place, each row's own
    after them, tables padded to a bucket), positions and windows: the first `count` listed blocks
    are exactly the blocks in which the mask_mod sees a key."""
    from engine.flex_decode import FlexPagedKVCache
    from model import ModelConfig
    generator = torch.Generator().manual_seed(block_size)
    for window in (None, 1, 2, 5, 9):
        cfg = ModelConfig("llama", 32, 8, 16, 1, 2, 1, 4, 1e-5, 1e4, None, 64, False, False, False,
                          sliding_window=window, layer_types=("sliding" if window else "full",))
        blocks = torch.randperm(40, generator=generator)[:30] + 1  # pool blocks 1..40, shuffled
        shared, own = blocks[:3].tolist(), blocks[3:].view(3, 9).tolist()  # a prompt's, rows'
        positions = torch.randint(0, 12 * block_size, (3,), generator=generator)
        tables = torch.zeros(4, 16, dtype=torch.long)  # a 4th row pads the bucket
        for r in range(3):
            row = (shared + own[r])[:int(positions[r]) // block_size + 1]
            tables[r, :len(row)] = torch.tensor(row)
        cache = FlexPagedKVCache(cfg, 41, block_size, torch.float32, "cpu")
        cache.tables, cache.positions = tables, torch.cat([positions, torch.zeros(1).long()])[:, None]
        mask = cache.block_mask(window)
        keys = torch.arange(41 * block_size)
        dense = mask.mask_mod(torch.arange(4)[:, None], 0, 0, keys[None])  # (4, pool positions)
        count = mask.kv_num_blocks.view(-1).tolist()
        for r in range(3):
            listed = mask.kv_indices[r, 0, 0, :count[r]].tolist()
            assert sorted(set((keys[dense[r]] // block_size).tolist())) == sorted(listed), (window, r)
        assert not dense[3].any()


@torch.no_grad()
def test_flex_masks_follow_each_forward(tiny):
    """Decode forwards through one tables tensor at new positions, as a CUDA graph's replays feed
    its static inputs: each forward attends as the gathered path does (its own BlockMask)."""
    from engine.flex_decode import FlexPagedKVCache
    from model import PagedKVCache
    model = tiny("mistral")
    caches = [kind(model.config, 6, 4, torch.float32, "cpu") for kind in (FlexPagedKVCache,
                                                                          PagedKVCache)]
    ids = random_ids(1, 20, model.config.vocab_size, seed=2)  # past the window of 16
    tables, one = torch.tensor([[1, 2, 3, 4, 5]]), torch.ones(1, dtype=torch.long)
    for cache in caches:  # the first 17 positions; then decode steps at 17, 18, 19
        model.paged(ids[:, :17], torch.tensor([0]), torch.tensor([17]), tables, cache,
                    with_logits=False)
    for t in (17, 18, 19):
        flex, gathered = (model.paged(ids[:, t:t + 1], torch.tensor([t]), one, tables, cache)
                          for cache in caches)
        assert torch.allclose(flex, gathered, atol=1e-5), t


def test_a_prompt_is_prefilled_once_for_its_samples(tiny):
    """The prefill computes sum(prompt lengths) positions, not G times that: the samples share
    the prompt's blocks (a partly filled last block is copied when a sample first writes)."""
    model = tiny("llama3")
    prompts = prompts_of(model)
    stats = {}
    generate(model, prompts, Sampling(max_new_tokens=5, temperature=1.0), num_samples=8,
             engine=EngineOptions(speed=SpeedUps()), stats=stats)
    assert stats["prefill_tokens"] == sum(map(len, prompts))
    # Blocks at the peak: each prompt's one shared block (all under 16 tokens but the last, 2),
    # plus at most one block of its own per sample.
    assert stats["peak_blocks"] <= 6 + 8 * len(prompts)


def test_a_budget_16x_below_the_static_cache(tiny):
    """The static cache of all rows at once (rows x (longest prompt + max_new_tokens) positions)
    would need 16x the pool: the call runs within the pool, same samples."""
    model = tiny("llama3")
    prompts = prompts_of(model, lengths=(10, 12, 9, 11))
    kw = dict(num_samples=8, max_new_tokens=52, temperature=1.0, seed=7, stop_token_ids=[],
              compile=False)
    stats = {}
    got = generate(model, prompts,
                   **generate_args(kv_budget=budget(model, 9, 8), block_size=8, stats=stats, **kw))
    static_bytes = 32 * (12 + 52) * stats["block_bytes"] // 8
    assert static_bytes >= 16 * stats["pool_blocks"] * stats["block_bytes"]
    assert stats["peak_blocks"] * stats["block_bytes"] <= static_bytes / 16
    assert stats["preemptions"] > 0
    assert_same(got, generate(model, prompts, **generate_args(**kw)))


def test_on_cuda_the_pool_leaves_the_decode_steps_memory_free(tiny, monkeypatch):
    """On CUDA the pool takes 90% of the free memory less the decode step's working memory (the
    larger of its draw, rows x V x 16 B, and one layer's gathered keys and scores at the widest
    row; under CUDA graphs at the bucket of rows and blocks, twice, as memory_plan counts it), so
    a capacity-bound pool cannot starve the step's logits, its attention or the graphs' capture;
    FlexAttention gathers nothing, and each block costs its entries in the step's maps of the
    pool. (A stand-in device: only the CUDA memory figures are read, stubbed.)"""
    import dataclasses
    import types

    from engine import flex_decode
    from engine import paged as engine
    from model import PagedKVCache
    cfg = tiny("llama3").config
    stand_in = types.SimpleNamespace(config=cfg, dtype=torch.bfloat16, device=torch.device("cuda"))
    free = 2**21  # bytes: a pool bound by the device, not by the rows
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, 2 * free))
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: {})
    block_bytes = PagedKVCache.bytes_per_block(cfg, 16, torch.bfloat16)
    prompts, counts = [[1] * 10] * 4, [32] * 4  # 128 rows of every row at its longest: 5 blocks
    H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    for rows, graphs, R, S in [(None, False, 128, 80), (24, True, 32, 128)]:  # padded: buckets
        draw = R * cfg.vocab_size * 16
        attention = 2 * Hkv * R * S * D * 2 + H * R * S * (2 + 8)  # bf16 keys; scores, softmax
        working = max(draw, attention) * (2 if graphs else 1)
        assert working == engine.decode_working_bytes(cfg, rows or 128, graphs, positions=80,
                                                      width=2)
        blocks = engine.pool_blocks(stand_in, prompts, counts, 64, 16, None, rows, graphs)
        assert blocks == int(0.9 * (free - working) // block_bytes) < 1 + 128 * 5, (rows, graphs)
        # FlexAttention's maps: 4 bytes a block in `place` and in each row's list (under graphs
        # again in their pool, 32 padded rows), for the one kind of layer; no gathered keys
        flex = engine.pool_blocks(stand_in, prompts, counts, 64, 16, None, rows, graphs,
                                  flex_decode.FlexPagedKVCache)
        maps = 4 * (1 + 24) + 4 * (1 + 32) if graphs else 4 * (1 + 128)
        draw_only = draw * (2 if graphs else 1)
        assert flex == int(0.9 * (free - draw_only) // (block_bytes + maps))
    sliding = dataclasses.replace(cfg, sliding_window=8, layer_types=("full", "sliding"))
    assert flex_decode.map_bytes(sliding, 3) == 2 * 4 * (1 + 3)  # each kind of layer its maps


@pytest.mark.parametrize("limits", [dict(), dict(blocks=6, max_rows=4)])
def test_prompts_added_as_groups_end_keep_every_sample(tiny, limits):
    """on_group (dynamic sampling's refills): prompts that join the queue while earlier rows
    still run, under a budget that forces waits and preemptions, give the samples and routes of
    one call with all of them; each prompt's group is reported once, as its last row ends."""
    model = tiny("qwen3_moe")
    first, later = prompts_of(model, (7, 12, 3)), prompts_of(model, (9, 20, 5, 11))[1:]
    kw = dict(num_samples=3, max_new_tokens=30, temperature=1.0, stop_token_ids=[9, 17, 30],
              compile=False, record_routing=True)
    seeds = [11, 12, 13, 21, 22, 23]
    want = generate(model, first + later, **generate_args(seed=seeds, **kw))
    reported = []

    def on_group(index, completions):
        reported.append((index, completions))
        if len(reported) == 1:  # the first group to end brings the later prompts in
            return later, [3] * len(later), seeds[3:]
    stats = {}
    blocks = limits.get("blocks")
    got = generate(model, first, **generate_args(seed=seeds[:3], on_group=on_group, stats=stats,
                   kv_budget=budget(model, blocks) if blocks else None,
                   max_rows=limits.get("max_rows"), **kw))
    assert_same(got, want)
    assert [c.prompt_index for c in got] == [i for i in range(6) for _ in range(3)]
    for a, b in zip(got, want):
        assert torch.equal(a.routing, b.routing)
    assert sorted(i for i, _ in reported) == list(range(6)) and reported[0][0] < 3
    for index, completions in reported:
        assert_same(completions, got[3 * index:3 * index + 3])
    assert stats["blocks_in_use"] == 0
    if blocks:
        assert stats["preemptions"] > 0 and stats["waits"] > 0, stats


@pytest.mark.parametrize("block_size, blocks", [(3, 24), (16, 5)])
def test_host_tables_follow_every_change(tiny, monkeypatch, block_size, blocks):
    """Engine.host_tables, written where a decoding row's table changes, gives every decode step
    the tables of the rows' own lists: through prefills shared by a prompt's rows, copies on
    write of a shared partial block, preemptions and recomputation, and later, longer prompts
    added as groups end (the host tables widen). And a block is at one place in every table that
    holds it, which flex_decode's map of the pool counts on."""
    from engine import paged as engine
    from model import PagedKVCache
    model = tiny("llama3")
    widths, copies = [], []
    real_tables, real_copy = engine.Engine.decoding_tables, PagedKVCache.copy_block

    def checked(self, rows, index):
        got = real_tables(self, rows, index)
        assert torch.equal(got, engine.pad_rows([row.table for row in rows]))
        widths.append(self.host_tables.shape[1])
        places = {(block, j) for row in rows for j, block in enumerate(row.table)}
        assert len(places) == len({block for block, _ in places})  # one place a block (flex_decode)
        return got
    monkeypatch.setattr(engine.Engine, "decoding_tables", checked)
    monkeypatch.setattr(PagedKVCache, "copy_block", lambda *a: copies.append(1) or real_copy(*a))
    later = prompts_of(model, (4, 22))
    on_group = lambda index, completions: (later, [3, 3], [7, 8]) if index == 0 else None  # noqa
    kw = dict(num_samples=3, max_new_tokens=30, temperature=1.0, seed=[5, 6, 9],
              stop_token_ids=[9, 17], compile=False, block_size=block_size)
    stats = {}
    got = generate(model, prompts_of(model, (7, 12, 5)),
                   **generate_args(on_group=on_group, stats=stats,
                                   kv_budget=budget(model, blocks, block_size), **kw))
    assert len(got) == 15 and stats["preemptions"] > 0 and copies, stats
    assert widths[0] < widths[-1]  # the later prompt of 22 widened the host tables


def test_added_prompts_are_checked_like_the_first(tiny):
    model = tiny("llama3")
    kw = dict(max_new_tokens=40, kv_budget=budget(model, 5))  # the pool: 4, what the first needs
    with pytest.raises(ValueError, match="num_samples must be an int >= 1"):
        generate(model, [[5] * 3],
                 **generate_args(on_group=lambda i, c: ([[6] * 3], [0], [1]), **kw))
    with pytest.raises(ValueError, match="on_group's seeds must be one int per prompt, got 3"):
        generate(model, [[5] * 3], **generate_args(on_group=lambda i, c: ([[6] * 3], [1], 3), **kw))
    with pytest.raises(ValueError, match="generate: prompt 0 is empty"):
        generate(model, [[5] * 3], **generate_args(on_group=lambda i, c: ([[]], [1], [1]), **kw))
    with pytest.raises(ValueError, match=r"needs 5 blocks of 16 positions .* holds 4 blocks"):
        generate(model, [[5] * 3],
                 **generate_args(on_group=lambda i, c: ([[6] * 30], [1], [1]), **kw))


@pytest.mark.parametrize("family", ["llama3", "gemma3"])
def test_decode_padded_to_buckets_keeps_every_sample(tiny, family, monkeypatch):
    """cuda_graphs=True off a GPU: every decode step padded to a bucket of rows and blocks, as the
    captured graphs replay it (padding rows through the scratch block), gives the same samples;
    rows stop at their own lengths, so the row count crosses buckets."""
    from engine import speedups
    from engine.cuda_graphs import bucket, pad_inputs
    assert [bucket(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    fed, tables = torch.tensor([5, 6, 7]), torch.tensor([[1, 2], [3, 0], [4, 5]])
    padded = pad_inputs(fed, fed, tables, fed, fed, 4, 4)
    assert padded[0].tolist() == [5, 6, 7, 0] and padded[2].tolist() == [
        [1, 2, 0, 0], [3, 0, 0, 0], [4, 5, 0, 0], [0, 0, 0, 0]]
    model = tiny(family)
    prompts = prompts_of(model)
    shapes, real = set(), speedups.decode_step  # (rows, blocks) of every step the model runs
    monkeypatch.setattr(speedups, "decode_step", lambda model, fed, start, tables, *rest: (
        shapes.add(tuple(tables.shape)) or real(model, fed, start, tables, *rest)))
    for kw in SAMPLING:
        kw = dict(num_samples=3, max_new_tokens=40, compile=False, **kw)
        assert_same(generate(model, prompts, **generate_args(cuda_graphs=True, **kw)),
                    generate(model, prompts, **generate_args(**kw)))
    padded = {s for s in shapes if bucket(s[0]) == s[0] and bucket(s[1]) == s[1]}
    assert len(padded) >= 2 and any(s not in padded for s in shapes)  # the plain call's too


def test_padded_steps_count_their_buckets(tiny):
    """generate's stats with cuda_graphs: the buckets of (rows, blocks) the decode steps came in
    (on a GPU, a graph captured for each) and the captures' seconds (none off a GPU). By hand:
    3 rows pad to 4; a prompt of 2 in blocks of 4 and 13 new tokens feed positions 2 to 13, in
    tables of 1, 2, 3 and 4 blocks: buckets (4, 1), (4, 2), (4, 4)."""
    model, stats = tiny("llama3"), {}
    out = generate(model, [[5, 6]], Sampling(max_new_tokens=13, seed=1), num_samples=3,
                   engine=EngineOptions(block_size=4,
                                        speed=SpeedUps(cuda_graphs=True, compile=False)),
                   stats=stats)
    assert [len(c.tokens) for c in out] == [13] * 3 and stats["decode_steps"] == 12
    assert stats["graph_buckets"] == 3 and stats["capture_seconds"] == 0.0
    generate(model, [[5, 6]], Sampling(max_new_tokens=9),
             engine=EngineOptions(block_size=4, speed=SpeedUps()), stats=(plain := {}))
    assert "graph_buckets" not in plain


@pytest.mark.parametrize("family", ["gemma3", "llama3"])
def test_compiled_blocks_make_one_graph_for_every_layer(tiny, family, monkeypatch):
    """compile=True with cuda_graphs=True (cuda_graphs.CompiledBlocks): every layer's block runs
    through the compiled block, and one graph serves them all, sliding and full layers alike
    (Gemma 3's 3 layers: 2 kinds of mask and rotation; Llama 3's 3), with no graph break; the
    samples do not change. Counted with torch.compile's frame counter as the backend (the graph
    runs as traced); test_compiled_blocks_under_inductor_keep_every_sample compiles it."""
    from torch._dynamo.testing import CompileCounter

    from engine import cuda_graphs
    torch._dynamo.reset()  # no entries left on Block.forward by other tests in this process
    counter, calls = CompileCounter(), []
    compiled = torch.compile(cuda_graphs.Block.forward, backend=counter, dynamic=True)
    monkeypatch.setattr(cuda_graphs, "compiled_block", lambda: lambda *a: calls.append(1) or
                        compiled(*a))
    from rollout import sample_tokens, step_uniforms  # the draw eager here (compiled: below)
    monkeypatch.setattr(cuda_graphs, "compiled_sampling", lambda *draw: lambda logits, keys, draws, *s:
                        sample_tokens(logits, step_uniforms(keys, draws), *s))
    model = tiny(family)
    prompts = prompts_of(model)[:2]  # 2 prompts x 3 rows: one row bucket of 8, then fewer
    # the prefill draws the first token, one decode step the second
    generate(model, prompts, Sampling(max_new_tokens=2), num_samples=3,
             engine=EngineOptions(speed=SpeedUps(compile=True, cuda_graphs=True)))
    assert counter.frame_count == 1 and len(calls) == model.config.num_layers == 3
    for kw in SAMPLING:
        kw = dict(num_samples=3, max_new_tokens=30, **kw)
        assert_same(generate(model, prompts, **generate_args(compile=True, cuda_graphs=True, **kw)),
                    generate(model, prompts, **generate_args(compile=False, **kw)))
    assert counter.frame_count <= 4  # a bucket of 1 row or 1 block is specialised: recompiled
    assert all("forward" not in vars(layer) for layer in model.layers)  # swapped back after


def test_compiled_blocks_refuse_what_reads_the_layer_index(tiny):
    """FlexAttention's cache and an MoE's routing read a layer's index, which a compiled block
    does not see: SpeedUps refuses flex_attention with compile and cuda_graphs when made (before
    any generate call), and CompiledBlocks refuses an MoE (speedups.step_function keeps one eager)."""
    from engine.cuda_graphs import CompiledBlocks
    from model import PagedKVCache
    from rollout import sample_tokens, step_uniforms
    with pytest.raises(ValueError, match="flex_attention with compile and cuda_graphs: one or"):
        SpeedUps(compile=True, cuda_graphs=True, flex_attention=True)
    moe = tiny("qwen3_moe")
    with pytest.raises(ValueError, match="PagedKVCache and an MoE cannot"):
        cache = PagedKVCache(moe.config, 4, 16, torch.float32, "cpu")
        CompiledBlocks(sample_tokens, step_uniforms)(moe, None, None, None, cache, None, None,
                                                     1.0, 1.0, 0)


@pytest.mark.slow
def test_compiled_blocks_under_inductor_keep_every_sample(tiny):
    """The same with torch.compile's own backend, whose kernels write the cache in place, and the
    step's draw compiled too: the samples of the eager decode, greedy and drawn (top-p and top-k
    too), as rows stop and buckets change."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()  # compiled here, not left to an entry of another test
    model, before = tiny("gemma3"), counters["stats"]["unique_graphs"]
    prompts = prompts_of(model)
    for kw in SAMPLING:
        kw = dict(num_samples=3, max_new_tokens=30, **kw)
        assert_same(generate(model, prompts, **generate_args(compile=True, cuda_graphs=True, **kw)),
                    generate(model, prompts, **generate_args(compile=False, **kw)))
    assert counters["stats"]["unique_graphs"] > before


def test_a_row_that_cannot_fit_alone_is_refused_before_any_work(tiny):
    model = tiny("llama3")
    with pytest.raises(ValueError, match=r"needs 4 blocks of 16 positions .* holds 4 blocks, one of them scratch"):
        generate(model, [[5] * 20], Sampling(max_new_tokens=40),
                 engine=EngineOptions(kv_budget=budget(model, 4), speed=SpeedUps()))
    for bad in (dict(block_size=0), dict(max_rows=0), dict(prefill_tokens=0)):
        with pytest.raises(ValueError, match="block_size, prefill_tokens and max_rows"):
            generate(model, [[5, 6]], **generate_args(max_new_tokens=4, **bad))


def test_prefill_in_chunks_keeps_every_sample(tiny):
    """Prompts prefilled a few positions at a time (chunks of a prompt, and prompts sharing a
    chunk) give the same samples as one prefill."""
    model = tiny("mistral")
    prompts = prompts_of(model, lengths=(7, 30, 3, 19))
    kw = dict(num_samples=2, max_new_tokens=12, temperature=1.0, seed=8, compile=False)
    stats = {}
    assert_same(generate(model, prompts, **generate_args(prefill_tokens=5, stats=stats, **kw)),
                generate(model, prompts, **generate_args(**kw)))
    assert stats["prefill_tokens"] == 59


def test_pad_rows_by_hand():
    """engine.pad_rows: each list in its own row, in order, right-padded with 0 (an empty list is
    a row of padding); prefill chunks and their tables go through it, and the decoding rows'
    tables are checked against it (test_host_tables_follow_every_change)."""
    from engine.paged import pad_rows
    got = pad_rows([[3, 1, 4], [], [15], [9, 2]])
    assert got.dtype == torch.long
    assert got.tolist() == [[3, 1, 4], [0, 0, 0], [15, 0, 0], [9, 2, 0]]
    assert pad_rows([[2**40]]).tolist() == [[2**40]]  # int64, not int32


def test_the_long_tail_workload_of_bench_engine():
    """bench.py engine: stop ids a fraction p of the vocabulary with (1 - p)^N = 5%, and four
    waves of consecutive prompts, the budget what the largest needs at every row's longest."""
    from bench import long_tail_stops, quarter_waves
    stops = long_tail_stops(10_000, 100)
    p = len(stops) / 10_000
    assert stops[-1] == 9_999 and (1 - p) ** 100 == pytest.approx(0.05, rel=0.02)
    prompts = [[1] * 10, [1] * 30, [1] * 5, [1] * 20, [1] * 3]  # 22 new: 2, 4, 2, 3, 2 blocks
    waves, budget = quarter_waves(prompts, 2, 22)
    assert waves == [prompts[:2], prompts[2:4], prompts[4:]] and budget == 1 + 2 * (2 + 4)


def test_bench_engine_reports_the_graphs_captures_apart(capsys):
    """bench.py engine's report: a graphed path's buckets and the seconds its captures took
    (inside its time), and its rate without them: 6 tokens in the last run's 2 s, 0.5 s of them
    captures (its rate the median's: 6 tokens in 3 s)."""
    from bench import report_engine
    outputs = {"paged": [[1, 2, 3], [4, 5, 6]], "paged, CUDA graphs": [[1, 2, 3], [4, 5, 6]]}
    stats = {name: dict(pool_blocks=9, peak_blocks=4, preemptions=0, blocks_read=12, blocks_held=10)
             for name in outputs}
    stats["paged, CUDA graphs"].update(graph_buckets=3, capture_seconds=0.5)
    report_engine(outputs, {"paged": [3.0], "paged, CUDA graphs": [4.0, 2.0]}, "paged", stats,
                  3, 9, 1024, exact=True)  # the median of two runs; captures the last run's
    lines = capsys.readouterr().out.splitlines()
    graphed = next(line for line in lines if line.startswith("  paged, CUDA graphs  "))
    assert "2 tok/s" in graphed and "1.00x" in graphed
    assert graphed.endswith("3 buckets of rows and blocks, captures 0.50 s (without them 4 tok/s)")
    assert "buckets" not in next(line for line in lines if line.startswith("  paged  "))


# ----------------------------------------------------------------------------- the pool's size

GIB = 2 ** 30


def test_a_pool_sized_with_memory_in_the_allocators_cache_equals_a_fresh_ones(tiny, monkeypatch):
    """Step 2 of a GPU run: step 1's pool and update freed into PyTorch's caching allocator, which
    the driver counts as used (0.5 GiB 'free', 4.5 GiB reserved, 1 GiB of it allocated). The pool
    equals the one a fresh process sizes with 4 GiB free and nothing cached, less the decode
    step's gathered keys; the driver's figure alone leaves no room and refuses the call (stubbed
    CUDA calls: the CPU runs it)."""
    from types import SimpleNamespace

    from engine import paged
    cfg = tiny("llama3").config
    gpu_model = SimpleNamespace(config=cfg, dtype=torch.bfloat16, device=torch.device("cuda", 0))
    prompts, counts, new = [[5] * 500] * 8, [16] * 8, 100_000  # 128 rows: far over 4 GiB

    def pool(free, reserved, allocated, split=0):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * GIB))
        monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {
            "reserved_bytes.all.current": reserved, "allocated_bytes.all.current": allocated,
            "inactive_split_bytes.all.current": split})
        return paged.pool_blocks(gpu_model, prompts, counts, new, 16, None)
    fresh, second = pool(4 * GIB, 0, 0), pool(GIB // 2, 9 * GIB // 2, GIB)
    # the free parts of segments partly in use stay the allocator's: not the pool's
    assert pool(GIB, 9 * GIB // 2, GIB, GIB // 2) == fresh
    block_bytes = paged.PagedKVCache.bytes_per_block(cfg, 16, torch.bfloat16)
    widest = paged.blocks_at_longest(prompts[0], new, 16) * 16
    working = paged.decode_working_bytes(cfg, 128, positions=widest, width=2)
    assert working > paged.gathered_bytes(cfg, 128, widest, 2) > GIB  # the gather counted
    assert second == fresh == int(0.9 * (4 * GIB - working) // block_bytes)
    with pytest.raises(ValueError, match="the KV budget holds 0 blocks"):
        pool(GIB // 2, 0, 0)  # what the driver's free memory alone holds


def test_a_cpu_call_with_no_budget_takes_a_share_of_the_free_memory(tiny, monkeypatch):
    """With no kv_budget on a CPU, a call whose rows at their longest (and their gathered copy)
    exceed half the host's free memory (stubbed small) runs in a pool of that half: rows wait and
    are preempted, the cache is the plain one (not the kept rows' copy), and the tokens equal an
    explicit budget's and an unbounded pool's."""
    from engine import paged, speedups
    model = tiny("llama3")
    prompts, kw = prompts_of(model), dict(num_samples=4, max_new_tokens=40, temperature=1.0, seed=5)
    unbounded = generate(model, prompts, **generate_args(**kw))
    block_bytes = paged.PagedKVCache.bytes_per_block(model.config, 16, model.dtype)
    working = paged.decode_working_bytes(model.config, 4 * len(prompts), width=4, draw=16,
                                         positions=paged.blocks_at_longest(prompts[-1], 40, 16) * 16)
    monkeypatch.setattr(paged, "free_host_bytes", lambda: working + 2 * 12 * block_bytes)
    chosen, choose = [], speedups.SpeedUps.choose
    monkeypatch.setattr(speedups.SpeedUps, "choose",
                        lambda self, *a: chosen.append(choose(self, *a)[1]) or choose(self, *a))
    stats = {}
    by_default = generate(model, prompts, **generate_args(stats=stats, **kw))
    assert stats["pool_blocks"] == 12 and stats["waits"] + stats["preemptions"] > 0
    assert chosen == [paged.PagedKVCache]
    assert_same(by_default, unbounded)
    assert_same(by_default, generate(model, prompts, **generate_args(kv_budget=budget(model, 12), **kw)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two ranks on the host: half each
    generate(model, prompts, **generate_args(stats=stats, **kw))
    assert stats["pool_blocks"] == 6
    for bad in ("two", "\u00b2"):  # not torchrun's: one rank (a superscript two: int() refuses it)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", bad)
        generate(model, prompts, **generate_args(stats=stats, **kw))
        assert stats["pool_blocks"] == 12
    monkeypatch.setattr(paged, "free_host_bytes", lambda: 0)  # none: one row, never a refusal
    assert_same(generate(model, prompts, **generate_args(stats=stats, **kw)), unbounded)
    assert stats["pool_blocks"] == 1 + paged.blocks_at_longest(prompts[-1], 40, 16)
    monkeypatch.setattr(paged, "free_host_bytes", lambda: 100 * GIB)  # room: no bound, kept rows
    generate(model, prompts, **generate_args(stats=stats, **kw))
    assert chosen[-1] is speedups.KeptRowsKVCache and stats["waits"] == stats["preemptions"] == 0


def test_the_host_memory_free_is_read_within_the_address_space_limit():
    """free_host_bytes under `ulimit -v` (RLIMIT_AS set 3 GiB above what the process maps): at
    most those 3 GiB, and most of them."""
    import subprocess
    import sys
    code = ("import resource; from engine.paged import free_host_bytes\n"
            "mapped = int(open('/proc/self/status').read().split('VmSize:')[1].split()[0]) * 1024\n"
            "resource.setrlimit(resource.RLIMIT_AS, (mapped + 3 * 2**30, resource.RLIM_INFINITY))\n"
            "print(free_host_bytes())")
    root = str(__import__("pathlib").Path(__file__).parents[1])
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                         check=True).stdout
    assert 2.9 * GIB < int(out) <= 3 * GIB


@pytest.mark.slow
def test_kv_default_recipe_fits_a_call_whose_rows_at_their_longest_do_not():
    """recipes/kv-default.py under a 3 GiB address-space limit: 512 rows x 8,000 new tokens need
    2 GiB at their longest, more than the limit leaves beside torch; with no budget the call runs
    inside it, drawing the tokens of a roomy budget and of one that forces waits and preemptions,
    where the pool of every row at its longest (the CPU's pool before the default) fails."""
    import subprocess
    import sys
    root = __import__("pathlib").Path(__file__).parents[1]
    out = subprocess.run([sys.executable, "recipes/kv-default.py", "--rows", "512",
                          "--new-tokens", "8000", "--limit-gib", "3", "--budget-gib", "1", "0.005"],
                         cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = [line.strip() for line in out.stdout.splitlines()]
    assert "kv_budget=None:" in lines[1] and "kv_budget=1.0: the same tokens" in lines
    assert "kv_budget=0.005: the same tokens" in lines
    waits, preemptions = (int(lines[4].split(f"{word} ")[1].split(",")[0])
                          for word in ("waits", "preemptions"))
    assert lines[4].startswith("kv_budget=0.005:") and waits > 0 and preemptions > 0
    assert "every row at its longest (2.0 GiB): fails" in lines[-1]


def test_train_refuses_a_kv_budget_under_one_row_before_any_weight_loads(tmp_path, monkeypatch):
    """--kv-budget smaller than one row at its longest (the data's longest prompt and
    --max-new-tokens): train.py's setup stops naming the flag and the arithmetic, no weight read."""
    from run import config, launch
    from test_train import digit_checkpoint
    model = digit_checkpoint(tmp_path / "model")
    loads = []
    monkeypatch.setattr(launch, "load_model", lambda *a, **k: loads.append(a))
    argv = ["--model", model, "--out", str(tmp_path / "run"), "--steps", "1", "--compile", "off",
            "--max-new-tokens", "16", "--kv-budget", "0.000001"]
    with pytest.raises(SystemExit) as refused:
        launch.setup(config.parse_config(argv)[0])
    assert "train.py: --kv-budget 1e-06 GiB: a row of" in str(refused.value) and not loads
    assert "new tokens needs" in str(refused.value) and "raise --kv-budget" in str(refused.value)


# ----------------------------------------------------------------------------- reads by groups

def test_read_groups_by_hand():
    """Rows widest first, grouped while a group reads at most 1.25x the blocks its rows hold."""
    from engine.paged import read_groups
    assert read_groups([8, 7, 2, 2, 1]) == [(0, 2, 8), (2, 5, 2)]  # 16 of 15 held; 6 of 5
    assert read_groups([5]) == [(0, 1, 5)] and read_groups([3, 3, 3]) == [(0, 3, 3)]
    assert read_groups([100] + [1] * 50) == [(0, 1, 100), (1, 51, 1)]
    assert read_groups([5, 4]) == [(0, 2, 5)] and read_groups([5, 2]) == [(0, 1, 5), (1, 2, 2)]


@pytest.mark.parametrize("family", ["llama3", "mistral", "gemma2", "qwen3_moe"])
def test_decode_read_in_groups_keeps_every_sample(tiny, family, monkeypatch):
    """A long tail (prompts of 3 to 60 tokens, rows stopping early, one-position blocks: widths
    change at every step): each decode step's rows read in groups of like width give the samples
    of every row read at the widest (sliding windows, soft caps, MoE routes), and attention reads
    at most 1.25x the blocks the rows hold, where reading at the widest reads far more."""
    from engine import paged
    model = tiny(family)
    prompts = prompts_of(model, lengths=(60, 3, 5, 40, 7, 3))
    kw = dict(num_samples=3, max_new_tokens=30, temperature=1.0, seed=8, stop_token_ids=[9, 17],
              compile=False, record_routing=True, kv_budget=budget(model, 400, block_size=1),
              block_size=1)
    grouped, widest = {}, {}
    got = generate(model, prompts, **generate_args(stats=grouped, **kw))
    monkeypatch.setattr(paged, "read_groups", lambda widths: [(0, len(widths), widths[0])])
    want = generate(model, prompts, **generate_args(stats=widest, **kw))
    assert_same(got, want)
    for a, b in zip(got, want):
        assert a.routing is None or torch.equal(a.routing, b.routing)
    assert grouped["blocks_held"] == widest["blocks_held"]
    assert grouped["blocks_read"] <= 1.25 * grouped["blocks_held"] < widest["blocks_read"] / 1.5
