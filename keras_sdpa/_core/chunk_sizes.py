"""The chunked path's block sizes, as the plan sets them: the path's threshold, the blocks
sized to what one step of the loops holds, a window's, and the sizes evened out over the
lengths (queries and keys apart: `(C_q, C_k)`)."""

import math

# The threshold of the "auto" path (a sequence longer than a block): 2048, or 512 with a
# causal mask or a mask_mod, as before the blocks were sized; 2048 is the largest default block
# and 512 a mask_mod's (and a block mask's) block.
DEFAULT_CHUNK_SIZE = 2048
MASKED_CHUNK_SIZE = 512
# A causal mask's (or a `(T, S)` mask's) default blocks at most: at N=4, causal blocks of 1024
# took 0.79x the time of 2048 (BENCHMARKS.md's "Block sizes"): larger ones skip less.
CAUSAL_CHUNK_SIZE = 1024
# The default blocks hold about this many bytes of float32 scores per step of the loops
# (`B * N * C * C * 4`), a power of two from 256 to 2048. On an Intel Xeon (2 cores), forward
# plus backward at T=S=8,192 against blocks of 2048: N=4 in blocks of 1024 0.83x, of 512 0.91x;
# N=8 in 512 0.79x, in 1024 0.86x; causal alike (BENCHMARKS.md's "Block sizes").
SCORE_BYTES_PER_BLOCK = 16 * 2**20
SMALLEST_BLOCK = 256


def blocked_mask(mask_pattern, query, key):
    """Whether a mask varies along both T and S (as a causal or windowed one given as a
    tensor does) over lengths known to pass one default block: then smaller blocks, of which
    the chunked path skips those the mask empties (`blocks.py`). Shorter or unknown lengths
    keep the default, and so the dense path where it ran before: an unstructured mask at
    T=S=1,024 (B=16, N=8) took 1.66x the dense time forward plus backward in blocks of 512."""
    if mask_pattern is None or not all(mask_pattern[2:]):
        return False
    lengths = [known(query.shape[1]), known(key.shape[1])]
    return max(size or 0 for size in lengths) > DEFAULT_CHUNK_SIZE


def chosen(chunk_size, sliding_window, mask_mod, masked):
    """The chunk size given, or the path's threshold (`default_chunk_size`), and whether the
    default blocks are sized and evened out (`fitted`)."""
    balance = chunk_size is None and sliding_window is None and mask_mod is None
    if chunk_size is None:
        chunk_size = default_chunk_size(sliding_window, masked)
    return chunk_size, balance


def fitted(chunk_size, query, key, balance, compute_bytes=4, masked=False):
    """`(C_q, C_k)`: blocks of queries and of keys, each no longer than its sequence (blocks
    of 2048 padded a T=512 batch of 256 to 24 GiB of scores, the dense path needing 0.5
    GiB; 64 queries against 16,384 keys padded the queries 32-fold). With `balance` (no
    size given, no window, no mask_mod) the default is first sized to the batch and heads
    (`sized`), then evened out over each length (`balanced_chunk_size`)."""
    lengths = (known(query.shape[1]), known(key.shape[1]))
    if None in lengths or not max(lengths):
        return chunk_size, chunk_size
    if balance:
        chunk_size = sized(known(query.shape[0]), query.shape[2], compute_bytes)
        chunk_size = min(chunk_size, CAUSAL_CHUNK_SIZE) if masked else chunk_size
    sizes = [min(chunk_size, max(length, 1)) for length in lengths]
    if balance:
        sizes = [balanced_chunk_size(max(n, 1), c) for n, c in zip(lengths, sizes)]
    return tuple(sizes)


def sized(batch, heads, compute_bytes=4):
    """The largest power of two from `SMALLEST_BLOCK` to `DEFAULT_CHUNK_SIZE` whose scores,
    `B * N * C * C` of `compute_bytes`, fit `SCORE_BYTES_PER_BLOCK` (or `SMALLEST_BLOCK`, past
    it). An unknown batch (Keras's `fit` traces with one) is counted as 8, as the "auto" path
    counts it (`plan.AUTO_CHUNKED_BYTES_PER_EXAMPLE`)."""
    per_row = (batch or 8) * heads * compute_bytes
    size = 1 << max(0, int(math.log2(math.sqrt(SCORE_BYTES_PER_BLOCK / per_row))))
    return min(DEFAULT_CHUNK_SIZE, max(SMALLEST_BLOCK, size))


def balanced_chunk_size(length, chunk_size):
    """The default block size evened out over `length`: as many blocks as `chunk_size` needs,
    each as short as that allows, rounded up to a multiple of 128 (never above `chunk_size`,
    which may be the length itself). A ViT's 4,097 tokens in blocks of 2048 padded a third
    block of 2047 (2.25x the work); in 3 blocks of 1408, forward plus backward took 0.367 s
    against 0.734 s in one run (N=2, H=64, 2 CPU cores)."""
    blocks = -(-length // chunk_size)
    per_block = -(-length // blocks)
    return min(chunk_size, -(-per_block // 128) * 128)


def default_chunk_size(sliding_window, masked=False):
    """The "auto" path's threshold and a given block's default: 2048; with a window `W` the
    power of two nearest above `W / 2` (128 at least); and 512 when `masked` (causal, a
    mask_mod, or a mask along T and S). Without a window or a mask_mod, `fitted` sizes the
    chunked path's blocks anew (`sized`).

    Small blocks let the loops skip more of what lies outside the band: at T=16,384,
    W=512 on 2 CPU cores, forward plus backward took 0.75 s in blocks of 256, 1.12 s
    in 128, 1.2 s in 512 and 4.0-5.8 s in 2048.
    """
    if sliding_window is None:
        return MASKED_CHUNK_SIZE if masked else DEFAULT_CHUNK_SIZE
    size = 1 << max(0, math.ceil(math.log2(sliding_window / 2)))
    return min(DEFAULT_CHUNK_SIZE, max(128, size))


def known(size):
    """A size known while tracing, else None: JAX's shape inference of a functional model
    traces a custom layer's call with a symbolic batch size, which is not an int."""
    return size if isinstance(size, int) else None
