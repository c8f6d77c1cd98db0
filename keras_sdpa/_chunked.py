"""The chunked path: the online softmax in `(C, C)` blocks, never holding `(T, S)`.

Tensors are in the grouped layout of `keras_sdpa._masking`: `q (B, K, G, T, H)`,
`k (B, K, S, H)`, `v (B, K, S, Hv)`. A block of queries holds all `G` heads of a
group, so each block product reads its key block once, whatever the grouping.
"""

import tensorflow as tf

from keras_sdpa import _masking as M


def attend(
    q,
    k,
    v,
    mask,
    bias,
    seed,
    *,
    mask_pattern,
    bias_pattern,
    is_causal,
    window,
    cap,
    dropout_rate,
    chunk_size,
    operand=None,
    logit_scale=None,
):
    """softmax(logits) v in blocks of `C = chunk_size` queries and keys.

    The online softmax of Rabe & Staats (2021, "Self-attention Does Not Need
    O(n^2) Memory") and FlashAttention (Dao et al., 2022): for each block of
    queries the blocks of keys arrive one at a time, and a running row maximum
    `m`, row sum `total` and output `acc` are rescaled by `exp(m_old - m_new)`
    as each arrives. The gradient recomputes every block from `q`, `k` and the
    saved log-sum-exp (FlashAttention-2's split: one pass over query blocks for
    `dq` and the bias, one over key blocks for `dk` and `dv`), so memory is
    `O(T + S)` plus a few `(C, C)` blocks per head, forward and backward.

    Blocks that no query of the block may see are skipped, forward and backward:
    above the diagonal with `is_causal`, and outside the band with a window, so
    a window of `W` costs `O(T * W)`, not `O(T * S)`.

    Dropout draws each block's keep-mask from a stateless Philox stream keyed by
    the seed and the block's indices, and the gradient draws the same mask again.

    `operand` and `logit_scale` are as in `keras_sdpa._dense.attend`: with bfloat16 or
    float16 inputs the block products multiply in that precision and accumulate in float32,
    and the running maximum, sums, output and gradients are carried in float32.

    Returns the output `(B, K, G, T, Hv)`.
    """
    groups = q.shape[2]
    compute = q.dtype if operand is None else tf.float32
    c = chunk_size
    t, s = tf.shape(q)[3], tf.shape(k)[2]
    num_q = (t + c - 1) // c
    num_k = (s + c - 1) // c
    q_blocks = _to_blocks(q, num_q, c, axis=3)  # (nq, B, K, G, C, H)
    k_blocks = _to_blocks(k, num_k, c, axis=2)  # (nk, B, K, C, H)
    v_blocks = _to_blocks(v, num_k, c, axis=2)  # (nk, B, K, C, Hv)
    mask_grid = None if mask is None else _grid(mask, mask_pattern, num_q, num_k, c)
    offsets = tf.range(c)
    scale_keep = 1.0 / (1.0 - dropout_rate) if dropout_rate > 0.0 else None

    def allowed(i, j):
        """The "may attend" block of query block i and key block j, 5-D, broadcastable."""
        keys = j * c + offsets  # (C,)
        result = (keys < s)[None, :]  # (1, C): padded keys never
        result = M.combine(result, M.band(i * c + offsets, keys, is_causal, window))  # (C|1, C)
        result = result[None, None, None]
        if mask_grid is not None:
            result = tf.logical_and(result, _block(mask_grid, mask_pattern, i, j))
        return result

    def keep_block(i, j, shape):
        """Block (i, j) of the dropout keep-mask, the same in the forward and the gradient."""
        block_seed = tf.random.experimental.stateless_fold_in(seed, i * num_k + j, alg="philox")
        return tf.random.stateless_uniform(shape, block_seed, alg="philox") >= dropout_rate

    def key_range(i):
        return key_block_range(i, num_k, c, is_causal, window)

    def query_range(j):
        return query_block_range(j, num_q, c, is_causal, window)

    def matmul(a, b, transpose_b=False):
        return M.matmul(a, b, operand, transpose_b)

    def forward(q_blocks, k_blocks, v_blocks, bias_grid):
        def block_logits(i, j, q_i):
            bias_ij = None if bias_grid is None else _block(bias_grid, bias_pattern, i, j)
            raw = matmul(M.to_rows(q_i), tf.gather(k_blocks, j), transpose_b=True)
            raw = M.scaled(M.from_rows(raw, groups), logit_scale)
            return M.logits(raw, bias_ij, cap)  # (B, K, G, C, C)

        def query_block(i, outs, lses):
            q_i = tf.gather(q_blocks, i)  # (B, K, G, C, H)
            row = tf.zeros_like(q_i[..., :1], dtype=compute)  # (B, K, G, C, 1)

            def key_block(j, m, total, acc):
                scores = block_logits(i, j, q_i)  # (B, K, G, C, C)
                ok = allowed(i, j)
                scores = tf.where(ok, scores, M.MASKED_SCORE)
                m_new = tf.maximum(m, tf.reduce_max(scores, axis=-1, keepdims=True))
                p = tf.where(ok, tf.exp(scores - m_new), 0.0)  # (B, K, G, C, C)
                correction = tf.exp(m - m_new)  # (B, K, G, C, 1)
                total_new = total * correction + tf.reduce_sum(p, axis=-1, keepdims=True)
                if scale_keep is not None:
                    p = tf.where(keep_block(i, j, tf.shape(p)), p * scale_keep, 0.0)
                update = M.from_rows(matmul(M.to_rows(p), tf.gather(v_blocks, j)), groups)
                acc_new = acc * correction + update  # (B, K, G, C, Hv)
                # Broadcasting with a mask block can hide a size known before (K = 1): the
                # loop's carried shapes must stay as they entered.
                for carried, before in ((m_new, m), (total_new, total), (acc_new, acc)):
                    carried.set_shape(before.shape)
                return j + 1, m_new, total_new, acc_new

            lo, hi = key_range(i)
            v_shape = tf.shape(v_blocks)
            acc = tf.zeros(tf.concat([tf.shape(q_i)[:4], v_shape[-1:]], 0), compute)
            _, m, total, acc = tf.while_loop(
                lambda j, *_: j < hi,
                key_block,
                (lo, row + M.MASKED_SCORE, row, acc),
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
                tf.TensorArray(compute, size=num_q, element_shape=None),
                tf.TensorArray(compute, size=num_q, element_shape=None),
            ),
        )
        out_blocks, lse_blocks = outs.stack(), lses.stack()  # (nq, B, K, G, C, Hv), (…, C, 1)

        def grad(d_out_blocks):
            row_dot = tf.reduce_sum(d_out_blocks * out_blocks, axis=-1, keepdims=True)

            def d_query_block(i, d_qs, d_bias):  # dq_i = sum_j dS_ij k_j
                q_i, d_out_i, lse_i, row_dot_i = (
                    tf.gather(x, i) for x in (q_blocks, d_out_blocks, lse_blocks, row_dot)
                )

                def key_block(j, d_q, d_bias):
                    scores = block_logits(i, j, q_i)
                    p = tf.where(allowed(i, j), tf.exp(scores - lse_i), 0.0)  # (B, K, G, C, C)
                    d_p = M.from_rows(
                        matmul(M.to_rows(d_out_i), tf.gather(v_blocks, j), transpose_b=True),
                        groups,
                    )
                    if scale_keep is not None:
                        d_p = tf.where(keep_block(i, j, tf.shape(p)), d_p * scale_keep, 0.0)
                    d_scores = p * (d_p - row_dot_i)
                    if cap is not None:
                        d_scores = d_scores * M.cap_derivative(scores, cap)
                    d_q_new = d_q + M.from_rows(
                        matmul(M.to_rows(d_scores), tf.gather(k_blocks, j)), groups
                    )
                    d_q_new.set_shape(d_q.shape)  # as it entered the loop (see the forward)
                    if bias_grid is not None:
                        d_bias = _add_block(d_bias, bias_pattern, i, j, d_scores)
                    return j + 1, d_q_new, d_bias

                lo, hi = key_range(i)
                _, d_q, d_bias = tf.while_loop(
                    lambda j, *_: j < hi,
                    key_block,
                    (lo, tf.zeros_like(q_i, dtype=compute), d_bias),
                )
                return i + 1, d_qs.write(i, M.scaled(d_q, logit_scale)), d_bias

            def d_key_block(j, d_ks, d_vs):  # dk_j = sum_i dS_ij^T q_i, dv_j = sum_i P_ij^T dO_i
                k_j, v_j = tf.gather(k_blocks, j), tf.gather(v_blocks, j)

                def query_block(i, d_k, d_v):
                    # In the (keys, group, queries) layout, so that no product reads a
                    # block transposed (XLA's CPU matmul is slow at that).
                    q_i, d_out_i = tf.gather(q_blocks, i), tf.gather(d_out_blocks, i)
                    rows_q, rows_d_out = M.to_rows(q_i), M.to_rows(d_out_i)
                    lse_t = M.keys_first(tf.gather(lse_blocks, i))  # (B, K, 1, G, C)
                    raw_t = matmul(k_j, rows_q, transpose_b=True)  # (B, K, C_k, G * C_q)
                    raw_t = M.scaled(raw_t, logit_scale)
                    shape_t = tf.concat([tf.shape(raw_t)[:3], [groups, c]], 0)
                    bias_t = None
                    if bias_grid is not None:
                        bias_t = M.keys_first(_block(bias_grid, bias_pattern, i, j))
                    scores_t = M.logits(tf.reshape(raw_t, shape_t), bias_t, cap)
                    ok_t = M.keys_first(allowed(i, j))
                    p_t = tf.where(ok_t, tf.exp(scores_t - lse_t), 0.0)  # (B, K, C_k, G, C_q)
                    applied_t = p_t
                    keep_t = None
                    if scale_keep is not None:
                        shape = tf.concat([shape_t[:2], [groups, c, c]], 0)
                        keep_t = M.keys_first(keep_block(i, j, shape))
                        applied_t = tf.where(keep_t, p_t * scale_keep, 0.0)
                    d_v_new = d_v + matmul(tf.reshape(applied_t, tf.shape(raw_t)), rows_d_out)
                    d_p_t = tf.reshape(matmul(v_j, rows_d_out, transpose_b=True), shape_t)
                    if keep_t is not None:
                        d_p_t = tf.where(keep_t, d_p_t * scale_keep, 0.0)
                    row_dot_t = M.keys_first(tf.gather(row_dot, i))
                    d_scores_t = p_t * (d_p_t - row_dot_t)
                    if cap is not None:
                        d_scores_t = d_scores_t * M.cap_derivative(scores_t, cap)
                    d_k_new = d_k + matmul(tf.reshape(d_scores_t, tf.shape(raw_t)), rows_q)
                    d_k_new.set_shape(d_k.shape)  # as they entered the loop (see the forward)
                    d_v_new.set_shape(d_v.shape)
                    return i + 1, d_k_new, d_v_new

                lo, hi = query_range(j)
                _, d_k, d_v = tf.while_loop(
                    lambda i, *_: i < hi,
                    query_block,
                    (lo, tf.zeros_like(k_j, dtype=compute), tf.zeros_like(v_j, dtype=compute)),
                )
                return j + 1, d_ks.write(j, M.scaled(d_k, logit_scale)), d_vs.write(j, d_v)

            array = lambda size: tf.TensorArray(compute, size=size)  # noqa: E731
            # Block counts from the shapes this function sees, not the forward's tensors:
            # under an outer XLA program a TensorArray's size must be a compile-time constant.
            num_q, num_k = tf.shape(d_out_blocks)[0], tf.shape(k_blocks)[0]
            # Without a bias, a scalar stands in for its gradient in the loop state.
            d_bias = tf.zeros(()) if bias_grid is None else tf.zeros_like(bias_grid)
            _, d_qs, d_bias = tf.while_loop(
                lambda i, *_: i < num_q, d_query_block, (tf.constant(0), array(num_q), d_bias)
            )
            _, d_ks, d_vs = tf.while_loop(
                lambda j, *_: j < num_k, d_key_block, (tf.constant(0), array(num_k), array(num_k))
            )
            grads = [
                tf.cast(d_qs.stack(), q_blocks.dtype),
                tf.cast(d_ks.stack(), k_blocks.dtype),
                tf.cast(d_vs.stack(), v_blocks.dtype),
            ]
            if bias_grid is not None:
                grads.append(d_bias)
            return grads

        return out_blocks, grad

    if bias is None:

        @tf.custom_gradient
        def attend_blocks(q_blocks, k_blocks, v_blocks):
            return forward(q_blocks, k_blocks, v_blocks, None)

        out_blocks = attend_blocks(q_blocks, k_blocks, v_blocks)
    else:

        @tf.custom_gradient
        def attend_blocks(q_blocks, k_blocks, v_blocks, bias_grid):
            return forward(q_blocks, k_blocks, v_blocks, bias_grid)

        bias_grid = _grid(bias, bias_pattern, num_q, num_k, c)
        out_blocks = attend_blocks(q_blocks, k_blocks, v_blocks, bias_grid)
    return _from_blocks(out_blocks, t)  # (B, K, G, T, Hv)


def key_block_range(i, num_k, chunk_size, is_causal, window):
    """Key blocks `[lo, hi)` that some query of query block `i` may see.

    Causal: keys `s <= t` end at block `i`. Window: keys with `|t - s| < W` for the
    block's queries `t` in `[i C, i C + C - 1]` lie in `[i C - W + 1, i C + C + W - 2]`.
    """
    c = chunk_size
    lo, hi = tf.constant(0), tf.convert_to_tensor(num_k)
    if is_causal:
        hi = tf.minimum(hi, i + 1)
    if window is not None:
        lo = tf.maximum(0, i * c - window + 1) // c
        hi = tf.minimum(hi, (i * c + c - 1 + window - 1) // c + 1)
    return lo, hi


def query_block_range(j, num_q, chunk_size, is_causal, window):
    """Query blocks `[lo, hi)` of which some query may see key block `j`."""
    c = chunk_size
    lo, hi = tf.constant(0), tf.convert_to_tensor(num_q)
    if is_causal:
        lo = tf.convert_to_tensor(j)
    if window is not None:
        lo = tf.maximum(lo, tf.maximum(0, j * c - window + 1) // c)
        hi = tf.minimum(hi, (j * c + c - 1 + window - 1) // c + 1)
    return lo, hi


def _to_blocks(x, num, chunk_size, axis):
    """Zero-pads `axis` of `x` to `num * chunk_size` and moves its blocks to a new axis 0.

    `(B, K, G, T, D)` with `axis=3` becomes `(num, B, K, G, C, D)`.
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
    """`(num, B, K, G, C, D)` back to `(B, K, G, length, D)`, dropping the padding."""
    x = tf.transpose(blocks, [1, 2, 3, 0, 4, 5])  # (B, K, G, num, C, D)
    shape = tf.shape(x)
    x = tf.reshape(x, tf.stack([shape[0], shape[1], shape[2], shape[3] * shape[4], shape[5]]))
    return x[:, :, :, :length]


def _grid(x, pattern, num_q, num_k, chunk_size):
    """A 5-D mask or bias `(…, T|1, S|1)` as blocks `(nq|1, nk|1, …, C|1, C|1)`.

    Padding is False for a mask and 0 for a bias; padded keys are masked anyway.
    """
    if pattern[3]:  # full along S: blocks of keys
        x = _to_blocks(x, num_k, chunk_size, axis=4)  # (nk, …, T|1, C)
    else:
        x = x[None]  # (1, …, T|1, 1)
    if pattern[2]:  # full along T: blocks of queries
        x = _to_blocks(x, num_q, chunk_size, axis=4)  # (nq, nk|1, …, C, C|1)
    else:
        x = x[None]
    return x  # (nq|1, nk|1, B|1, K|1, G|1, C|1, C|1)


def _block(grid, pattern, i, j):
    """Block (i, j) of a grid from `_grid`, `(B|1, K|1, G|1, C|1, C|1)`."""
    block = tf.gather(grid, i if pattern[2] else 0)
    return tf.gather(block, j if pattern[3] else 0)


def _add_block(d_grid, pattern, i, j, d_scores):
    """Adds the `(B, K, G, C, C)` logit gradient of block (i, j) into the bias grid."""
    d_scores = M.sum_over_broadcast(d_scores, pattern)
    index = tf.stack([i if pattern[2] else 0, j if pattern[3] else 0])[None]  # (1, 2)
    return tf.tensor_scatter_nd_add(d_grid, index, d_scores[None])
