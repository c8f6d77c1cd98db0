"""Scaled dot-product attention: the stateless, XLA-compiled core.

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V

Shapes, used everywhere in this package:

    B  batch              T  query length        S  key/value length
    N  query heads        K  key/value heads     G  = N // K query heads per key head
    H  query/key head size                       Hv value head size
    E  model width

Queries are `(B, T, N, H)`, keys `(B, S, K, H)` and values `(B, S, K, Hv)`, the
layout of `keras.ops.dot_product_attention`. Attention weights are `(B, N, T, S)`.

Decide, then compute. `scaled_dot_product_attention` gathers its keyword arguments into one
frozen, checked `Request` (`keras_sdpa/_core/request.py`; the layer builds one from its
settings) and hands it to the core's compiled program (`keras_sdpa/_core/program.py`), which
decides every static fact of the call into one frozen `Plan` and runs one XLA program per
plan: one path of the three, dense, chunked or decode, forward and gradient. With
`context_parallel`, the ring (`keras_sdpa/_core/ring.py`) runs instead, over a device mesh.

The rule for a fully masked query row (a query that may attend to nothing):
its weights are all zero and its output is zero, never NaN, on every path.
"""

from keras_sdpa import _backend
from keras_sdpa._core import program
from keras_sdpa._core import request as requests
from keras_sdpa._core.block_mask import BlockMask, create_block_mask  # noqa: F401 (the public names)
from keras_sdpa._shared.types import MaskMod, ScoreMod, Tensor

__all__ = ["BlockMask", "create_block_mask", "scaled_dot_product_attention"]
BlockMask.__module__ = create_block_mask.__module__ = __name__  # where users find them

# A caller's `tf.function` converts the functions it calls with AutoGraph, and every function
# those call, on its first trace. This module branches only on static values (shapes, dtypes,
# flags), so conversion would change nothing but the time a trace takes: its entry points
# run as written, as Keras's own train, test and predict steps do (`do_not_convert`;
# benchmarks/tracing.py measures the first call).


@_backend.do_not_convert
def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Tensor | None = None,
    *,
    bias: Tensor | None = None,
    is_causal: bool = False,
    sliding_window: int | None = None,
    attn_logits_soft_cap: float | None = None,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    training: bool = False,
    seed: Tensor | int | None = None,
    return_weights: bool = False,
    implementation: str = "auto",
    chunk_size: int | None = None,
    score_mod: ScoreMod | None = None,
    mask_mod: MaskMod | None = None,
    block_mask: BlockMask | None = None,
    context_parallel: str | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Scaled dot-product attention, compiled by XLA.

    Computes `softmax(Q K^T * scale) V` (Vaswani et al., 2017, "Attention Is
    All You Need", eq. 1). Each query row goes through, in this order:

    1. the logits `s = scale * Q K^T` (`scale` defaults to `1 / sqrt(H)`), then
       `s = score_mod(s, b, h, q_idx, kv_idx)`, then `s = s + bias`;
    2. the soft cap `s = cap * tanh(s / cap)` (Gemma 2), if `attn_logits_soft_cap`;
    3. the masks: the boolean `mask`, `is_causal`, `sliding_window` and `mask_mod`;
    4. a numerically stable softmax over the keys (row maximum subtracted);
    5. the weighted sum of the values.

    Keys and values may have fewer heads than queries (grouped-query attention,
    Ainslie et al., 2023; one key head is multi-query attention): query head `n`
    reads key head `n // (N // K)`, as `keras.layers.GroupQueryAttention` does,
    and the keys are never repeated in memory.

    Precision: `bfloat16` and `float16` products accumulate in float32, and the
    softmax around them runs in float32 (docs/core.md); `float64` runs in float64.
    The results are cast back to the dtype of `query`.

    A query row whose keys are all masked gets zero weights and a zero output.
    Every argument works on both paths, forward and gradient, and the gradient
    reaches `bias` (summed over the axes it broadcasts on), so a learned
    relative-position bias trains.

    Args:
        query: `(B, T, N, H)` floating tensor.
        key: `(B, S, K, H)` floating tensor. `K` divides `N`.
        value: `(B, S, K, Hv)` floating tensor. `Hv` may differ from `H`.
        mask: optional boolean tensor broadcastable to `(B, N, T, S)`. `True`
            means "may attend". Non-boolean masks are read as `mask != 0`.
        bias: optional floating tensor broadcastable to `(B, N, T, S)`, added
            to the scaled logits (ALiBi, T5 relative positions, or an additive
            float mask as torch takes it).
        is_causal: if `True`, query `t` attends only to keys `s <= t`
            (aligned at the top left when `T != S`, as in Keras). Combined
            with `mask` by logical and.
        sliding_window: optional positive int `W`: query `t` attends only to
            keys with `|t - s| < W`, as `keras.layers.MultiHeadAttention`
            has it; with `is_causal`, the causal band `t - W < s <= t`.
        attn_logits_soft_cap: optional positive float `cap`.
        scale: multiplies `Q K^T`. Defaults to `1 / sqrt(H)`.
        dropout_rate: fraction of attention weights to drop, in `[0, 1)`.
            Applied only when `training` is true.
        training: whether dropout is active.
        seed: seed for dropout: an int, a `(2,)` integer tensor (as returned
            by `keras.random.SeedGenerator.next()`), or `None` for a random one.
            The same seed gives the same keep-mask on the same path.
        return_weights: if `True`, also return the attention weights (before
            dropout, as `keras.layers.MultiHeadAttention` returns them).
        implementation: `"dense"` forms the `(B, N, T, S)` logits; `"chunked"`
            works in blocks of queries and keys with an online softmax
            and a recomputing gradient, in `O(T + S)` memory (Rabe & Staats,
            2021; Dao et al., 2022), and skips the blocks that a causal mask or
            a window rules out; `"decode"` reads a long key/value cache in its
            `(B, S, K, H)` layout for a few query rows (inference; refused with a
            causal mask and `T != S`). `"auto"` (default) picks chunked when the
            float32 logits would exceed 256 MiB and a sequence is longer than a
            block; `return_weights` always runs dense. docs/core.md says how
            "auto" decides inside a caller's compiled step and for unknown lengths.
        chunk_size: block size of the chunked path, for queries and keys. By
            default sized to the batch and heads (the largest `C` from 256 to
            2048 whose `B N C^2` float32 scores fit 16 MiB, 256 past it; 1024
            at most with `is_causal`) and evened out over each length; 512
            with a `mask_mod`, and with a `sliding_window` of `W` the power of
            two at or above `W / 2` (at least 128).
        score_mod: optional `score_mod(score, b, h, q_idx, kv_idx) -> score`, in
            PyTorch FlexAttention's argument order: changes each scaled logit, before
            the bias. See `keras_sdpa.mods` for the layout of its arguments and the
            built-ins (ALiBi, T5 buckets, soft cap). Its gradient reaches the scores and
            what the mod reads: the variables it reads, and the float tensors given by
            `keras_sdpa.mods.with_tensors` or held by a `keras_sdpa.mods.Mod`. A tensor a
            plain function captures is a constant to the gradient.
        mask_mod: optional `mask_mod(b, h, q_idx, kv_idx) -> bool`, True meaning "may
            attend", combined with the other masks by logical and. On the chunked
            path, blocks it empties are never computed and on blocks it fills it is
            not called. `mods.causal()` and `mods.sliding_window(w)` (alone or in
            `mods.and_masks`) run as `is_causal` and `sliding_window`, the same masks.
        block_mask: optional `keras_sdpa.BlockMask` from `create_block_mask`, the
            chunked path's block kinds for this `mask_mod` and these sizes,
            precomputed so that layers can share them. Optional: without it the
            kinds are computed in the program.
        context_parallel: optional name of an axis of the active
            `keras.distribution`'s `DeviceMesh` (JAX backend): the sequence is
            sharded over that axis and attention runs as a ring, each device
            keeping its queries while the key/value shards pass round it
            (docs/context-parallel.md). Takes `is_causal` (balanced over the
            devices), `sliding_window`, GQA, a key padding `mask` `(B, 1, 1, S)`
            and `mods.document(segment_ids)`; T and S must be multiples of the
            axis's size (twice it when causal).

    Returns:
        The output, `(B, T, N, Hv)`, and if `return_weights`, the weights,
        `(B, N, T, S)`, both in the dtype of `query`.

    Example:

    >>> q = keras.random.normal((2, 3, 4, 8))   # (B, T, N, H)
    >>> kv = keras.random.normal((2, 5, 2, 8))  # (B, S, K, H): 2 key heads for 4 query heads
    >>> out, weights = scaled_dot_product_attention(q, kv, kv, return_weights=True)
    >>> tuple(out.shape), tuple(weights.shape)
    ((2, 3, 4, 8), (2, 4, 3, 5))
    """
    arguments = locals()  # by name: each option is written once, in the signature above
    options = {name: arguments[name] for name in requests.CORE_OPTIONS}
    return program.run_request(query, key, value, mask, bias, requests.Request(**options))
