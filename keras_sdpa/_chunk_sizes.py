"""The chunked path's block size, as the plan sets it: the defaults, smaller blocks where a
mask leaves blocks to skip, and the size evened out over the lengths."""

import math

# Blocks of 2048: at T=4096 on 2 CPU cores, 1.08x the dense time (1024 blocks: 1.34x).
DEFAULT_CHUNK_SIZE = 2048
# Causal, or with a mask_mod: smaller blocks, so that more of them are skipped. At T=8192
# on 2 CPU cores, causal forward plus backward took 0.51x the unmasked time in blocks of 512,
# 0.60x in 1024 and 0.63x in 2048 (unmasked: 1024 and 2048 within noise of each other).
MASKED_CHUNK_SIZE = 512


def blocked_mask(mask_pattern, query, key):
    """Whether a mask varies along both T and S (as a causal or windowed one given as a
    tensor does) over lengths known to pass one default block: then smaller blocks, of which
    the chunked path skips those the mask empties (`_blocks`). Shorter or unknown lengths
    keep the default, and so the dense path where it ran before: an unstructured mask at
    T=S=1,024 (B=16, N=8) took 1.66x the dense time forward plus backward in blocks of 512."""
    if mask_pattern is None or not all(mask_pattern[2:]):
        return False
    lengths = [known(query.shape[1]), known(key.shape[1])]
    return max(size or 0 for size in lengths) > DEFAULT_CHUNK_SIZE


def chosen(chunk_size, sliding_window, mask_mod, masked):
    """The chunk size given or its default (smaller blocks when `masked`, so that more are
    skipped), and whether a default may be evened out over the lengths
    (`balanced_chunk_size`)."""
    balance = chunk_size is None and sliding_window is None and mask_mod is None
    if chunk_size is None:
        chunk_size = default_chunk_size(sliding_window, masked)
    return chunk_size, balance


def fitted(chunk_size, query, key, balance):
    """One block of the sequence, not of `chunk_size`: blocks of 2048 padded a T=512 batch
    of 256 to 24 GiB of scores (the dense path needs 0.5 GiB)."""
    lengths = (known(query.shape[1]), known(key.shape[1]))
    if None in lengths or not max(lengths):
        return chunk_size
    chunk_size = min(chunk_size, max(lengths))
    return balanced_chunk_size(max(lengths), chunk_size) if balance else chunk_size


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
    """2048; with a window `W` the power of two nearest above `W / 2` (128 at least); and
    512 when `masked` (causal, a mask_mod, or a mask along T and S), which can leave about
    half the blocks empty.

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
