"""Scaled dot-product attention: the stateless, XLA-compiled core.

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V

Shapes, used everywhere in this package:

    B  batch              T  query length        S  key/value length
    N  heads              H  query/key head size Hv value head size
    E  model width

Queries are `(B, T, N, H)`, keys `(B, S, N, H)` and values `(B, S, N, Hv)`, the
layout of `keras.ops.dot_product_attention`. Attention weights are `(B, N, T, S)`.

The public entry point, `scaled_dot_product_attention`, checks its arguments in
Python and then calls `_attention_xla`, a `tf.function(jit_compile=True)`: the
scores, the scaling, the softmax and the weighted sum of values all run as one
XLA program, and so does their gradient.

The rule for a fully masked query row (a query that may attend to nothing):
its weights are all zero and its output is zero, never NaN, on every path.
"""

import math
import numbers

import tensorflow as tf

# Stands in for -inf on masked scores: finite, so `scores - max` never makes a NaN.
_MASKED_SCORE = -3.0e38
# implementation="auto" goes chunked above this many bytes of float32 scores (B * N * T * S * 4).
_AUTO_CHUNKED_BYTES = 1 << 28
# Blocks of 2048: at T=4096 on 2 CPU cores, 1.08x the dense time (1024 blocks: 1.34x).
_DEFAULT_CHUNK_SIZE = 2048


def scaled_dot_product_attention(
    query,
    key,
    value,
    mask=None,
    *,
    is_causal=False,
    scale=None,
    dropout_rate=0.0,
    training=False,
    seed=None,
    return_weights=False,
    implementation="auto",
    chunk_size=None,
):
    """Scaled dot-product attention, compiled by XLA.

    Computes `softmax(Q K^T * scale) V` (Vaswani et al., 2017, "Attention Is
    All You Need", eq. 1) in four steps: the scores `Q K^T`, the scaling by
    `scale` (default `1 / sqrt(H)`), a numerically stable softmax over the keys
    (the row maximum is subtracted before `exp`), and the weighted sum of the
    values.

    Scores and softmax are computed in float32 for `float16`, `bfloat16` and
    `float32` inputs (so mixed precision cannot overflow them), and in float64
    for float64 inputs; the results are cast back to the dtype of `query`.

    A query row whose keys are all masked gets zero weights and a zero output.

    Args:
        query: `(B, T, N, H)` floating tensor.
        key: `(B, S, N, H)` floating tensor.
        value: `(B, S, N, Hv)` floating tensor. `Hv` may differ from `H`.
        mask: optional boolean tensor broadcastable to `(B, N, T, S)`. `True`
            means "may attend". Non-boolean masks are read as `mask != 0`.
        is_causal: if `True`, query `t` attends only to keys `s <= t`
            (aligned at the top left when `T != S`, as in Keras). Combined
            with `mask` by logical and.
        scale: multiplies the scores. Defaults to `1 / sqrt(H)`.
        dropout_rate: fraction of attention weights to drop, in `[0, 1)`.
            Applied only when `training` is true.
        training: whether dropout is active.
        seed: seed for dropout: an int, a `(2,)` integer tensor (as returned
            by `keras.random.SeedGenerator.next()`), or `None` for a random one.
        return_weights: if `True`, also return the attention weights (before
            dropout, as `keras.layers.MultiHeadAttention` returns them).
        implementation: `"dense"` forms the `(B, N, T, S)` scores; `"chunked"`
            works in `(chunk_size, chunk_size)` blocks with an online softmax
            and a recomputing gradient, in `O(T + S)` memory (Rabe & Staats,
            2021; Dao et al., 2022). `"auto"` (default) picks chunked when the
            float32 scores would exceed 256 MiB. Dropout (when training) and
            `return_weights` need the whole matrix and always run dense.
        chunk_size: block size of the chunked path. Defaults to 2048.

    Returns:
        The output, `(B, T, N, Hv)`, and if `return_weights`, the weights,
        `(B, N, T, S)`, both in the dtype of `query`.

    Example:

    >>> q = tf.random.normal((2, 3, 4, 8))   # (B, T, N, H)
    >>> kv = tf.random.normal((2, 5, 4, 8))  # (B, S, N, H)
    >>> out, weights = scaled_dot_product_attention(q, kv, kv, return_weights=True)
    >>> out.shape, weights.shape
    (TensorShape([2, 3, 4, 8]), TensorShape([2, 4, 3, 5]))
    """
    query = tf.convert_to_tensor(query)
    key = tf.convert_to_tensor(key)
    value = tf.convert_to_tensor(value)
    _check_inputs(query, key, value)
    if mask is not None:
        mask = _check_mask(tf.convert_to_tensor(mask), query, key)
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"`dropout_rate` must be in [0, 1). Received: dropout_rate={dropout_rate}")
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    _check_scale(scale)
    if implementation not in ("auto", "dense", "chunked"):
        raise ValueError(
            '`implementation` must be "auto", "dense" or "chunked". '
            f"Received: implementation={implementation!r}"
        )
    if chunk_size is None:
        chunk_size = _DEFAULT_CHUNK_SIZE
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0:
        raise ValueError(
            f"`chunk_size` must be a positive int. Received: chunk_size={chunk_size!r}"
        )
    dropout_rate = float(dropout_rate) if training else 0.0
    chunked = _use_chunked(implementation, query, key, dropout_rate, return_weights)
    if dropout_rate > 0.0:
        seed = _as_seed(seed)
    else:
        seed = None
    outputs = _attention_xla(
        query,
        key,
        value,
        mask,
        seed,
        is_causal=bool(is_causal),
        scale=float(scale),
        dropout_rate=dropout_rate,
        return_weights=bool(return_weights),
        chunk_size=chunk_size if chunked else None,
    )
    return outputs if return_weights else outputs[0]


def _use_chunked(implementation, query, key, dropout_rate, return_weights):
    """Whether the chunked path runs: never with dropout or weights, which need `(T, S)`."""
    if implementation == "dense" or dropout_rate > 0.0 or return_weights:
        return False
    if implementation == "chunked":
        return True
    sizes = [query.shape[0], query.shape[2], query.shape[1], key.shape[1]]  # B, N, T, S
    if any(size is None for size in sizes):
        return False
    return math.prod(sizes) * 4 > _AUTO_CHUNKED_BYTES


def _attention(
    query,
    key,
    value,
    mask,
    seed,
    *,
    is_causal,
    scale,
    dropout_rate,
    return_weights,
    chunk_size=None,
):
    """The whole computation, traced once per static configuration.

    `chunk_size=None` runs the dense path, an int the chunked one.
    """
    dtype = query.dtype
    compute = tf.float64 if dtype == tf.float64 else tf.float32  # never below float32
    # Heads become a batch axis, so each step is one batched matmul.
    # (Q K^T) * scale == (Q * scale) K^T: scaling the (T, H) queries is cheaper
    # than scaling the (T, S) scores, and is the same number.
    q = tf.transpose(tf.cast(query, compute), [0, 2, 1, 3]) * scale  # (B, N, T, H)
    k = tf.transpose(tf.cast(key, compute), [0, 2, 1, 3])  # (B, N, S, H)
    v = tf.transpose(tf.cast(value, compute), [0, 2, 1, 3])  # (B, N, S, Hv)

    if chunk_size is not None:
        out = _attend_chunked(q, k, v, mask, is_causal, chunk_size)
        return tf.cast(tf.transpose(out, [0, 2, 1, 3]), dtype), None  # (B, T, N, Hv)

    if is_causal:
        t, s = tf.shape(q)[2], tf.shape(k)[2]
        causal = tf.range(t)[:, None] >= tf.range(s)[None, :]  # (T, S)
        mask = causal if mask is None else tf.logical_and(mask, causal)

    keep = None
    if dropout_rate > 0.0:
        shape = tf.stack([tf.shape(q)[0], tf.shape(q)[1], tf.shape(q)[2], tf.shape(k)[2]])
        # Philox explicitly: XLA's CPU default (ThreeFry) is about 100x slower here.
        keep = (
            tf.random.stateless_uniform(shape, seed, dtype=compute, alg="philox") >= dropout_rate
        )  # (B, N, T, S)

    out, weights = _attend(q, k, v, mask, keep, dropout_rate, return_weights)
    out = tf.cast(tf.transpose(out, [0, 2, 1, 3]), dtype)  # (B, T, N, Hv)
    if weights is not None:
        weights = tf.cast(weights, dtype)
    return out, weights


_attention_xla = tf.function(_attention, jit_compile=True, reduce_retracing=True)


def _softmax_parts(scores, mask):
    """The stable softmax of the scores, left unnormalized.

    Returns `exp`, `(B, N, T, S)`, with `exp(scores - row_max)` where allowed and
    0 where masked, its reciprocal row sum `inv_total`, `(B, N, T, 1)`, and the
    row log-sum-exp `lse`, so that `weights = exp * inv_total = exp(scores - lse)`.
    A fully masked row has `exp == 0`: its weights and its output are zero.
    """
    if mask is not None:
        scores = tf.where(mask, scores, _MASKED_SCORE)
    row_max = tf.reduce_max(scores, axis=-1, keepdims=True)  # (B, N, T, 1)
    exp = tf.exp(scores - row_max)  # (B, N, T, S)
    if mask is not None:
        exp = tf.where(mask, exp, 0.0)
    total = tf.reduce_sum(exp, axis=-1, keepdims=True)  # (B, N, T, 1)
    total = tf.where(total > 0.0, total, 1.0)  # fully masked rows: 0 / 1 = 0
    return exp, 1.0 / total, row_max + tf.math.log(total)


def _attend(q, k, v, mask, keep, dropout_rate, return_weights):
    """softmax(q k^T) v on `(B, N, ., .)` tensors, with a hand-written gradient.

    Three choices make this faster than the softmax and gradient XLA derives
    on its own, on a CPU where every pass over the `(T, S)` matrix is the cost:

    - the forward pass never normalizes the `(T, S)` weights; it divides the
      `(T, Hv)` output by the row sums instead (`weights` are only formed when
      they are returned);
    - the gradient is FlashAttention's (Dao et al., 2022):
      `dS = P * (dP - rowsum(dO * O))`, so the softmax is not replayed;
    - XLA's CPU matmul is slow when the `(T, S)` matrix must be read transposed
      (`P^T dO`, `dS^T Q`), so the gradient recomputes `P^T` from `K Q^T` and
      the saved log-sum-exp, in the layout those two products want.
    """
    scale_keep = None if keep is None else 1.0 / (1.0 - dropout_rate)
    mask_t = None if mask is None else tf.linalg.matrix_transpose(mask)
    keep_t = None if keep is None else tf.linalg.matrix_transpose(keep)

    @tf.custom_gradient
    def attend(q, k, v):
        scores = tf.matmul(q, k, transpose_b=True)  # (B, N, T, S)
        exp, inv_total, lse = _softmax_parts(scores, mask)
        applied = exp if keep is None else tf.where(keep, exp * scale_keep, 0.0)
        out = tf.matmul(applied, v) * inv_total  # (B, N, T, Hv)
        weights = exp * inv_total if return_weights else None  # (B, N, T, S)

        def grad(d_out, d_weights=None):
            # rowsum(P * dP) == rowsum(dO * O), a (T, Hv) product, not a (T, S) one.
            row_dot = tf.reduce_sum(d_out * out, axis=-1, keepdims=True)  # (B, N, T, 1)
            d_probs = tf.matmul(d_out, v, transpose_b=True)  # (B, N, T, S)
            if keep is not None:
                d_probs = tf.where(keep, d_probs * scale_keep, 0.0)
            probs = exp * inv_total  # (B, N, T, S)
            if d_weights is not None:
                d_probs = d_probs + d_weights
                row_dot = row_dot + tf.reduce_sum(d_weights * probs, axis=-1, keepdims=True)
            d_scores = probs * (d_probs - row_dot)  # (B, N, T, S)
            d_q = tf.matmul(d_scores, k)  # (B, N, T, H)

            # The same in the (S, T) layout, for d_k and d_v.
            probs_t = tf.exp(
                tf.matmul(k, q, transpose_b=True) - tf.linalg.matrix_transpose(lse)
            )  # (B, N, S, T)
            if mask_t is not None:
                probs_t = tf.where(mask_t, probs_t, 0.0)
            applied_t = probs_t if keep_t is None else tf.where(keep_t, probs_t * scale_keep, 0.0)
            d_v = tf.matmul(applied_t, d_out)  # (B, N, S, Hv)
            d_probs_t = tf.matmul(v, d_out, transpose_b=True)  # (B, N, S, T)
            if keep_t is not None:
                d_probs_t = tf.where(keep_t, d_probs_t * scale_keep, 0.0)
            if d_weights is not None:
                d_probs_t = d_probs_t + tf.linalg.matrix_transpose(d_weights)
            d_scores_t = probs_t * (d_probs_t - tf.linalg.matrix_transpose(row_dot))
            d_k = tf.matmul(d_scores_t, q)  # (B, N, S, H)
            return d_q, d_k, d_v

        if return_weights:
            return (out, weights), grad
        return out, lambda d_out: grad(d_out)

    if return_weights:
        return attend(q, k, v)
    return attend(q, k, v), None


def _attend_chunked(q, k, v, mask, is_causal, chunk_size):
    """softmax(q k^T) v in `(C, C)` blocks, `C = chunk_size`, never holding `(T, S)`.

    The online softmax of Rabe & Staats (2021, "Self-attention Does Not Need
    O(n^2) Memory") and FlashAttention (Dao et al., 2022): for each block of
    queries the blocks of keys arrive one at a time, and a running row maximum
    `m`, row sum `total` and output `acc` are rescaled by `exp(m_old - m_new)` as each
    arrives. The gradient recomputes every block from `q`, `k` and the saved
    log-sum-exp (FlashAttention-2's split: one pass over query blocks for `dq`,
    one over key blocks for `dk` and `dv`), so memory is `O(T + S)` plus a few
    `(C, C)` blocks per head, forward and backward. With `is_causal`, blocks
    wholly above the diagonal are skipped.
    """
    t, s = tf.shape(q)[2], tf.shape(k)[2]
    num_q = (t + chunk_size - 1) // chunk_size
    num_k = (s + chunk_size - 1) // chunk_size
    q_blocks = _to_blocks(q, num_q, chunk_size)  # (nq, B, N, C, H)
    k_blocks = _to_blocks(k, num_k, chunk_size)  # (nk, B, N, C, H)
    v_blocks = _to_blocks(v, num_k, chunk_size)  # (nk, B, N, C, Hv)
    mask_blocks = None
    if mask is not None:
        if mask.shape[2] is None:  # whether it broadcasts over T is unknown: make it explicit
            mask = tf.broadcast_to(mask, tf.stack([tf.shape(mask)[0], tf.shape(mask)[1], t, s]))
        mask = tf.linalg.matrix_transpose(mask)  # (Bm, Nm, S, Tm): blocks of keys first
        mask_blocks = _to_blocks(mask, num_k, chunk_size)  # (nk, Bm, Nm, C, Tm')
        mask_blocks = tf.linalg.matrix_transpose(mask_blocks)  # (nk, Bm, Nm, Tm', C)
        if mask.shape[3] != 1:
            mask_blocks = tf.transpose(
                _to_blocks(mask_blocks, num_q, chunk_size, axis=3), [1, 0, 2, 3, 4, 5]
            )  # (nk, nq, Bm, Nm, C, C)
    offsets = tf.range(chunk_size)

    def allowed(i, j):
        """The "may attend" block, `(., ., C or 1, C)`, of query block i and key block j."""
        keys = j * chunk_size + offsets  # (C,)
        result = (keys < s)[None, :]  # (1, C): padded keys never
        if is_causal:
            queries = i * chunk_size + offsets
            result = tf.logical_and(result, queries[:, None] >= keys[None, :])  # (C, C)
        result = result[None, None]
        if mask_blocks is not None:
            block = tf.gather(mask_blocks, j)
            if mask.shape[3] != 1:
                block = tf.gather(block, i)
            result = tf.logical_and(result, block)
        return result

    def first_key_block_after(
        i,
    ):  # causal: key blocks j < this hold keys s <= some query of block i
        return tf.minimum(num_k, i + 1) if is_causal else num_k

    def first_query_block(j):  # causal: query blocks before this one see nothing of key block j
        return j if is_causal else 0

    def probs_block(i, j, lse_i):
        """Recomputed `P` block `exp(q_i k_j^T - lse_i)`, masked: `(B, N, C, C)`."""
        scores = tf.matmul(tf.gather(q_blocks, i), tf.gather(k_blocks, j), transpose_b=True)
        return tf.where(allowed(i, j), tf.exp(scores - lse_i), 0.0)

    @tf.custom_gradient
    def attend(q_blocks, k_blocks, v_blocks):
        def query_block(i, outs, lses):
            q_i = tf.gather(q_blocks, i)  # (B, N, C, H)
            row = tf.zeros_like(q_i[..., :1])  # (B, N, C, 1)

            def key_block(j, m, total, acc):
                scores = tf.matmul(q_i, tf.gather(k_blocks, j), transpose_b=True)  # (B, N, C, C)
                ok = allowed(i, j)
                scores = tf.where(ok, scores, _MASKED_SCORE)
                m_new = tf.maximum(m, tf.reduce_max(scores, axis=-1, keepdims=True))
                p = tf.where(ok, tf.exp(scores - m_new), 0.0)  # (B, N, C, C)
                correction = tf.exp(m - m_new)  # (B, N, C, 1)
                total = total * correction + tf.reduce_sum(p, axis=-1, keepdims=True)
                acc = acc * correction + tf.matmul(p, tf.gather(v_blocks, j))  # (B, N, C, Hv)
                return j + 1, m_new, total, acc

            acc = tf.zeros_like(tf.gather(v_blocks, 0))  # (B, N, C, Hv)
            _, m, total, acc = tf.while_loop(
                lambda j, *_: j < first_key_block_after(i),
                key_block,
                (tf.constant(0), row + _MASKED_SCORE, row, acc),
            )
            seen = total > 0.0  # False on fully masked rows: zero output
            safe_total = tf.where(seen, total, 1.0)
            outs = outs.write(i, acc * tf.where(seen, 1.0 / safe_total, 0.0))
            lses = lses.write(i, tf.where(seen, m + tf.math.log(safe_total), 0.0))
            return i + 1, outs, lses

        _, outs, lses = tf.while_loop(
            lambda i, *_: i < num_q,
            query_block,
            (
                tf.constant(0),
                tf.TensorArray(q_blocks.dtype, size=num_q, element_shape=None),
                tf.TensorArray(q_blocks.dtype, size=num_q, element_shape=None),
            ),
        )
        out_blocks, lse_blocks = outs.stack(), lses.stack()  # (nq, B, N, C, Hv), (nq, B, N, C, 1)

        def grad(d_out_blocks):
            row_dot = tf.reduce_sum(d_out_blocks * out_blocks, axis=-1, keepdims=True)

            def d_query_block(i, d_qs):  # dq_i = sum_j dS_ij k_j
                d_out_i, lse_i, row_dot_i = (
                    tf.gather(x, i) for x in (d_out_blocks, lse_blocks, row_dot)
                )

                def key_block(j, d_q):
                    p = probs_block(i, j, lse_i)  # (B, N, C, C)
                    d_p = tf.matmul(d_out_i, tf.gather(v_blocks, j), transpose_b=True)
                    d_scores = p * (d_p - row_dot_i)
                    return j + 1, d_q + tf.matmul(d_scores, tf.gather(k_blocks, j))

                _, d_q = tf.while_loop(
                    lambda j, *_: j < first_key_block_after(i),
                    key_block,
                    (tf.constant(0), tf.zeros_like(tf.gather(q_blocks, 0))),
                )
                return i + 1, d_qs.write(i, d_q)

            def d_key_block(j, d_ks, d_vs):  # dk_j = sum_i dS_ij^T q_i, dv_j = sum_i P_ij^T dO_i
                k_j, v_j = tf.gather(k_blocks, j), tf.gather(v_blocks, j)

                def query_block(i, d_k, d_v):
                    # In the (keys, queries) layout, so that no product reads a block
                    # transposed (XLA's CPU matmul is slow at that).
                    q_i, d_out_i = tf.gather(q_blocks, i), tf.gather(d_out_blocks, i)
                    lse_t = tf.linalg.matrix_transpose(tf.gather(lse_blocks, i))  # (B, N, 1, C)
                    scores_t = tf.matmul(k_j, q_i, transpose_b=True)  # (B, N, C_keys, C_queries)
                    ok_t = tf.linalg.matrix_transpose(allowed(i, j))
                    p_t = tf.where(ok_t, tf.exp(scores_t - lse_t), 0.0)
                    d_v = d_v + tf.matmul(p_t, d_out_i)  # (B, N, C, Hv)
                    d_p_t = tf.matmul(v_j, d_out_i, transpose_b=True)
                    row_dot_t = tf.linalg.matrix_transpose(tf.gather(row_dot, i))
                    d_k = d_k + tf.matmul(p_t * (d_p_t - row_dot_t), q_i)  # (B, N, C, H)
                    return i + 1, d_k, d_v

                _, d_k, d_v = tf.while_loop(
                    lambda i, *_: i < num_q,
                    query_block,
                    (first_query_block(j), tf.zeros_like(k_j), tf.zeros_like(v_j)),
                )
                return j + 1, d_ks.write(j, d_k), d_vs.write(j, d_v)

            array = lambda size: tf.TensorArray(q_blocks.dtype, size=size)  # noqa: E731
            _, d_qs = tf.while_loop(
                lambda i, *_: i < num_q, d_query_block, (tf.constant(0), array(num_q))
            )
            _, d_ks, d_vs = tf.while_loop(
                lambda j, *_: j < num_k, d_key_block, (tf.constant(0), array(num_k), array(num_k))
            )
            return d_qs.stack(), d_ks.stack(), d_vs.stack()

        return out_blocks, grad

    out_blocks = attend(q_blocks, k_blocks, v_blocks)
    return _from_blocks(out_blocks, t)  # (B, N, T, Hv)


def _to_blocks(x, num, chunk_size, axis=2):
    """Zero-pads `axis` of `x` to `num * chunk_size` and moves its blocks to a new axis 0.

    `(B, N, L, D)` with `axis=2` becomes `(num, B, N, C, D)`.
    """
    shape = tf.shape(x)
    pad = [[0, 0]] * x.shape.rank
    pad[axis] = [0, num * chunk_size - shape[axis]]
    x = tf.pad(x, pad)
    split = tf.concat([shape[:axis], [num, chunk_size], shape[axis + 1 :]], 0)
    x = tf.reshape(x, split)
    order = [axis] + [a for a in range(x.shape.rank) if a != axis]
    return tf.transpose(x, order)


def _from_blocks(blocks, length):
    """`(num, B, N, C, D)` back to `(B, N, length, D)`, dropping the padding."""
    x = tf.transpose(blocks, [1, 2, 0, 3, 4])  # (B, N, num, C, D)
    shape = tf.shape(x)
    x = tf.reshape(x, tf.stack([shape[0], shape[1], shape[2] * shape[3], shape[4]]))
    return x[:, :, :length]


def _check_scale(scale):
    if (
        isinstance(scale, bool)
        or not isinstance(scale, numbers.Real)
        or not math.isfinite(scale)
        or scale <= 0
    ):
        raise ValueError(
            f"`scale` must be a positive finite number or None. Received: scale={scale!r}"
        )


def _check_inputs(query, key, value):
    for name, tensor, layout in (
        ("query", query, "(B, T, N, H)"),
        ("key", key, "(B, S, N, H)"),
        ("value", value, "(B, S, N, Hv)"),
    ):
        if tensor.shape.rank != 4:
            raise ValueError(
                f"`{name}` must have rank 4, {layout}. Received: {name}.shape={tuple(tensor.shape)}"
            )
        if not tensor.dtype.is_floating:
            raise ValueError(
                f"`{name}` must be a floating tensor. Received: {name}.dtype={tensor.dtype.name}"
            )
    if not _compatible(query.shape[-1], key.shape[-1]):
        raise ValueError(
            "`query` and `key` must have the same head size H (last axis). "
            f"Received: query.shape={tuple(query.shape)}, key.shape={tuple(key.shape)}"
        )
    if not _compatible(key.shape[1], value.shape[1]):
        raise ValueError(
            "`key` and `value` must have the same length S (axis 1). "
            f"Received: key.shape={tuple(key.shape)}, value.shape={tuple(value.shape)}"
        )
    for axis, what in ((0, "batch size B"), (2, "number of heads N")):
        sizes = [query.shape[axis], key.shape[axis], value.shape[axis]]
        known = {size for size in sizes if size is not None}
        if len(known) > 1:
            raise ValueError(
                f"`query`, `key` and `value` must have the same {what} (axis {axis}). "
                f"Received: query.shape={tuple(query.shape)}, "
                f"key.shape={tuple(key.shape)}, value.shape={tuple(value.shape)}"
            )


def _check_mask(mask, query, key):
    target = (query.shape[0], query.shape[2], query.shape[1], key.shape[1])  # (B, N, T, S)
    rank = mask.shape.rank
    ok = rank is not None and rank <= 4
    if ok:
        for size, want in zip(reversed(mask.shape), reversed(target)):
            if size not in (None, 1) and want is not None and size != want:
                ok = False
    if not ok:
        raise ValueError(
            "`mask` must broadcast to (B, N, T, S) = "
            f"{tuple(target)}. Received: mask.shape={tuple(mask.shape)}"
        )
    if mask.dtype != tf.bool:
        mask = tf.not_equal(mask, tf.zeros((), mask.dtype))
    for _ in range(4 - rank):
        mask = mask[None]
    return mask  # rank 4


def _compatible(a, b):
    return a is None or b is None or a == b


def _as_seed(seed):
    """A `(2,)` int32 seed for the stateless dropout inside the XLA program."""
    if seed is None:
        return tf.random.uniform((2,), maxval=2**31 - 1, dtype=tf.int32)
    if isinstance(seed, int):
        return tf.constant([seed, 0], dtype=tf.int32)
    seed = tf.convert_to_tensor(seed)
    if seed.shape.rank != 1 or seed.shape[0] != 2 or not seed.dtype.is_integer:
        raise ValueError(
            f"`seed` must be an int, None, or a (2,) integer tensor. Received: seed={seed!r}"
        )
    return tf.cast(seed, tf.int32)
