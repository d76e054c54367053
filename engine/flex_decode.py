"""Decode attention that reads the paged KV pool in place, through FlexAttention (Dong et al.
2024, "Flex Attention: A Programming Model for Generating Optimized Attention Kernels"); applied
from outside the model and the sampler: `SpeedUps(flex_attention=True)` (speedups.py) gives
`rollout.generate`'s engine a `FlexPagedKVCache`.

The paged cache's own decode step (model.PagedKVCache.attend) gathers every row's blocks into one
(Hkv, b, S, D) tensor per layer: a copy of all the keys and values the step reads, padded to the
widest table. FlexAttention reads them where they are. A BlockMask lists each row's blocks, its
block table, as the key blocks the row may visit, and a mask_mod says which positions in them it
sees: `place`, the index each pool block has in the tables that hold it (one index: a block is
shared only by one prompt's rows, at the same place in each), maps a pool position to its
position in the row, and the row's table says whether the block is the row's. Compiled
(`torch.compile`, on CUDA) the kernel loads only the listed blocks; eager (the CPU tests) it
evaluates the mask_mod over the whole pool, so the mask_mod alone must be exact. A step's maps,
for each kind of layer: `place`, (pool blocks,) int32, and the BlockMask's list of blocks, (rows,
pool blocks) int32, as wide as the pool (a compiled kernel's BlockMask must span every key). The
pool holds at most every row at its longest (paged.pool_blocks): at 256 rows of 5,000 positions
in blocks of 16 (80k blocks), the list is 82 MB. A prefill chunk keeps the gathered path: many
queries per row read each block once.

    python -m pytest tests/test_engine.py -k flex     # the same tokens as the gathered path
"""

import functools

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from model import PagedKVCache

QUERY_BLOCK = 128  # the BlockMask's query block: one block holds a decode step's single query


def map_bytes(cfg, rows) -> int:
    """A decode step's maps for each block of the pool (`FlexPagedKVCache.block_mask`): its entry
    in `place` and in each of `rows` rows' lists of blocks, int32, for each kind of layer."""
    kinds = len({cfg.sliding_window if kind == "sliding" else None for kind in cfg.layer_types})
    return 4 * (1 + rows) * kinds


@functools.cache
def compiled_flex_attention():
    """flex_attention through torch.compile, once per process: its fused kernel (CUDA)."""
    return torch.compile(flex_attention)


def soft_cap(cap):
    """Gemma 2's score_mod: cap * tanh(score / cap), after the scale, as attend_paged does."""
    def capped(score, row, head, query, key):
        return cap * torch.tanh(score / cap)
    return capped


class FlexPagedKVCache(PagedKVCache):
    """The paged cache whose decode steps attend through FlexAttention over the pool in place.
    One BlockMask per forward and kind of layer (full, or sliding with its window), built at the
    forward's first layer of that kind and read by the others."""
    map_bytes = staticmethod(map_bytes)  # what paged.pool_blocks counts beside each block

    def __init__(self, cfg, num_blocks, block_size, dtype, device):
        super().__init__(cfg, num_blocks, block_size, dtype, device)
        self.windows = [cfg.sliding_window if kind == "sliding" else None
                        for kind in cfg.layer_types]
        self.masks = {}  # window -> this forward's BlockMask
        self.on_cuda = torch.device(device).type == "cuda"

    def attend(self, layer, q, k, v, mask, scale=None, softcap=None):
        """A decode step's attention, q (b, Hq, 1, D), over the pool in place (`mask`, made for
        the gathered path, is not read); a prefill chunk's through the gathered path."""
        b, Hq, T, D = q.shape
        if T > 1:
            return super().attend(layer, q, k, v, mask, scale, softcap)
        self.store(layer, k, v)
        if layer == 0:  # a new forward: new positions (and tables, or a CUDA graph's same tensor)
            self.masks = {}
        window = self.windows[layer]
        if window not in self.masks:
            self.masks[window] = self.block_mask(window)
        H = k.shape[1]
        keys, values = self.kv[layer].view(2, 1, H, -1, D)  # (1, Hkv, N * bs, D) each
        # Compiled on its own on CUDA; inside a compiled step (compile=True) as the step is.
        compiled = self.on_cuda and not torch.compiler.is_compiling()
        flex = compiled_flex_attention() if compiled else flex_attention
        return flex(q, keys, values, score_mod=soft_cap(softcap) if softcap else None,
                    block_mask=self.masks[window], scale=scale, enable_gqa=H != Hq)  # (b, Hq, 1, D)

    def block_mask(self, window=None):
        """This step's BlockMask over the pool's N * bs positions, for b rows with tables (b, nb)
        at positions (b, 1): row r visits the blocks of its table that hold positions up to its
        own (and no further back than `window` reaches), and sees pool position i (block i // bs,
        slot i % bs) when that block is in its table and the position there is at most its own
        (and fewer than `window` back)."""
        tables, position = self.tables, self.positions[:, 0]  # (b, nb), (b,)
        (b, nb), bs, N = tables.shape, self.block_size, self.kv[0].shape[2]
        # place[block] = j where tables[r, j] = block: one j for every row that holds the block,
        # as a block is shared only by one prompt's rows, at the same place in each (paged.py)
        place = torch.full((N,), -1, dtype=torch.int32, device=tables.device)  # (N,)
        place.scatter_(0, tables.reshape(-1), torch.arange(nb, dtype=torch.int32,
                                                           device=tables.device).repeat(b))
        place[0] = -1  # block 0 pads the tables: no row's

        def visible(row, head, query, key):
            block = key // bs
            j = place[block]
            held = (j >= 0) & (tables[row, j.clamp(min=0)] == block)  # a block of this row's
            at = j * bs + key % bs  # the key's position in the row
            seen = held & (at <= position[row])
            return seen if window is None else seen & (position[row] - at < window)

        # The blocks row r visits, in order: those of its table from the first its window reaches
        # (without a window, the table's first) to the one holding its position. As wide as the
        # pool (a compiled kernel's mask must span every key; a bucket's tables may be wider).
        listed = torch.zeros(b, 1, 1, N, dtype=torch.int32, device=tables.device)
        if window is None:
            first = 0
            listed[:, 0, 0, :min(nb, N)] = tables[:, :N]
        else:
            first = (position - window + 1).clamp(min=0) // bs  # (b,)
            columns = first[:, None] + torch.arange(min(nb, N), device=tables.device)  # (b, <= N)
            listed[:, 0, 0, :min(nb, N)] = tables.gather(1, columns.clamp(max=nb - 1))
        count = (position // bs - first + 1).to(torch.int32).view(b, 1, 1)
        return BlockMask.from_kv_blocks(count, listed, BLOCK_SIZE=(QUERY_BLOCK, bs),
                                        mask_mod=visible, seq_lengths=(1, N * bs),
                                        compute_q_blocks=False)
