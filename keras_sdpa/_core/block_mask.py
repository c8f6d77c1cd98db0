"""FlexAttention's block masks: a `mask_mod`'s block kinds for the chunked path, made once and
shared by the calls (and layers) that pass them as `block_mask=`."""

from keras_sdpa import _backend
from keras_sdpa._core import blocks as _blocks
from keras_sdpa._core import chunk_sizes, layout, mod_calls
from keras_sdpa._mods import base as mod_base
from keras_sdpa._shared import checks
from keras_sdpa._shared.types import MaskMod, Tensor


class BlockMask:
    """The chunked path's block kinds for one `mask_mod` and one set of sizes.

    Made by `create_block_mask`; pass it as `block_mask=` with the same `mask_mod` so that
    several layers share one computation. `kinds` is `(ceil(T / C), ceil(S / C))` int32:
    0 for a block the mod empties, 1 for a partial block, 2 for a full one.
    """

    def __init__(
        self,
        kinds: Tensor,
        mask_mod: MaskMod,
        block_size: int | tuple[int, int],
        sizes: dict[str, int] | None = None,
    ):
        self.kinds = kinds
        self.mask_mod = mask_mod
        self.block_size = block_size
        self.sizes = sizes  # {"B": …, "N": …, "T": …, "S": …}: the sizes it was made for

    def __repr__(self):
        return (
            f"BlockMask(kinds shape={tuple(self.kinds.shape)}, block_size={self.block_size}, "
            f"sizes={self.sizes}, mask_mod={self.mask_mod!r})"
        )


@_backend.do_not_convert
def create_block_mask(
    mask_mod: MaskMod,
    B: int,
    N: int,
    T: int,
    S: int,
    block_size: int | None = None,
    num_kv_heads: int | None = None,
) -> BlockMask:
    """Precomputes the block kinds of `mask_mod` for the chunked path.

    FlexAttention's `create_block_mask`, computed by XLA: `mask_mod` is evaluated one
    `(B, N, C, C)` block at a time and each block is classed as empty, partial or full
    (for every example and head). Passing the result as `block_mask=` skips that work in
    each call that shares it; it is never needed for correctness.

    Args:
        mask_mod: the mask mod, `(b, h, q_idx, kv_idx) -> bool`.
        B: the batch size; 1 for a mask_mod that does not read `b`, which then holds
            for any batch (as FlexAttention's `B=None`).
        N: the number of query heads; 1 for a mask_mod that does not read `h`.
        T: the query length.
        S: the key length. A call with a `BlockMask` of other sizes (`B` and `N` but
            for 1, `T`, `S`, known while tracing) is refused.
        block_size: the chunked path's block size. Defaults to the one it would use.
        num_kv_heads: key/value heads `K` (defaults to `N`); only the grouping matters.

    Returns:
        A `BlockMask`.
    """
    checks.check_mod("mask_mod", mask_mod)
    if mask_mod is None:
        raise ValueError("`create_block_mask` needs a mask_mod. Received: mask_mod=None")
    if block_size is None:
        block_size = chunk_sizes.MASKED_CHUNK_SIZE
    for name, value in (("B", B), ("N", N), ("T", T), ("S", S), ("block_size", block_size)):
        checks.positive_int(name, value)
    num_kv_heads = N if num_kv_heads is None else num_kv_heads
    template, tensors = mod_base.split(mask_mod)
    # On JAX the values of the variables the mod holds enter the program as inputs.
    variable_values = _backend.get().variable_inputs(mod_base.variables_of(template))
    kinds = _block_kinds_xla(
        tensors,
        variable_values,
        template=template,
        B=B,
        N=N,
        K=num_kv_heads,
        T=T,
        S=S,
        C=block_size,
    )
    return BlockMask(kinds, mask_mod, block_size, dict(B=B, N=N, T=T, S=S))


def _block_kinds(tensors, variable_values=(), *, template, B, N, K, T, S, C):
    mask_mod = mod_base.as_function(mod_base.join(template, tensors))
    # JAX: the variables the mod holds, as this call's values (and a warning for others).
    mask_mod = mod_calls.reading(
        mask_mod, tuple(zip(mod_base.variables_of(template), variable_values))
    )
    b_index = layout.batch_index(B)
    # T and S as ints: JAX sizes the array of block kinds while tracing.
    return _blocks.kinds_of_blocks(mask_mod, b_index, N, K, T, S, (C, C))


_block_kinds_xla = _backend.compile(
    _block_kinds, static_argnames=("template", "B", "N", "K", "T", "S", "C")
)


def check(block_mask, mask_mod, chunk_size, query, key):
    """A call's `block_mask`, checked against its `mask_mod`, `chunk_size` and sizes: its
    kinds and block size."""
    if not isinstance(block_mask, BlockMask):
        raise ValueError(
            "`block_mask` must be a BlockMask from keras_sdpa.create_block_mask. "
            f"Received: block_mask={block_mask!r}"
        )
    if mask_mod is None or block_mask.mask_mod is not mask_mod:
        raise ValueError(
            "`block_mask` must come from create_block_mask with the same `mask_mod` as this "
            f"call. Received: mask_mod={mask_mod!r}, block_mask.mask_mod={block_mask.mask_mod!r}"
        )
    if chunk_size is not None and chunk_size != block_mask.block_size:
        raise ValueError(
            "`chunk_size` must equal the block mask's block size. Received: "
            f"chunk_size={chunk_size}, block_mask.block_size={block_mask.block_size}"
        )
    # The kinds hold for the sizes they were made for: with others, the loops would skip
    # blocks by a map of another batch, head count or length.
    call = dict(B=query.shape[0], N=query.shape[2], T=query.shape[1], S=key.shape[1])
    built = block_mask.sizes or {}
    for name, size in call.items():
        if name in ("B", "N") and built.get(name) == 1:
            continue  # made for one example (or head): held for all, as FlexAttention's B=None
        if size is not None and name in built and built[name] != size:
            raise ValueError(
                f"`block_mask` was made for {name}={built[name]} and this call has "
                f"{name}={size}: make it with create_block_mask(mask_mod, B, N, T, S) of "
                f"this call's sizes. Received: block_mask.sizes={built}, "
                f"the call's sizes {call}"
            )
    return block_mask.kinds, block_mask.block_size
