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
frozen, checked `_request.Request` (the layer builds one from its settings, and both enter
through `run_request`); `_plan.make` checks the tensors and decides every static fact of the
call into one frozen `Plan`; then `_attention_xla`, a `tf.function(jit_compile=True)` on
TensorFlow and a `jax.jit` on JAX keyed by the plan (inside a caller's XLA step, traced into
it), runs `_attention`: the grouped layout, then one path, `_dense.py` (the whole `(T, S)`
matrix), `_chunked.py` (the online softmax in blocks) or `_decode.py` (a few rows against a
cache), each taking `(q, k, v, plan, tensors)`. The scores, bias, cap, masks, softmax and
weighted sum run as one XLA program, and so does their gradient.

The rule for a fully masked query row (a query that may attend to nothing):
its weights are all zero and its output is zero, never NaN, on every path.
"""

import typing

from keras import ops as kops

from keras_sdpa import _backend, _chunked, _decode, _dense, _plan, _request, mods
from keras_sdpa import _layout as layout
from keras_sdpa import _mod_calls as mod_calls
from keras_sdpa._block_mask import BlockMask, create_block_mask  # noqa: F401 (the public names)
from keras_sdpa._types import MaskMod, Tensor

__all__ = ["BlockMask", "create_block_mask", "scaled_dot_product_attention"]
# (`run_request`, the layer's entry, and the program's `Tensors` are the package's own.)
BlockMask.__module__ = create_block_mask.__module__ = __name__  # where users find them

# A caller's `tf.function` converts the functions it calls with AutoGraph, and every function
# those call, on its first trace. This module branches only on static values (shapes, dtypes,
# flags), so conversion would change nothing but the time a trace takes: its two entry points
# run as written, as Keras's own train, test and predict steps do (`do_not_convert`;
# benchmarks/tracing.py measures the first call).


@_backend.do_not_convert
def scaled_dot_product_attention(
    query,
    key,
    value,
    mask=None,
    *,
    bias=None,
    is_causal=False,
    sliding_window=None,
    attn_logits_soft_cap=None,
    scale=None,
    dropout_rate=0.0,
    training=False,
    seed=None,
    return_weights=False,
    implementation="auto",
    chunk_size=None,
    score_mod=None,
    mask_mod=None,
    block_mask=None,
):
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
    options = {name: arguments[name] for name in _request.CORE_OPTIONS}
    return run_request(query, key, value, mask, bias, _request.Request(**options))


@_backend.do_not_convert
def run_request(query, key, value, mask=None, bias=None, request=_request.DEFAULT):
    """`scaled_dot_product_attention` with its options in one `_request.Request`, which
    may also hold the layer's two choices besides them: `flash_attention` (`True` chunked,
    `False` dense, `None` leaves it to `implementation`) and `cached` (a call against a
    key/value cache: one query row runs the decode path), decided with the rest of the call
    in `_plan.make`.
    """
    _backend.check()
    query, key, value = (kops.convert_to_tensor(x) for x in (query, key, value))
    plan, call = _plan.make(query, key, value, mask, bias, request)
    empty = _empty_result(query, key, value, plan.return_weights)
    if empty is not None:
        return empty if plan.return_weights else empty[0]
    inputs = (query, key, value, *call)
    if plan.by_size:
        # Lengths unknown while tracing (a Keras model's `Input((None, E))`, TensorFlow
        # only: JAX knows every shape): the actual sizes choose between the two compiled
        # programs, at run time. "auto" never returns weights: they force dense.
        plan = plan.replace(by_size=False)
        out = kops.cond(
            _plan.chunked_by_size(plan, query, key),
            lambda: _attention_xla(*inputs, plan=plan.replace(path="chunked"))[0],
            lambda: _attention_xla(*inputs, plan=plan)[0],
        )
        weights = None
    else:
        out, weights = _attention_xla(*inputs, plan=plan)
    # What the reshapes inside the program hide from the static shape, it states again.
    shim = _backend.get()
    out = shim.with_static_shape(out, (*query.shape[:3], value.shape[-1]))  # (B, T, N, Hv)
    if not plan.return_weights:
        return out
    weights = shim.with_static_shape(
        weights, (query.shape[0], query.shape[2], query.shape[1], key.shape[1])
    )
    return out, weights


def _empty_result(query, key, value, return_weights):
    """Zeros for an empty batch or an empty query or key axis (known statically), else None.

    A serving batch can be empty; a query with no keys attends to nothing (zeros).
    """
    b, t, n, _ = query.shape
    s = key.shape[1]
    if 0 not in (b, t, s):
        return None
    if None in (b, t, n, s) or None in value.shape:
        return None  # the compiled program handles the sizes it sees at run time
    out = kops.zeros((b, t, n, value.shape[-1]), query.dtype)
    return out, kops.zeros((b, n, t, s), query.dtype)


class Tensors(typing.NamedTuple):
    """A call's tensors inside its program, in the paths' grouped layout."""

    mask: Tensor | None = None  # (B|1, K|1, G|1, T|1, S|1) booleans
    bias: Tensor | None = None  # (B|1, K|1, G|1, T|1, S|1) in the compute precision
    seed: Tensor | None = None  # (2,) int32, with dropout
    score_mod: mod_calls.ScoreMod | None = None  # the mod bound to this call's tensors
    params: tuple[Tensor, ...] = ()  # what the score_mod's gradient reaches
    mask_mod: MaskMod | None = None
    block_kinds: Tensor | None = None  # `(nq, nk)` int32, the chunked path's


def _attention(
    query,
    key,
    value,
    mask,
    bias,
    seed,
    score_tensors=(),
    mask_tensors=(),
    block_kinds=None,
    variable_values=(),
    *,
    plan,
):
    """The whole computation, traced once per plan: the grouped layout, then the plan's path.

    `score_tensors` and `mask_tensors` are the mods' tensors of this call (`mods.split`), and
    `variable_values` (JAX) the values of the variables the mods hold.
    """
    tensors = _tensors(
        plan, mask, bias, seed, score_tensors, mask_tensors, block_kinds, variable_values
    )
    if plan.operand:
        # The products take the half-precision operands and accumulate in float32; the
        # scale multiplies their float32 result, so it never rounds to the input's precision.
        q = kops.transpose(query, (0, 2, 1, 3))  # (B, N, T, H)
    else:
        # (Q K^T) * scale == (Q * scale) K^T: scaling the (T, H) queries is cheaper
        # than scaling the (T, S) logits, and is the same number.
        q = kops.transpose(kops.cast(query, plan.compute), (0, 2, 1, 3)) * plan.scale
    shape = kops.shape(q)
    q = kops.reshape(q, (shape[0], plan.num_kv_heads, plan.groups, shape[2], shape[3]))
    if plan.path == "decode":  # the keys and values as they lie: (B, S, K, H)
        out, weights = _decode.attend(q, key, value, plan, tensors)
    else:
        k = kops.transpose(kops.cast(key, plan.operand or plan.compute), (0, 2, 1, 3))
        v = kops.transpose(kops.cast(value, plan.operand or plan.compute), (0, 2, 1, 3))
        path = _dense if plan.path == "dense" else _chunked  # k (B, K, S, H), v (B, K, S, Hv)
        out, weights = path.attend(q, k, v, plan, tensors)
    shape = kops.shape(out)  # (B, K, G, T, Hv)
    out = kops.reshape(out, (shape[0], plan.num_heads, shape[3], shape[4]))  # (B, N, T, Hv)
    out = kops.cast(kops.transpose(out, (0, 2, 1, 3)), plan.dtype)  # (B, T, N, Hv)
    if weights is not None:
        shape = kops.shape(weights)
        weights = kops.reshape(weights, (shape[0], plan.num_heads, shape[3], shape[4]))
        weights = kops.cast(weights, plan.dtype)  # (B, N, T, S)
    return out, weights


def _tensors(plan, mask, bias, seed, score_tensors, mask_tensors, block_kinds, variable_values):
    """The call's tensors as the paths read them: grouped masks and bias, and the mods bound
    to this call's tensors and (JAX) its variables' values."""
    score_template = None if plan.score_mod is None else plan.score_mod.mod
    mask_template = None if plan.mask_mod is None else plan.mask_mod.mod
    scope = ()
    if variable_values:  # JAX: the mods read their variables as this call's values
        scope = tuple(zip(mods.variables_of(score_template, mask_template), variable_values))
    # The score_mod's float tensors get gradients, and so do the variables it reads: on
    # TensorFlow through tf.custom_gradient's own tracking, on JAX as their values (`scope`).
    # (A tensor a plain function captures is a constant to the paths' custom gradients:
    # `mods.with_tensors` passes it as a tensor of its own.)
    score_mod = mod_calls.ScoreMod(score_template, score_tensors, scope)
    mask_mod = mods.as_function(mods.join(mask_template, mask_tensors))
    groups = (plan.num_kv_heads, plan.groups)
    if bias is not None:
        bias = layout.grouped(kops.cast(bias, plan.compute), plan.bias_pattern, *groups)
    return Tensors(
        mask=layout.grouped(mask, plan.mask_pattern, *groups),  # (B|1, K|1, G|1, T|1, S|1)
        bias=bias,
        seed=seed,
        score_mod=score_mod if score_mod.fn is not None else None,
        params=score_mod.params if score_mod.fn is not None else (),
        mask_mod=None if mask_mod is None else mod_calls.reading(mask_mod, scope),
        block_kinds=block_kinds,
    )


# The compiled program, one per plan (and per input shapes and dtypes): a
# `tf.function(jit_compile=True)` without AutoGraph, or a `jax.jit`.
_attention_xla = _backend.compile(_attention, static_argnames=("plan",))
