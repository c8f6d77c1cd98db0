"""The chunked path's blocks: their geometry, masks and kinds, and the ranges its loops visit.

`Blocking` holds one call's block geometry and masks, what every loop body of `chunked.py`
reads; the functions below move tensors into blocks and back, and class and range the blocks that a
mask empties.
"""

from keras import ops

from keras_sdpa import _backend
from keras_sdpa._core import layout, mod_calls, softmax
from keras_sdpa._mods import bands


class Blocking:
    """One call's block geometry and masks: what every block of every loop reads."""

    def __init__(self, q, k, plan, tensors):
        cq, ck = self.sizes = plan.query_chunk_size, plan.chunk_size  # C_q, C_k
        self.plan, self.tensors = plan, tensors
        self.groups, self.num_kv_heads = q.shape[2], q.shape[1]  # G, K
        self.t, self.s = ops.shape(q)[3], ops.shape(k)[2]
        self.num_q, self.num_k = (self.t + cq - 1) // cq, (self.s + ck - 1) // ck
        self.mask_grid = None
        if tensors.mask is not None:
            self.mask_grid = grid_of(
                tensors.mask, plan.mask_pattern, self.num_q, self.num_k, self.sizes
            )
        self.q_offsets, self.k_offsets = (
            ops.arange(cq, dtype="int32"),
            ops.arange(ck, dtype="int32"),
        )
        self.b_index = layout.batch_index(ops.shape(q)[0])
        self.kinds = tensors.block_kinds
        if tensors.mask_mod is not None and self.kinds is None:
            self.kinds = kinds_of_blocks(
                tensors.mask_mod,
                self.b_index,
                plan.num_heads,
                self.num_kv_heads,
                self.t,
                self.s,
                self.sizes,
            )
        if self.mask_grid is not None and all(plan.mask_pattern[2:]):
            self.kinds = empty_where_masked(self.kinds, self.mask_grid, self.num_q, self.num_k)
        self.spans = None if self.kinds is None else nonempty_spans(self.kinds)

    def positions(self, i, j):
        """The block's absolute positions, the padding clamped to the last one."""
        (cq, ck), t, s = self.sizes, self.t, self.s
        return ops.minimum(i * cq + self.q_offsets, t - 1), ops.minimum(
            j * ck + self.k_offsets, s - 1
        )

    def allowed(self, i, j, with_mod=True):
        """The "may attend" block of query block i and key block j, 5-D, broadcastable; None
        where every key may be attended (no mask, and no padding: `S` a known multiple of
        `C_k`), so that the paths add nothing."""
        plan, (cq, ck) = self.plan, self.sizes
        keys = j * ck + self.k_offsets  # (C_k,)
        result = None
        if not isinstance(self.s, int) or self.s % ck:
            result = (keys < self.s)[None, :]  # (1, C_k): padded keys never
        band = bands.band(i * cq + self.q_offsets, keys, plan.is_causal, plan.window)
        result = softmax.combine(result, band)
        result = None if result is None else result[None, None, None]
        if self.mask_grid is not None:
            result = softmax.combine(result, block(self.mask_grid, plan.mask_pattern, i, j))
        if self.tensors.mask_mod is not None and with_mod:
            mod = mod_calls.mod_mask(
                self.tensors.mask_mod,
                self.b_index,
                plan.num_heads,
                self.num_kv_heads,
                *self.positions(i, j),
            )
            result = softmax.combine(result, mod)
        return result

    def penalty(self, i, j, with_mod=True):
        """`allowed` in additive form (`softmax.additive`): 0, or `MASK_PENALTY` on a masked
        key, in the compute dtype."""
        return softmax.additive(self.allowed(i, j, with_mod), self.plan.compute)[0]

    def visit(self, i, j, carried, compute):
        """`compute(with_mod)` on block (i, j), or `carried` where the mask_mod empties it."""
        if self.kinds is None:
            return compute(True)
        kind = self.kinds[i, j]
        return ops.cond(
            ops.equal(kind, EMPTY),
            lambda: carried,
            lambda: ops.cond(ops.equal(kind, FULL), lambda: compute(False), lambda: compute(True)),
        )

    def keep(self, i, j, shape):
        """Block (i, j) of the dropout keep-mask, the same in the forward and the gradient;
        None without dropout."""
        if self.plan.dropout_rate <= 0.0:
            return None
        shim = _backend.get()
        block_seed = shim.fold_in(self.tensors.seed, i * self.num_k + j)
        return shim.uniform(shape, block_seed, "float32") >= self.plan.dropout_rate

    def key_range(self, i):
        """The key blocks `[lo, hi)` query block `i` visits."""
        plan = self.plan
        lo, hi = key_block_range(
            i, self.num_k, self.sizes, plan.is_causal, plan.window, (self.t, self.s)
        )
        if self.spans is not None:  # and within the row's first and last non-empty block
            lo, hi = ops.maximum(lo, self.spans[0][i]), ops.minimum(hi, self.spans[1][i])
        return lo, hi

    def query_range(self, j):
        """The query blocks `[lo, hi)` that visit key block `j`."""
        plan = self.plan
        lo, hi = query_block_range(
            j, self.num_q, self.sizes, plan.is_causal, plan.window, (self.t, self.s)
        )
        if self.spans is not None:
            lo, hi = ops.maximum(lo, self.spans[2][j]), ops.minimum(hi, self.spans[3][j])
        return lo, hi

    def matmul(self, a, b, transpose_b=False, transpose_a=False):
        return layout.matmul(a, b, self.plan.operand, transpose_b, transpose_a)

    def raw_logits(self, blocks, j, q_i):
        """`q_i k_j^T`, scaled where the plan scales the products: `(B, K, G, C, C)`."""
        raw = self.matmul(layout.to_rows(q_i), take(blocks.k, j), transpose_b=True)
        return layout.scaled(layout.from_rows(raw, self.groups), self.plan.logit_scale)

    def logits(self, blocks, i, j, q_i, raw=None):
        """Block (i, j)'s logits: the score_mod, the bias and the cap on the raw products."""
        plan = self.plan
        bias_ij = None if blocks.bias is None else block(blocks.bias, plan.bias_pattern, i, j)
        raw = self.raw_logits(blocks, j, q_i) if raw is None else raw
        if self.tensors.score_mod is not None:
            raw = mod_calls.apply_score_mod(
                self.tensors.score_mod, raw, self.b_index, plan.num_heads, *self.positions(i, j)
            )
        return softmax.logits(raw, bias_ij, plan.cap)  # (B, K, G, C, C)


# A block's kind under a mask_mod: no allowed key, some, or every key allowed.
EMPTY, PARTIAL, FULL = 0, 1, 2


def kinds_of_blocks(mask_mod, b_index, num_heads, num_kv_heads, t, s, sizes):
    """`(ceil(T / C_q), ceil(S / C_k))` int32 for block `sizes` `(C_q, C_k)`: each block's
    kind (`EMPTY`, `PARTIAL`, `FULL`).

    A block is `EMPTY` when `mask_mod` allows no key of it for any example, head and (real)
    query, `FULL` when it allows every key for all of them and no key is padding, and
    `PARTIAL` otherwise. Computed one `(B|1, N|1, C_q, C_k)` block at a time, inside the
    compiled program, for the actual lengths: nothing of size `T x S` is formed.
    """
    shim, (cq, ck) = _backend.get(), sizes
    num_q, num_k = (t + cq - 1) // cq, (s + ck - 1) // ck

    def kind(n, kinds):
        i, j = n // num_k, n % num_k
        queries = i * cq + ops.arange(cq, dtype="int32")
        keys = j * ck + ops.arange(ck, dtype="int32")
        real_q, real_k = (queries < t)[:, None], (keys < s)[None, :]  # (C_q, 1), (1, C_k)
        allowed = mod_calls.mod_mask(
            mask_mod,
            b_index,
            num_heads,
            num_kv_heads,
            ops.minimum(queries, t - 1),
            ops.minimum(keys, s - 1),
        )
        some = ops.any(ops.logical_and(allowed, ops.logical_and(real_q, real_k)))
        every = ops.logical_and(
            ops.all(ops.logical_or(allowed, ops.logical_not(real_q))),
            ops.all(real_k),
        )
        value = ops.where(every, FULL, ops.where(some, PARTIAL, EMPTY))
        return n + 1, shim.write_block(kinds, n, ops.cast(value, "int32"))

    _, kinds = ops.while_loop(
        lambda n, _: n < num_q * num_k,
        kind,
        (ops.convert_to_tensor(0, "int32"), shim.block_array(num_q * num_k, (), "int32")),
    )
    return ops.reshape(shim.stack_blocks(kinds), (num_q, num_k))


def empty_where_masked(kinds, mask_grid, num_q, num_k):
    """`kinds` (or `PARTIAL` everywhere, when None) with `EMPTY` where a `(T, S)` mask allows
    no key of the block for any example and head.

    A causal or windowed mask given as a tensor (keras-hub's decoders build theirs as
    `(B, T, S)`) then skips the blocks that `is_causal` or `sliding_window` would: the mask
    is read once, a reduction per block, and no block product is computed where it is empty.
    The mask itself still applies inside every block visited.
    """
    some = ops.any(mask_grid, axis=tuple(range(2, len(mask_grid.shape))))  # (nq, nk)
    some = ops.broadcast_to(some, (num_q, num_k))
    if kinds is None:
        return ops.cast(ops.where(some, PARTIAL, EMPTY), "int32")
    return ops.cast(ops.where(some, kinds, EMPTY), "int32")


def nonempty_spans(kinds):
    """From `(nq, nk)` block kinds: each row's first and one-past-last non-empty key block,
    and each column's first and one-past-last non-empty query block. The loops run over
    these spans and skip the empty blocks inside them (a causal map halves the visits)."""
    nonempty = kinds > 0
    num_q, num_k = ops.shape(kinds)
    keys = ops.arange(num_k, dtype="int32")[None, :]
    queries = ops.arange(num_q, dtype="int32")[:, None]
    row_lo = ops.min(ops.where(nonempty, keys, num_k), axis=1)
    row_hi = ops.max(ops.where(nonempty, keys + 1, 0), axis=1)
    col_lo = ops.min(ops.where(nonempty, queries, num_q), axis=0)
    col_hi = ops.max(ops.where(nonempty, queries + 1, 0), axis=0)
    return row_lo, row_hi, col_lo, col_hi


def key_block_range(i, num_k, sizes, is_causal, window, lengths):
    """Key blocks `[lo, hi)` (of `C_k` keys, `sizes = (C_q, C_k)`, `lengths = (T, S)`) that
    some real query of query block `i` may see.

    The block's queries are `first = i C_q` to `last = min(i C_q + C_q, T) - 1`. Causal:
    keys `s <= last`. Window: keys in `[first - W + 1, last + W - 1]`.
    """
    (cq, _), (t, _) = sizes, lengths
    first, last = i * cq, ops.minimum(i * cq + cq, t) - 1
    return _blocks_between(0, lengths[1] - 1, first, last, sizes[1], is_causal, window, True)


def query_block_range(j, num_q, sizes, is_causal, window, lengths):
    """Query blocks `[lo, hi)` of which some real query may see key block `j`."""
    (_, ck), (_, s) = sizes, lengths
    first, last = j * ck, ops.minimum(j * ck + ck, s) - 1
    return _blocks_between(0, lengths[0] - 1, first, last, sizes[0], is_causal, window, False)


def _blocks_between(lo, hi, first, last, size, is_causal, window, keys):
    """The blocks of `size` that hold the positions in `[lo, hi]` which meet one of
    `[first, last]` on the other axis (`keys`: the positions are keys, the others queries):
    causal (a key at most its query) and within the window. Empty as `(lo, lo)`."""
    if is_causal:
        lo, hi = (lo, ops.minimum(hi, last)) if keys else (ops.maximum(lo, first), hi)
    if window is not None:
        lo, hi = ops.maximum(lo, first - window + 1), ops.minimum(hi, last + window - 1)
    lo_block = ops.convert_to_tensor(lo // size, "int32")
    hi_block = ops.convert_to_tensor(hi // size + 1, "int32")
    return lo_block, ops.where(hi < lo, lo_block, hi_block)


def to_blocks(x, num, chunk_size, axis):
    """Zero-pads `axis` of `x` to `num * chunk_size` and moves its blocks to a new axis 0.

    `(B, K, G, T, D)` with `axis=3` becomes `(num, B, K, G, C, D)`.
    """
    shape = ops.shape(x)
    pad = [[0, 0]] * len(shape)
    pad[axis] = [0, num * chunk_size - shape[axis]]
    x = ops.pad(x, pad)
    x = ops.reshape(x, (*shape[:axis], num, chunk_size, *shape[axis + 1 :]))
    order = [axis] + [a for a in range(len(shape) + 1) if a != axis]
    return ops.transpose(x, order)


def from_blocks(blocks, length):
    """`(num, B, K, G, C, D)` back to `(B, K, G, length, D)`, dropping the padding."""
    x = ops.transpose(blocks, (1, 2, 3, 0, 4, 5))  # (B, K, G, num, C, D)
    shape = ops.shape(x)
    x = ops.reshape(x, (shape[0], shape[1], shape[2], shape[3] * shape[4], shape[5]))
    return x[:, :, :, :length]


def grid_of(x, pattern, num_q, num_k, sizes):
    """A 5-D mask or bias `(…, T|1, S|1)` as blocks `(nq|1, nk|1, …, C_q|1, C_k|1)` of
    `sizes = (C_q, C_k)`.

    Padding is False for a mask and 0 for a bias; padded keys are masked anyway.
    """
    if pattern[3]:  # full along S: blocks of keys
        x = to_blocks(x, num_k, sizes[1], axis=4)  # (nk, …, T|1, C_k)
    else:
        x = x[None]  # (1, …, T|1, 1)
    if pattern[2]:  # full along T: blocks of queries
        x = to_blocks(x, num_q, sizes[0], axis=4)  # (nq, nk|1, …, C_q, C_k|1)
    else:
        x = x[None]
    return x  # (nq|1, nk|1, B|1, K|1, G|1, C_q|1, C_k|1)


def take(blocks, i):
    """Block `i` of `blocks`, `(num, …)`."""
    return _backend.get().read_block(blocks, i)


def block(grid, pattern, i, j):
    """Block (i, j) of a grid from `grid_of`, `(B|1, K|1, G|1, C|1, C|1)`."""
    row = take(grid, i if pattern[2] else 0)
    return take(row, j if pattern[3] else 0)


def add_block(d_grid, pattern, i, j, d_scores):
    """Adds the `(B, K, G, C, C)` logit gradient of block (i, j) into the bias grid."""
    d_scores = layout.sum_over_broadcast(d_scores, pattern)
    i, j = (i if pattern[2] else 0), (j if pattern[3] else 0)
    return _backend.get().add_to_block(d_grid, i, j, d_scores)
