"""Block masks for the operators: PyTorch's BlockMask class (attnkit's create_block_mask makes
one where PyTorch has it), or attnkit's own for PyTorch 1.13, which has no flex_attention; and
the partial tiles' bits that the operators read."""

import torch

from ._score_graph import compiling

try:  # PyTorch's own (2.5 on): one BlockMask class, so that masks pass both ways
    from torch.nn.attention.flex_attention import BlockMask as _TorchBlockMask
except ImportError:
    _TorchBlockMask = None


class _OwnBlockMask:
    """FlexAttention's block lists for one shape (B, H, Q_LEN, KV_LEN), with the mask_mod to
    evaluate on partial tiles: the attributes of PyTorch's BlockMask, for a PyTorch without
    one (1.13)."""

    def __init__(self, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
                 BLOCK_SIZE, mask_mod, seq_lengths):
        self.kv_num_blocks = kv_num_blocks
        self.kv_indices = kv_indices
        self.full_kv_num_blocks = full_kv_num_blocks
        self.full_kv_indices = full_kv_indices
        self.BLOCK_SIZE = BLOCK_SIZE
        self.mask_mod = mask_mod
        self.seq_lengths = seq_lengths

    @property
    def shape(self):
        return (*self.kv_num_blocks.shape[:2], *self.seq_lengths)

    def sparsity(self):
        """Percent of tiles skipped, as PyTorch's."""
        tiles = self.kv_num_blocks.shape[0] * self.kv_num_blocks.shape[1] * \
            self.kv_num_blocks.shape[2] * self.kv_indices.shape[3]
        visited = int(self.kv_num_blocks.sum() + self.full_kv_num_blocks.sum())
        return 100.0 * (1.0 - visited / tiles)

    def __repr__(self):
        return (f"attnkit.BlockMask(shape={self.shape}, BLOCK_SIZE={self.BLOCK_SIZE}, "
                f"sparsity={self.sparsity():.2f}%)")


BlockMask = _TorchBlockMask if _TorchBlockMask is not None else _OwnBlockMask


def _ordered(kinds, kind):
    """FlexAttention's lists of one kind from (B, H, nq, nk) int8 kinds: the count per row and
    the row's blocks of that kind first (ascending), then the others."""
    chosen = kinds == kind
    counts = chosen.sum(-1).to(torch.int32)
    # A stable sort puts the chosen blocks first, each group ascending.
    order = torch.sort((~chosen).to(torch.int8), dim=-1, stable=True).indices
    return counts, order.to(torch.int32)


def _kinds_at_once(mask_mod, B, H, seq_lengths, block_sizes, device):
    """The tiles' kinds (B, H, nq, nk) (0 empty, 1 partial, 2 full) from mask_mod on every
    query and key at once: inside torch.compile, where a loop over the query blocks would fix
    their number (the length) in the compiled graph. Dense, B * H * Q_LEN * KV_LEN bools, as
    PyTorch's create_block_mask."""
    (q_len, kv_len), (q_block, kv_block) = seq_lengths, block_sizes
    nq, nk = -(-q_len // q_block), -(-kv_len // kv_block)
    index = dict(dtype=torch.int64, device=device)
    q = torch.arange(nq * q_block, **index).view(1, 1, -1, 1)
    kv = torch.arange(nk * kv_block, **index).view(1, 1, 1, -1)
    b = torch.arange(B, **index).view(-1, 1, 1, 1)
    h = torch.arange(H, **index).view(1, -1, 1, 1)
    allowed = mask_mod(b, h, q.clamp(max=q_len - 1), kv.clamp(max=kv_len - 1))
    if not isinstance(allowed, torch.Tensor) or allowed.dtype != torch.bool:
        raise TypeError("attnkit.create_block_mask: mask_mod must return a bool tensor, got "
                        f"{getattr(allowed, 'dtype', type(allowed).__name__)}")
    # keys and queries past the lengths are outside: their tiles are never full
    allowed = (allowed & (q < q_len) & (kv < kv_len)).expand(B, H, nq * q_block, nk * kv_block)
    tiles = allowed.reshape(B, H, nq, q_block, nk, kv_block)
    return (tiles.any(-1).any(3).to(torch.int8) + tiles.all(-1).all(3).to(torch.int8))


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device="cpu", BLOCK_SIZE=128):
    """attnkit's BlockMask from mask_mod(b, h, q_idx, kv_idx) -> bool, evaluated on broadcast
    index tensors one query block at a time. B or H of 1 (or None) serve any."""
    B, H = B or 1, H or 1
    sizes = (BLOCK_SIZE, BLOCK_SIZE) if not isinstance(BLOCK_SIZE, (tuple, list)) else BLOCK_SIZE
    if len(sizes) != 2 or not all(isinstance(s, int) and not isinstance(s, bool) for s in sizes):
        raise TypeError("attnkit.create_block_mask: BLOCK_SIZE must be an int or a pair of ints "
                        f"(query block, key block), got {BLOCK_SIZE!r}")
    q_block, kv_block = sizes
    # One comparison each: Dynamo of PyTorch 2.6 cannot take min() over symbolic lengths.
    if B < 1 or H < 1 or Q_LEN < 1 or KV_LEN < 1 or q_block < 1 or kv_block < 1:
        raise ValueError("attnkit.create_block_mask: B, H, Q_LEN, KV_LEN and BLOCK_SIZE must be "
                         f">= 1, got {B}, {H}, {Q_LEN}, {KV_LEN}, {BLOCK_SIZE}")
    device = torch.device(device)
    nq, nk = -(-Q_LEN // q_block), -(-KV_LEN // kv_block)
    index = dict(dtype=torch.int64, device=device)
    b = torch.arange(B, **index).view(-1, 1, 1, 1)
    h = torch.arange(H, **index).view(1, -1, 1, 1)
    kv = torch.arange(KV_LEN, **index).view(1, 1, 1, -1)
    if compiling():
        kinds = _kinds_at_once(mask_mod, B, H, (Q_LEN, KV_LEN), (q_block, kv_block), device)
        return block_mask_of_kinds(kinds, (q_block, kv_block), mask_mod, (Q_LEN, KV_LEN))
    kinds = torch.empty(B, H, nq, nk, dtype=torch.int8, device=device)
    for i in range(nq):
        # mask_mod on the block's real queries and keys only: a BLOCK_SIZE far above the
        # lengths costs no more than the lengths (16,384 on 64 tokens took 2.2 GB).
        rows = min(q_block, Q_LEN - i * q_block)
        q = torch.arange(i * q_block, i * q_block + rows, **index).view(1, 1, -1, 1)
        allowed = mask_mod(b, h, q, kv)
        if not isinstance(allowed, torch.Tensor) or allowed.dtype != torch.bool:
            raise TypeError("attnkit.create_block_mask: mask_mod must return a bool tensor, got "
                            f"{getattr(allowed, 'dtype', type(allowed).__name__)}")
        # (B, H, rows, nk * kv_block): keys past KV_LEN are outside, so their tiles are never full
        padded = torch.zeros(B, H, rows, nk * kv_block, dtype=torch.bool, device=device)
        padded[..., :KV_LEN] = allowed.expand(B, H, rows, KV_LEN)
        tiles = padded.view(B, H, rows, nk, kv_block)
        full = tiles.all(-1).all(2) & (rows == q_block)
        kinds[:, :, i] = tiles.any(-1).any(2).to(torch.int8) + full.to(torch.int8)
    block_mask = block_mask_of_kinds(kinds, (q_block, kv_block), mask_mod, (Q_LEN, KV_LEN))
    if not compiling() and device.type != "meta":
        # The partial tiles' bits now, as the operators read them: a mask made outside a
        # traced function (torch.export, torch.compile) then needs no data-dependent
        # `nonzero` inside it. (A meta mask has no bits to find.)
        block_mask._attnkit_partial_tiles = ((Q_LEN, KV_LEN),
                                             _partial_bits(block_mask, Q_LEN, KV_LEN))
    return block_mask


def block_mask_of_kinds(kinds, BLOCK_SIZE, mask_mod, seq_lengths):
    """A BlockMask from (B, H, nq, nk) int8 tile kinds: 0 empty, 1 partial, 2 full."""
    kv_num, kv_idx = _ordered(kinds, 1)
    full_num, full_idx = _ordered(kinds, 2)
    if _TorchBlockMask is None:
        return _OwnBlockMask(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE, mask_mod,
                             seq_lengths)
    # PyTorch's class (its q-block lists, to_dense, to, slicing, and its flex_attention).
    return _TorchBlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx,
                                          BLOCK_SIZE=BLOCK_SIZE, mask_mod=mask_mod,
                                          seq_lengths=tuple(seq_lengths))


def _block_sizes(block_mask):
    size = block_mask.BLOCK_SIZE
    return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))


def _partial_bits(block_mask, q_len, kv_len):
    """The partial tiles' bits, bool (P, q_block, kv_block), in the lists' order."""
    q_block, kv_block = _block_sizes(block_mask)
    num, idx = block_mask.kv_num_blocks, block_mask.kv_indices
    device = num.device
    # The partial tiles as a (B, H, nq, nk) grid, read in row-major order: each row's blocks
    # ascending, the order of the operators' slots whatever order the lists give them in.
    nk = -(-kv_len // kv_block)
    listed = torch.arange(idx.shape[-1], device=device) < num.unsqueeze(-1)
    # Only a row's first kv_num_blocks entries count: the rest is padding (zeros, for
    # PyTorch's BlockMask.from_kv_blocks), sent to a spare last column so that it cannot
    # overwrite a listed block.
    width = max(nk, idx.shape[-1])
    grid = torch.zeros(*num.shape, width + 1, dtype=torch.bool, device=device)
    columns = torch.where(listed, idx.long().clamp(0, width - 1), torch.full_like(idx.long(), width))
    grid.scatter_(-1, columns, listed)
    grid = grid[..., :width]
    return _tile_bits(block_mask.mask_mod, grid.nonzero(as_tuple=True), (q_block, kv_block),
                      (q_len, kv_len))


def _slot_bits(block_mask, q_len, kv_len):
    """The bits of a tile per slot of kv_indices, bool (B, H, nq, nk, q_block, kv_block), the
    unused slots too: a shape that does not depend on the data, for torch.compile (no
    nonzero, no graph break). That is the dense mask, B * H * Q_LEN * KV_LEN bools rounded up
    to the blocks; the operators drop the unused slots."""
    q_block, kv_block = _block_sizes(block_mask)
    num, idx = block_mask.kv_num_blocks, block_mask.kv_indices
    nk = -(-kv_len // kv_block)
    columns = idx[..., :nk].long().clamp(0, nk - 1)  # (B, H, nq, nk)
    device = num.device
    b = torch.arange(num.shape[0], device=device).view(-1, 1, 1, 1).expand_as(columns)
    h = torch.arange(num.shape[1], device=device).view(1, -1, 1, 1).expand_as(columns)
    q = torch.arange(num.shape[2], device=device).view(1, 1, -1, 1).expand_as(columns)
    bits = _tile_bits(block_mask.mask_mod, (b.reshape(-1), h.reshape(-1), q.reshape(-1),
                                            columns.reshape(-1)), (q_block, kv_block),
                      (q_len, kv_len))
    return bits.view(*columns.shape, q_block, kv_block)


def _tile_bits(mask_mod, tiles, block_sizes, seq_lengths):
    """mask_mod on the tiles (b, h, q block, kv block) (index tensors of P tiles): bool (P,
    q_block, kv_block), False outside the problem."""
    (b, h, qb, kvb), (q_block, kv_block), (q_len, kv_len) = tiles, block_sizes, seq_lengths
    device = b.device
    q = qb.view(-1, 1, 1) * q_block + torch.arange(q_block, device=device).view(1, -1, 1)
    kv = kvb.view(-1, 1, 1) * kv_block + torch.arange(kv_block, device=device).view(1, 1, -1)
    inside = (q < q_len) & (kv < kv_len)
    if b.numel() == 0:
        return torch.zeros(0, q_block, kv_block, dtype=torch.bool, device=device)
    allowed = mask_mod(b.view(-1, 1, 1), h.view(-1, 1, 1), q.clamp(max=q_len - 1),
                       kv.clamp(max=kv_len - 1))
    if not isinstance(allowed, torch.Tensor) or allowed.dtype != torch.bool:
        raise TypeError("attnkit.flex_attention: block_mask.mask_mod must return a bool tensor, "
                        f"got {getattr(allowed, 'dtype', type(allowed).__name__)}")
    return (allowed & inside).expand(b.numel(), q_block, kv_block).contiguous()


def partial_tiles(block_mask, query, key):
    """(q_block, kv_block, (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
    partial_tiles)) for the operators, after checking block_mask against query and key."""
    for name in ("kv_num_blocks", "kv_indices", "BLOCK_SIZE", "mask_mod"):
        if not hasattr(block_mask, name):
            raise TypeError("attnkit.flex_attention: block_mask must be a BlockMask (PyTorch's "
                            f"create_block_mask or attnkit's), got {type(block_mask).__name__}")
    q_len, kv_len = query.shape[2], key.shape[2]
    q_block, kv_block = _block_sizes(block_mask)
    num = block_mask.kv_num_blocks
    if num.device != query.device:
        raise ValueError(f"attnkit.flex_attention: block_mask is on {num.device}, query on "
                         f"{query.device}: make the block mask for the attention's device")
    lengths = getattr(block_mask, "seq_lengths", None)
    nq = -(-q_len // q_block)
    if (lengths is not None and tuple(lengths) != (q_len, kv_len)) or num.dim() != 3 or \
            num.shape[2] != nq or block_mask.kv_indices.shape[-1] < -(-kv_len // kv_block):
        raise ValueError(
            f"attnkit.flex_attention: block_mask was made for (B, H, Q_LEN, KV_LEN) = "
            f"({', '.join(str(s) for s in num.shape[:2])}, "
            f"{tuple(lengths) if lengths is not None else '?'}) in blocks of "
            f"{(q_block, kv_block)}, but query has length {q_len} and key {kv_len}")
    if num.shape[0] not in (1, query.shape[0]) or num.shape[1] not in (1, query.shape[1]):
        raise ValueError(f"attnkit.flex_attention: block_mask is for B={num.shape[0]}, "
                         f"H={num.shape[1]}, the query has B={query.shape[0]}, "
                         f"H={query.shape[1]} (1 serves any)")
    # Remembered on the block mask (an attribute, which Dynamo reads where it would not
    # inline a WeakKeyDictionary), for the lengths it was made for.
    cached = getattr(block_mask, "_attnkit_partial_tiles", None)
    if cached is not None and cached[0] == (q_len, kv_len):
        bits = cached[1]
    elif compiling():
        bits = _slot_bits(block_mask, q_len, kv_len)
    else:
        bits = _partial_bits(block_mask, q_len, kv_len)
        try:
            block_mask._attnkit_partial_tiles = ((q_len, kv_len), bits)
        except AttributeError:
            pass
    # Only the columns that name key blocks of this length (PyTorch pads none; be exact).
    nk = -(-kv_len // kv_block)
    idx = block_mask.kv_indices[..., :nk]
    full_num = getattr(block_mask, "full_kv_num_blocks", None)
    full_idx = getattr(block_mask, "full_kv_indices", None)
    if full_idx is not None:
        full_idx = full_idx[..., :nk]
    return q_block, kv_block, (num, idx, full_num, full_idx, bits)
