"""Scaled dot-product attention: the stateless, XLA-compiled core.

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V

Shapes, used everywhere in this package:

    B  batch              T  query length        S  key/value length
    N  query heads        K  key/value heads     G  = N // K query heads per key head
    H  query/key head size                       Hv value head size
    E  model width

Queries are `(B, T, N, H)`, keys `(B, S, K, H)` and values `(B, S, K, Hv)`, the
layout of `keras.ops.dot_product_attention`. Attention weights are `(B, N, T, S)`.

The public entry point, `scaled_dot_product_attention`, checks its arguments in
Python and then calls `_attention_xla`, a `tf.function(jit_compile=True)` on
TensorFlow and a `jax.jit` on JAX (`keras_sdpa/_backend/`): the
scores, the bias, the cap, the masks, the softmax and the weighted sum of values
all run as one XLA program, and so does their gradient. The two algorithms live
next door: `_dense.py` (the whole `(T, S)` matrix) and `_chunked.py` (the online
softmax in blocks), sharing the mask and logit logic of `_masking.py`.

The rule for a fully masked query row (a query that may attend to nothing):
its weights are all zero and its output is zero, never NaN, on every path.
"""

import math
import numbers

import keras
from keras import ops as kops

from keras_sdpa import _backend, _chunked, _decode, _dense, mods
from keras_sdpa import _masking as M
from keras_sdpa._checks import (  # noqa: F401 (check_* and _check_mod: the layer's too)
    _as_seed,
    _check_bias,
    _check_inputs,
    _check_mask,
    _check_mod,
    _check_scale,
    check_sliding_window,
    check_soft_cap,
)

# implementation="auto" goes chunked above this many bytes of float32 scores (B * N * T * S * 4).
_AUTO_CHUNKED_BYTES = 1 << 28
# Inside a caller's XLA step with an unknown batch size, "auto" goes chunked above this many
# bytes of one example's float32 scores (N * T * S * 4): 256 MiB at a batch of 8.
_AUTO_CHUNKED_BYTES_PER_EXAMPLE = _AUTO_CHUNKED_BYTES // 8
# Blocks of 2048: at T=4096 on 2 CPU cores, 1.08x the dense time (1024 blocks: 1.34x).
_DEFAULT_CHUNK_SIZE = 2048
# Causal, or with a mask_mod: smaller blocks, so that more of them are skipped. At T=8192
# on 2 CPU cores, causal forward plus backward took 0.51x the unmasked time in blocks of 512,
# 0.60x in 1024 and 0.63x in 2048 (unmasked: 1024 and 2048 within noise of each other).
_MASKED_CHUNK_SIZE = 512

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

    Precision: for `bfloat16` and `float16` inputs the products (`Q K^T`, `P V`
    and the gradient's four) multiply in that precision and accumulate in
    float32, as FlashAttention and cuDNN do; the scale, bias, soft cap, masks
    and the softmax run in float32, so mixed precision cannot overflow them, and
    `P` is rounded to the input's precision only as the operand of `P V`.
    `float32` inputs run in float32 and `float64` inputs in float64 throughout.
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
            works in `(chunk_size, chunk_size)` blocks with an online softmax
            and a recomputing gradient, in `O(T + S)` memory (Rabe & Staats,
            2021; Dao et al., 2022), and skips the blocks that a causal mask or
            a window rules out. `"auto"` (default) picks chunked when the
            float32 logits would exceed 256 MiB, decided in the compiled
            program from the actual sizes, so it holds for unknown lengths
            too. Inside a caller's `jit_compile=True` step whose batch size is
            unknown (Keras's `fit`), it decides while tracing, from one
            example's scores: chunked past 32 MiB (256 MiB at a batch of 8);
            there, unknown lengths stay dense, since XLA cannot compile the
            chunked path's block loops without them. With a `score_mod` it decides
            while tracing in the same way everywhere. `return_weights` needs
            the whole matrix and always runs dense. `"decode"` is for a few
            query rows against a long key/value cache (the layer uses it for
            a cached call with `T == 1`): two multiply-and-reduce passes that
            read the keys and values in their `(B, S, K, H)` layout, with no
            transposed copy. Its gradient is the backend's autodiff, several times
            slower than the dense path's in training, so "auto" never picks
            it; with dropout it runs dense. With a causal mask (`is_causal` or
            `mods.causal()`) and `T != S` it is refused: the mask's top-left
            alignment would give a new token the first keys only (lengths unknown
            while tracing are not checked).
        chunk_size: block size of the chunked path. Defaults to 2048, or with a
            `sliding_window` of `W` to the power of two at or above `W / 2`
            (at least 128), so that the skipped blocks are most of them, or to 512
            with `is_causal` or a `mask_mod`. Without a window or a `mask_mod`, a
            default size is evened out over lengths known while tracing (4,097 tokens:
            3 blocks of 1408, not 2 of 2048 and one of padding).
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
    _backend.check()
    query = kops.convert_to_tensor(query)
    key = kops.convert_to_tensor(key)
    value = kops.convert_to_tensor(value)
    _check_inputs(query, key, value)
    mask_pattern = bias_pattern = None
    if mask is not None:
        mask, mask_pattern = _check_mask(kops.convert_to_tensor(mask), query, key)
    if bias is not None:
        bias, bias_pattern = _check_bias(bias, query, key)
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"`dropout_rate` must be in [0, 1). Received: dropout_rate={dropout_rate}")
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    _check_scale(scale)
    check_sliding_window(sliding_window)
    check_soft_cap(attn_logits_soft_cap)
    _check_mod("score_mod", score_mod)
    _check_mod("mask_mod", mask_mod)
    mods.check_heads(score_mod, query.shape[2])
    block_kinds = None
    if block_mask is not None:
        block_kinds, chunk_size = _check_block_mask(block_mask, mask_mod, chunk_size, query, key)
    given_causal, given_mask_mod = bool(is_causal), mask_mod  # for the decode check's message
    mask_mod, is_causal, sliding_window = _lower_mask_mod(mask_mod, is_causal, sliding_window)
    if mask_mod is None:
        block_kinds = None
    if implementation not in ("auto", "dense", "chunked", "decode"):
        raise ValueError(
            '`implementation` must be "auto", "dense", "chunked" or "decode". '
            f"Received: implementation={implementation!r}"
        )
    lengths = (query.shape[1], key.shape[1])
    unequal = None not in lengths and lengths[0] != lengths[1]
    if implementation == "decode" and is_causal and unequal:
        # Keras aligns the causal mask at the top left: a decode row would see key 0 alone.
        # (With a length unknown while tracing this cannot be told; the docstring says so.)
        causal_by = "is_causal=True"
        if not given_causal:
            try:
                causal_by = f"mask_mod={given_mask_mod!r}"
            except ValueError:  # a mod whose config cannot be written (per-row tensors)
                causal_by = f"mask_mod={type(given_mask_mod).__name__}(…)"
        raise ValueError(
            'A causal mask aligns query `t` with key `t` (top left, as Keras), so with '
            '`implementation="decode"` a new token would read only the first keys. For '
            "queries at the end of a cache use the layer's `cache_update_index`, or a `mask` "
            f"of the positions each query may read. Received: {causal_by}, "
            f"implementation='decode', T={lengths[0]}, S={lengths[1]}"
        )
    balance = chunk_size is None and sliding_window is None and mask_mod is None
    if chunk_size is None:
        chunk_size = _default_chunk_size(sliding_window, mask_mod is not None or is_causal)
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0:
        raise ValueError(
            f"`chunk_size` must be a positive int. Received: chunk_size={chunk_size!r}"
        )
    dropout_rate = float(dropout_rate) if training else 0.0
    seed = _as_seed(seed) if dropout_rate > 0.0 else None
    path = _choose_path(implementation, query, key, return_weights, chunk_size)
    if path == "auto" and score_mod is not None:
        # The run-time choice is a tf.cond around two programs, and TensorFlow cannot take
        # the gradient of the variables a score_mod reads through one ("Tensor.graph is
        # undefined when eager execution is enabled"): decide while tracing instead, from
        # one example's scores, as inside a caller's XLA step.
        path = _choose_path_from_one_example(query, key, chunk_size)
    if path == "decode" and dropout_rate > 0.0:
        path = "dense"  # the decode path serves inference; dropout's mask is the dense path's
    longest = max(query.shape[1] or 0, key.shape[1] or 0)
    if path == "chunked" and None not in (query.shape[1], key.shape[1]) and longest and (
        block_kinds is None
    ):
        # One block of the sequence, not of `chunk_size`: blocks of 2048 padded a T=512 batch
        # of 256 to 24 GiB of scores (the dense path needs 0.5 GiB).
        chunk_size = min(chunk_size, longest)
        if balance:
            chunk_size = _balanced_chunk_size(longest, chunk_size)
    empty = _empty_result(query, key, value, return_weights)
    if empty is not None:
        return empty if return_weights else empty[0]
    # A mod's per-call tensors (segment ids) enter the program as arguments, so a new batch
    # does not trace a new program; what keys the trace is the rest of it.
    score_template, score_tensors = mods.split(score_mod)
    mask_template, mask_tensors = mods.split(mask_mod)
    if block_kinds is not None and path != "chunked":
        block_kinds = None  # only the chunked path has blocks
    static = dict(
        # Head counts travel as static arguments: once `reduce_retracing` relaxes
        # the traced shapes, `query.shape[2]` inside the program may be None.
        num_heads=query.shape[2],
        num_kv_heads=key.shape[2],
        mask_pattern=mask_pattern,
        bias_pattern=bias_pattern,
        is_causal=bool(is_causal),
        window=sliding_window,
        cap=None if attn_logits_soft_cap is None else float(attn_logits_soft_cap),
        scale=float(scale),
        dropout_rate=dropout_rate,
        return_weights=bool(return_weights),
        chunk_size=chunk_size,
        score_mod=_trace_key(score_template),
        mask_mod=_trace_key(mask_template),
    )
    # On JAX a Keras variable's value enters a program as an input (`jax.jit` would compile
    # it in as a constant): so do the values of every variable the mods hold, and the
    # gradient reaches the trainable ones (a learned bias table). TensorFlow reads variables
    # by reference.
    variable_values = ()
    if keras.backend.backend() == "jax":
        variable_values = tuple(v.value for v in mods.variables_of(score_template, mask_template))
    inputs = (
        query, key, value, mask, bias, seed, score_tensors, mask_tensors, block_kinds,
        variable_values,
    )
    if path == "auto":
        # Lengths unknown while tracing (a Keras model's `Input((None, E))`, TensorFlow
        # only: JAX knows every shape): the actual sizes choose between the two compiled
        # programs, at run time.
        shape = kops.shape(query)
        b, t, s = shape[0], shape[1], kops.shape(key)[1]
        size = (
            kops.cast(b, "int64") * query.shape[2] * kops.cast(t, "int64") * kops.cast(s, "int64")
        )
        out = kops.cond(
            kops.logical_and(size * 4 > _AUTO_CHUNKED_BYTES, kops.maximum(t, s) > chunk_size),
            lambda: _compiled("_attention_xla")(*inputs, path="chunked", **static)[0],
            lambda: _compiled("_attention_xla")(*inputs, path="dense", **static)[0],
        )
        outputs = (out, None)  # "auto" never returns weights: they force dense
    else:
        outputs = _compiled("_attention_xla")(*inputs, path=path, **static)
    out, weights = outputs
    # What the reshapes inside the program hide from the static shape, it states again.
    shim = _backend.get()
    out = shim.with_static_shape(out, (*query.shape[:3], value.shape[-1]))  # (B, T, N, Hv)
    if not return_weights:
        return out
    weights = shim.with_static_shape(
        weights, (query.shape[0], query.shape[2], query.shape[1], key.shape[1])
    )
    return out, weights


def attend(query, key, value, mask=None, *, flash_attention=None, cached=False, **kwargs):
    """The layer's entry: `scaled_dot_product_attention` with the layer's own choices.

    `flash_attention` (`True` chunked, `False` dense, `None` leaves `implementation`) and
    `cached` (a call against a key/value cache: one query row runs the decode path) are
    decided with the rest of the call's static facts (TEMPORARY STUB, being replaced by
    keras_sdpa/_plan.py).
    """
    implementation = kwargs.pop("implementation", "auto")
    if flash_attention is not None:
        if kwargs.get("return_weights") and flash_attention:
            raise ValueError(
                "`return_attention_scores=True` needs the whole (T, S) matrix, which "
                "`flash_attention=True` never forms. Received: flash_attention=True, "
                "return_attention_scores=True"
            )
        implementation = "chunked" if flash_attention else "dense"
    if cached and implementation == "auto" and query.shape[1] == 1:
        implementation = "decode"
    return scaled_dot_product_attention(
        query, key, value, mask, implementation=implementation, **kwargs
    )


# The built-in mods' templates by their trace keys. tf.function keys an object argument by
# its identity (a weak reference), so a new `document(ids)` each call would trace a new
# program; a string keys it by value.
_TEMPLATES = {}


def _trace_key(template):
    """A `mods.Mod` template as a string that keys the trace by its config; others as is."""
    if not isinstance(template, mods.Mod):
        return template
    kind = type(template)
    key = f"{kind.__module__}.{kind.__qualname__}{template._key()!r}"
    _TEMPLATES.setdefault(key, template)
    return key


def _balanced_chunk_size(length, chunk_size):
    """The default block size evened out over `length`: as many blocks as `chunk_size` needs,
    each as short as that allows, rounded up to a multiple of 128 (never above `chunk_size`,
    which may be the length itself). A ViT's 4,097 tokens in blocks of 2048 padded a third
    block of 2047 (2.25x the work); in 3 blocks of 1408, forward plus backward took 0.367 s
    against 0.734 s in one run (N=2, H=64, 2 CPU cores)."""
    blocks = -(-length // chunk_size)
    per_block = -(-length // blocks)
    return min(chunk_size, -(-per_block // 128) * 128)


def _default_chunk_size(sliding_window, masked=False):
    """2048; with a window `W` the power of two nearest above `W / 2` (128 at least); and
    512 when `masked` (causal, or a mask_mod), which leaves about half the blocks empty.

    Small blocks let the loops skip more of what lies outside the band: at T=16,384,
    W=512 on 2 CPU cores, forward plus backward took 0.75 s in blocks of 256, 1.12 s
    in 128, 1.2 s in 512 and 4.0-5.8 s in 2048.
    """
    if sliding_window is None:
        return _MASKED_CHUNK_SIZE if masked else _DEFAULT_CHUNK_SIZE
    size = 1 << max(0, math.ceil(math.log2(sliding_window / 2)))
    return min(_DEFAULT_CHUNK_SIZE, max(128, size))


def _choose_path(implementation, query, key, return_weights, chunk_size):
    """`"dense"`, `"chunked"`, `"decode"`, or `"auto"` when only the run-time sizes can tell.

    "auto" goes chunked when the scores would pass
    `_AUTO_CHUNKED_BYTES` and a sequence is longer than one block: below that, the chunked
    path holds a whole `(T, S)` block per head anyway, as much as dense, and a large batch of
    short sequences stays dense.
    """
    if implementation == "dense" or return_weights:
        return "dense"
    if implementation in ("chunked", "decode"):
        return implementation
    sizes = [_known(d) for d in (query.shape[0], query.shape[2], query.shape[1], key.shape[1])]
    if any(size is None for size in sizes):  # B, N, T, S
        if _inside_xla():
            # Inside a caller's XLA program (`model.compile(jit_compile=True)`) a run-time
            # choice cannot compile: the gradient of its `tf.cond` needs shapes that XLA
            # only sees as parameters there. With T and S known (a fixed sequence length,
            # the batch left unknown, as Keras traces `fit`), the choice is made here from
            # one example's scores; with unknown lengths the chunked path cannot compile
            # at all there (its block counts must be constants), so it stays dense.
            return _choose_path_from_one_example(query, key, chunk_size)
        return "auto"  # decided at run time, from the actual sizes
    large = math.prod(sizes) * 4 > _AUTO_CHUNKED_BYTES
    return "chunked" if large and max(sizes[2], sizes[3]) > chunk_size else "dense"


def _lower_mask_mod(mask_mod, is_causal, sliding_window):
    """`mods.causal()` and `mods.sliding_window(w)`, alone or inside `and_masks`, become the
    core's `is_causal` and `sliding_window`: the same masks, whose blocks the chunked loops
    skip by range, with no block map and no per-block test (see BENCHMARKS.md). Returns the
    mask mod left (or None) and the two arguments."""
    parts = mask_mod.mask_mods if isinstance(mask_mod, mods.AndMasks) else (mask_mod,)
    rest = []
    for part in parts:
        if isinstance(part, mods.Causal):
            is_causal = True
        elif isinstance(part, mods.SlidingWindow):
            window = part.window
            sliding_window = window if sliding_window is None else min(sliding_window, window)
        elif part is not None:
            rest.append(part)
    if len(rest) == len(parts):
        return mask_mod, is_causal, sliding_window
    left = None if not rest else rest[0] if len(rest) == 1 else mods.AndMasks(*rest)
    return left, is_causal, sliding_window


def _known(size):
    """A size known while tracing, else None: JAX's shape inference of a functional model
    traces a custom layer's call with a symbolic batch size, which is not an int."""
    return size if isinstance(size, int) else None


def _choose_path_from_one_example(query, key, chunk_size):
    """Chunked when one example's float32 scores pass 32 MiB and a sequence is longer than a
    block; dense otherwise, and for lengths unknown while tracing."""
    n, t, s = query.shape[2], _known(query.shape[1]), _known(key.shape[1])
    if t is None or s is None:
        return "dense"
    large = n * t * s * 4 > _AUTO_CHUNKED_BYTES_PER_EXAMPLE
    return "chunked" if large and max(t, s) > chunk_size else "dense"


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
    num_heads,
    num_kv_heads,
    mask_pattern,
    bias_pattern,
    is_causal,
    window,
    cap,
    scale,
    dropout_rate,
    return_weights,
    path,
    chunk_size,
    score_mod=None,
    mask_mod=None,
):
    """The whole computation, traced once per static configuration.

    `path` is `"dense"`, `"chunked"` or `"decode"` (`_decode.py`). `score_mod` and `mask_mod`
    are the mods' templates, `score_tensors` and `mask_tensors` their tensors of this call
    (`mods.split`).
    """
    score_template = _TEMPLATES.get(score_mod, score_mod)
    mask_template = _TEMPLATES.get(mask_mod, mask_mod)
    scope = ()
    if variable_values:  # JAX: the mods read their variables as this call's values
        scope = tuple(zip(mods.variables_of(score_template, mask_template), variable_values))
    score_mod = M.ScoreMod(score_template, score_tensors, scope)
    mask_mod = mods.as_function(mods.join(mask_template, mask_tensors))
    mask_mod = None if mask_mod is None else M.reading(mask_mod, scope)
    # The score_mod's float tensors get gradients, and so do the variables it reads: on
    # TensorFlow through tf.custom_gradient's own tracking, on JAX as their values (`scope`).
    # (A tensor a plain function captures is a constant to the paths' custom gradients:
    # `mods.with_tensors` passes it as a tensor of its own.)
    params = score_mod.params if score_mod.fn is not None else ()
    score_mod = score_mod if score_mod.fn is not None else None
    dtype = keras.backend.standardize_dtype(query.dtype)
    compute = "float64" if dtype == "float64" else "float32"  # never below float32
    groups = num_heads // num_kv_heads
    if dtype in M.HALF_DTYPES:
        # The products take the half-precision operands and accumulate in float32; the
        # scale multiplies their float32 result, so it never rounds to the input's precision.
        operand, logit_scale = dtype, scale
        q = kops.transpose(query, (0, 2, 1, 3))  # (B, N, T, H)
    else:
        # (Q K^T) * scale == (Q * scale) K^T: scaling the (T, H) queries is cheaper
        # than scaling the (T, S) logits, and is the same number.
        operand, logit_scale = None, None
        q = kops.transpose(kops.cast(query, compute), (0, 2, 1, 3)) * scale  # (B, N, T, H)
    shape = kops.shape(q)
    q = kops.reshape(q, (shape[0], num_kv_heads, groups, shape[2], shape[3]))
    k = kops.transpose(kops.cast(key, operand or compute), (0, 2, 1, 3))  # (B, K, S, H)
    v = kops.transpose(kops.cast(value, operand or compute), (0, 2, 1, 3))  # (B, K, S, Hv)
    mask = M.grouped(mask, mask_pattern, num_kv_heads, groups)  # (B|1, K|1, G|1, T|1, S|1)
    if bias is not None:
        bias = M.grouped(kops.cast(bias, compute), bias_pattern, num_kv_heads, groups)

    def with_mask_mod(mask):
        if mask_mod is None:
            return mask
        t, s = kops.shape(q)[3], kops.shape(key)[1]
        mod = M.mod_mask(
            mask_mod, M.batch_index(kops.shape(q)[0]), num_heads, num_kv_heads,
            kops.arange(t), kops.arange(s),
        )  # (B|1, K|1, G|1, T, S)
        return mod if mask is None else kops.logical_and(mask, mod)

    def decode():
        t, s = kops.shape(q)[3], kops.shape(key)[1]
        constraint = M.band(kops.arange(t), kops.arange(s), is_causal, window)  # (T, S) or None
        allowed = M.combine(with_mask_mod(mask), constraint)
        return _decode.attend(
            q,
            key,
            value,
            allowed,
            bias,
            cap=cap,
            return_weights=return_weights,
            logit_scale=logit_scale,
            score_mod=score_mod,
            num_heads=num_heads,
        )

    def dense():
        nonlocal mask
        mask = with_mask_mod(mask)
        keep = None
        if dropout_rate > 0.0:
            b, t, s = kops.shape(q)[0], kops.shape(q)[3], kops.shape(k)[2]
            uniform = _backend.get().uniform((b, num_heads, t, s), seed, compute)  # (B, N, T, S)
            keep = M.grouped(uniform >= dropout_rate, (True,) * 4, num_kv_heads, groups)
        return _dense.attend(
            q,
            k,
            v,
            mask,
            bias,
            keep,
            dropout_rate,
            bias_pattern=bias_pattern,
            is_causal=is_causal,
            window=window,
            cap=cap,
            return_weights=return_weights,
            operand=operand,
            logit_scale=logit_scale,
            score_mod=score_mod,
            num_heads=num_heads,
            params=params,
        )

    def chunked():
        out = _chunked.attend(
            q,
            k,
            v,
            mask,
            bias,
            seed,
            mask_pattern=mask_pattern,
            bias_pattern=bias_pattern,
            is_causal=is_causal,
            window=window,
            cap=cap,
            dropout_rate=dropout_rate,
            chunk_size=chunk_size,
            operand=operand,
            logit_scale=logit_scale,
            score_mod=score_mod,
            mask_mod=mask_mod,
            num_heads=num_heads,
            params=params,
            block_kinds=block_kinds,
        )
        return out, None

    out, weights = {"dense": dense, "chunked": chunked, "decode": decode}[path]()
    shape = kops.shape(out)  # (B, K, G, T, Hv)
    out = kops.reshape(out, (shape[0], num_heads, shape[3], shape[4]))  # (B, N, T, Hv)
    out = kops.cast(kops.transpose(out, (0, 2, 1, 3)), dtype)  # (B, T, N, Hv)
    if weights is not None:
        shape = kops.shape(weights)
        weights = kops.reshape(weights, (shape[0], num_heads, shape[3], shape[4]))
        weights = kops.cast(weights, dtype)  # (B, N, T, S)
    return out, weights


def _inside_xla():
    """Whether we are tracing inside a caller's compiled step (always, on JAX)."""
    return _backend.get().inside_compiled()


# The compiled programs, built for the running backend on first use (`__getattr__`): a
# `tf.function(jit_compile=True)` without AutoGraph, or a `jax.jit`, keyed by the keyword
# arguments. The core's loops and branches are on static values.
_COMPILED = {
    "_attention_xla": (
        "_attention",
        ("num_heads", "num_kv_heads", "mask_pattern", "bias_pattern", "is_causal", "window",
         "cap", "scale", "dropout_rate", "return_weights", "path", "chunk_size", "score_mod",
         "mask_mod"),
    ),
    "_block_kinds_xla": ("_block_kinds", ("template", "B", "N", "K", "T", "S", "C")),
}


def __getattr__(name):
    if name not in _COMPILED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    function, static = _COMPILED[name]
    compiled = _backend.get().compile(globals()[function], static_argnames=static)
    globals()[name] = compiled
    return compiled


def _compiled(name):
    """`_attention_xla` or `_block_kinds_xla` (as a test may have replaced it)."""
    return globals()[name] if name in globals() else __getattr__(name)


class BlockMask:
    """The chunked path's block kinds for one `mask_mod` and one set of sizes.

    Made by `create_block_mask`; pass it as `block_mask=` with the same `mask_mod` so that
    several layers share one computation. `kinds` is `(ceil(T / C), ceil(S / C))` int32:
    0 for a block the mod empties, 1 for a partial block, 2 for a full one.
    """

    def __init__(self, kinds, mask_mod, block_size, sizes=None):
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
def create_block_mask(mask_mod, B, N, T, S, block_size=None, num_kv_heads=None):
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
    _check_mod("mask_mod", mask_mod)
    if mask_mod is None:
        raise ValueError("`create_block_mask` needs a mask_mod. Received: mask_mod=None")
    if block_size is None:
        block_size = _MASKED_CHUNK_SIZE
    for name, value in (("B", B), ("N", N), ("T", T), ("S", S), ("block_size", block_size)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
            raise ValueError(f"`{name}` must be a positive int. Received: {name}={value!r}")
    num_kv_heads = N if num_kv_heads is None else num_kv_heads
    template, tensors = mods.split(mask_mod)
    variable_values = ()
    if keras.backend.backend() == "jax":  # as in scaled_dot_product_attention
        variable_values = tuple(v.value for v in mods.variables_of(template))
    kinds = _compiled("_block_kinds_xla")(
        tensors, variable_values, template=template, B=B, N=N, K=num_kv_heads, T=T, S=S,
        C=block_size,
    )
    sizes = dict(B=B, N=N, T=T, S=S)
    return BlockMask(kinds, mask_mod, block_size, sizes)


def _block_kinds(tensors, variable_values=(), *, template, B, N, K, T, S, C):
    mask_mod = mods.as_function(mods.join(template, tensors))
    # JAX: the variables the mod holds, as this call's values (and a warning for others).
    mask_mod = M.reading(mask_mod, tuple(zip(mods.variables_of(template), variable_values)))
    b_index = M.batch_index(B)
    # T and S as ints: JAX sizes the array of block kinds while tracing.
    return _chunked.kinds_of_blocks(mask_mod, b_index, N, K, T, S, C)


def _check_block_mask(block_mask, mask_mod, chunk_size, query, key):
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
