"""The chunked path: the online softmax in `(C, C)` blocks, never holding `(T, S)`.

Tensors are in the grouped layout of `keras_sdpa._masking`: `q (B, K, G, T, H)`,
`k (B, K, S, H)`, `v (B, K, S, Hv)`. A block of queries holds all `G` heads of a
group, so each block product reads its key block once, whatever the grouping.

Written once on `keras.ops`. The loops are `keras.ops.while_loop`s with traced bounds (a
`tf.while_loop` or a `jax.lax.while_loop`); what differs per backend is in
`keras_sdpa._backend` (`# ---- the chunked path's loops`): the per-block outputs (a
`TensorArray`, or a preallocated array updated in place), reading a block, adding one into
the bias's grid, the per-block dropout seed, and a custom gradient whose forward reads the
masks, block kinds and mods' tensors without taking them as inputs.
"""

import keras
from keras import ops

from keras_sdpa import _backend
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
    score_mod=None,
    mask_mod=None,
    num_heads=None,
    params=(),
    block_kinds=None,
    count_visits=False,
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

    Dropout draws each block's keep-mask from a stateless stream (Philox on TensorFlow,
    ThreeFry on JAX) keyed by the seed folded in with the block's index, and the gradient
    draws the same mask again.

    `operand` and `logit_scale` are as in `keras_sdpa._dense.attend`: with bfloat16 or
    float16 inputs the block products multiply in that precision and accumulate in float32,
    and the running maximum, sums, output and gradients are carried in float32.

    A `mask_mod` sorts the blocks (`block_kinds`, computed here unless given): a block that
    it empties for every example and head is never computed, forward or backward, and on a
    block that it fills the mod is not called. A `score_mod` changes each block's scaled
    logits; the gradient goes back through it in each block (a tape, or `jax.vjp`), summed
    densely into the gradients of `params` (its float tensors, and on JAX the values of the
    float variables the mods hold) and, on TensorFlow, of the variables it reads.

    Returns the output `(B, K, G, T, Hv)`, and with `count_visits` also, as a `(2,)` int32
    tensor, the number of blocks the forward pass computed and how many of them called
    `mask_mod` (then without the custom gradient: the counters are for tests).
    """
    shim = _backend.get()
    groups = q.shape[2]
    compute = keras.backend.standardize_dtype(q.dtype) if operand is None else "float32"
    c = chunk_size
    t, s = ops.shape(q)[3], ops.shape(k)[2]
    num_q = (t + c - 1) // c
    num_k = (s + c - 1) // c
    q_blocks = _to_blocks(q, num_q, c, axis=3)  # (nq, B, K, G, C, H)
    k_blocks = _to_blocks(k, num_k, c, axis=2)  # (nk, B, K, C, H)
    v_blocks = _to_blocks(v, num_k, c, axis=2)  # (nk, B, K, C, Hv)
    mask_grid = None if mask is None else _grid(mask, mask_pattern, num_q, num_k, c)
    offsets = ops.arange(c, dtype="int32")
    scale_keep = 1.0 / (1.0 - dropout_rate) if dropout_rate > 0.0 else None
    b_index, num_kv_heads = M.batch_index(ops.shape(q)[0]), q.shape[1]

    def positions(i, j):
        """The block's absolute positions, the padding clamped to the last one."""
        return ops.minimum(i * c + offsets, t - 1), ops.minimum(j * c + offsets, s - 1)

    def allowed(i, j, with_mod=True):
        """The "may attend" block of query block i and key block j, 5-D, broadcastable."""
        keys = j * c + offsets  # (C,)
        result = (keys < s)[None, :]  # (1, C): padded keys never
        result = M.combine(result, M.band(i * c + offsets, keys, is_causal, window))  # (C|1, C)
        result = result[None, None, None]
        if mask_grid is not None:
            result = ops.logical_and(result, _block(mask_grid, mask_pattern, i, j))
        if mask_mod is not None and with_mod:
            mod = M.mod_mask(mask_mod, b_index, num_heads, num_kv_heads, *positions(i, j))
            result = ops.logical_and(result, mod)
        return result

    if mask_mod is not None and block_kinds is None:
        block_kinds = kinds_of_blocks(mask_mod, b_index, num_heads, num_kv_heads, t, s, c)

    def visit(i, j, carried, compute):
        """`compute(with_mod)` on block (i, j), or `carried` where the mask_mod empties it."""
        if block_kinds is None:
            return compute(True)
        kind = block_kinds[i, j]
        return ops.cond(
            ops.equal(kind, EMPTY),
            lambda: carried,
            lambda: ops.cond(ops.equal(kind, FULL), lambda: compute(False), lambda: compute(True)),
        )

    def keep_block(i, j, shape):
        """Block (i, j) of the dropout keep-mask, the same in the forward and the gradient."""
        block_seed = shim.fold_in(seed, i * num_k + j)
        return shim.uniform(shape, block_seed, "float32") >= dropout_rate

    spans = None if block_kinds is None else nonempty_spans(block_kinds)

    def key_range(i):
        lo, hi = key_block_range(i, num_k, c, is_causal, window)
        if spans is not None:  # and within the row's first and last non-empty block
            lo, hi = ops.maximum(lo, spans[0][i]), ops.minimum(hi, spans[1][i])
        return lo, hi

    def query_range(j):
        lo, hi = query_block_range(j, num_q, c, is_causal, window)
        if spans is not None:
            lo, hi = ops.maximum(lo, spans[2][j]), ops.minimum(hi, spans[3][j])
        return lo, hi

    def matmul(a, b, transpose_b=False, transpose_a=False):
        return M.matmul(a, b, operand, transpose_b, transpose_a)

    def forward(q_blocks, k_blocks, v_blocks, bias_grid):
        def raw_logits(j, q_i):
            raw = matmul(M.to_rows(q_i), _take(k_blocks, j), transpose_b=True)
            return M.scaled(M.from_rows(raw, groups), logit_scale)  # (B, K, G, C, C)

        def modded(i, j, raw):
            if score_mod is None:
                return raw
            return M.apply_score_mod(score_mod, raw, b_index, num_heads, *positions(i, j))

        def block_logits(i, j, q_i, raw=None):
            bias_ij = None if bias_grid is None else _block(bias_grid, bias_pattern, i, j)
            raw = raw_logits(j, q_i) if raw is None else raw
            return M.logits(modded(i, j, raw), bias_ij, cap)  # (B, K, G, C, C)

        def query_block(i, outs, lses, visits):
            q_i = _take(q_blocks, i)  # (B, K, G, C, H)
            row = ops.zeros_like(q_i[..., :1], dtype=compute)  # (B, K, G, C, 1)

            def key_block(j, m, total, acc, visits):
                def compute(with_mod):
                    scores = block_logits(i, j, q_i)  # (B, K, G, C, C)
                    ok = allowed(i, j, with_mod)
                    scores = ops.where(ok, scores, M.MASKED_SCORE)
                    m_new = ops.maximum(m, ops.max(scores, axis=-1, keepdims=True))
                    p = ops.where(ok, ops.exp(scores - m_new), 0.0)  # (B, K, G, C, C)
                    correction = ops.exp(m - m_new)  # (B, K, G, C, 1)
                    total_new = total * correction + ops.sum(p, axis=-1, keepdims=True)
                    if scale_keep is not None:
                        p = ops.where(keep_block(i, j, ops.shape(p)), p * scale_keep, 0.0)
                    update = M.from_rows(matmul(M.to_rows(p), _take(v_blocks, j)), groups)
                    acc_new = acc * correction + update  # (B, K, G, C, Hv)
                    # Broadcasting with a mask block can hide a size known before (K = 1): the
                    # loop's carried shapes must stay as they entered.
                    m_new = shim.with_static_shape(m_new, m.shape)
                    total_new = shim.with_static_shape(total_new, total.shape)
                    acc_new = shim.with_static_shape(acc_new, acc.shape)
                    counted = ops.convert_to_tensor([1, int(with_mod)], "int32")
                    return m_new, total_new, acc_new, visits + counted

                return (j + 1, *visit(i, j, (m, total, acc, visits), compute))

            lo, hi = key_range(i)
            acc = ops.zeros((*ops.shape(q_i)[:4], ops.shape(v_blocks)[-1]), compute)
            _, m, total, acc, visits = ops.while_loop(
                lambda j, *_: j < hi,
                key_block,
                (lo, row + M.MASKED_SCORE, row, acc, visits),
            )
            seen = total > 0.0  # False on fully masked rows: zero output
            safe_total = ops.where(seen, total, 1.0)
            outs = shim.write_block(outs, i, acc * ops.where(seen, 1.0 / safe_total, 0.0))
            lses = shim.write_block(lses, i, ops.where(seen, m + ops.log(safe_total), 0.0))
            return i + 1, outs, lses, visits

        out_shape = (*ops.shape(q_blocks)[1:-1], ops.shape(v_blocks)[-1])  # (B, K, G, C, Hv)
        _, outs, lses, visits = ops.while_loop(
            lambda i, *_: i < num_q,
            query_block,
            (
                ops.convert_to_tensor(0, "int32"),
                shim.block_array(num_q, out_shape, compute),
                shim.block_array(num_q, (*out_shape[:-1], 1), compute),
                ops.zeros((2,), "int32"),
            ),
        )
        out_blocks = shim.stack_blocks(outs)  # (nq, B, K, G, C, Hv)
        lse_blocks = shim.stack_blocks(lses)  # (nq, B, K, G, C, 1)

        def grad(d_out_blocks, variables=()):
            row_dot = ops.sum(d_out_blocks * out_blocks, axis=-1, keepdims=True)
            variables = list(variables)

            def d_query_block(i, d_qs, d_bias, d_params, d_vars):  # dq_i = sum_j dS_ij k_j
                q_i, d_out_i, lse_i, row_dot_i = (
                    _take(x, i) for x in (q_blocks, d_out_blocks, lse_blocks, row_dot)
                )

                def key_block(j, d_q, d_bias, d_params, d_vars):
                    def compute(with_mod):
                        raw = raw_logits(j, q_i)
                        scores = block_logits(i, j, q_i, raw)
                        p = ops.where(allowed(i, j, with_mod), ops.exp(scores - lse_i), 0.0)
                        d_p = M.from_rows(
                            matmul(M.to_rows(d_out_i), _take(v_blocks, j), transpose_b=True),
                            groups,
                        )
                        if scale_keep is not None:
                            d_p = ops.where(keep_block(i, j, ops.shape(p)), d_p * scale_keep, 0.0)
                        d_scores = p * (d_p - row_dot_i)  # (B, K, G, C, C)
                        if cap is not None:
                            d_scores = d_scores * M.cap_derivative(scores, cap)
                        d_raw, new_params, new_vars = d_scores, d_params, d_vars
                        if score_mod is not None:
                            d_raw, g_params, g_vars = M.mod_vjp(
                                score_mod, raw, b_index, num_heads, *positions(i, j), d_scores,
                                params, variables,
                            )  # fmt: skip
                            new_params = [a + b for a, b in zip(d_params, g_params)]
                            new_vars = [
                                a + ops.convert_to_tensor(b) for a, b in zip(d_vars, g_vars)
                            ]
                        d_q_new = d_q + M.from_rows(
                            matmul(M.to_rows(d_raw), _take(k_blocks, j)), groups
                        )
                        # As it entered the loop (see the forward).
                        d_q_new = shim.with_static_shape(d_q_new, d_q.shape)
                        new_bias = d_bias
                        if bias_grid is not None:
                            new_bias = _add_block(d_bias, bias_pattern, i, j, d_scores)
                        return d_q_new, new_bias, new_params, new_vars

                    carried = (d_q, d_bias, d_params, d_vars)
                    return (j + 1, *visit(i, j, carried, compute))

                lo, hi = key_range(i)
                _, d_q, d_bias, d_params, d_vars = ops.while_loop(
                    lambda j, *_: j < hi,
                    key_block,
                    (lo, ops.zeros_like(q_i, dtype=compute), d_bias, d_params, d_vars),
                )
                d_qs = shim.write_block(d_qs, i, M.scaled(d_q, logit_scale))
                return i + 1, d_qs, d_bias, d_params, d_vars

            def d_key_block(j, d_ks, d_vs):  # dk_j = sum_i dS_ij^T q_i, dv_j = sum_i P_ij^T dO_i
                k_j, v_j = _take(k_blocks, j), _take(v_blocks, j)

                def query_block(i, d_k, d_v):
                    def compute(with_mod):
                        if score_mod is None:
                            return transposed_block(i, j, k_j, v_j, d_k, d_v, with_mod)
                        return modded_block(i, j, k_j, v_j, d_k, d_v, with_mod)

                    return (i + 1, *visit(i, j, (d_k, d_v), compute))

                lo, hi = query_range(j)
                _, d_k, d_v = ops.while_loop(
                    lambda i, *_: i < hi,
                    query_block,
                    (lo, ops.zeros_like(k_j, dtype=compute), ops.zeros_like(v_j, dtype=compute)),
                )
                d_ks = shim.write_block(d_ks, j, M.scaled(d_k, logit_scale))
                return j + 1, d_ks, shim.write_block(d_vs, j, d_v)

            def transposed_block(i, j, k_j, v_j, d_k, d_v, with_mod):
                # In the (keys, group, queries) layout, so that no product reads a
                # block transposed (XLA's CPU matmul is slow at that).
                q_i, d_out_i = _take(q_blocks, i), _take(d_out_blocks, i)
                rows_q, rows_d_out = M.to_rows(q_i), M.to_rows(d_out_i)
                lse_t = M.keys_first(_take(lse_blocks, i))  # (B, K, 1, G, C)
                raw_t = matmul(k_j, rows_q, transpose_b=True)  # (B, K, C_k, G * C_q)
                raw_t = M.scaled(raw_t, logit_scale)
                shape_t = (*ops.shape(raw_t)[:3], groups, c)
                bias_t = None
                if bias_grid is not None:
                    bias_t = M.keys_first(_block(bias_grid, bias_pattern, i, j))
                scores_t = M.logits(ops.reshape(raw_t, shape_t), bias_t, cap)
                ok_t = M.keys_first(allowed(i, j, with_mod))
                p_t = ops.where(ok_t, ops.exp(scores_t - lse_t), 0.0)  # (B, K, C_k, G, C_q)
                applied_t = p_t
                keep_t = None
                if scale_keep is not None:
                    keep_t = M.keys_first(keep_block(i, j, (*shape_t[:2], groups, c, c)))
                    applied_t = ops.where(keep_t, p_t * scale_keep, 0.0)
                d_v_new = d_v + matmul(ops.reshape(applied_t, ops.shape(raw_t)), rows_d_out)
                d_p_t = ops.reshape(matmul(v_j, rows_d_out, transpose_b=True), shape_t)
                if keep_t is not None:
                    d_p_t = ops.where(keep_t, d_p_t * scale_keep, 0.0)
                row_dot_t = M.keys_first(_take(row_dot, i))
                d_scores_t = p_t * (d_p_t - row_dot_t)
                if cap is not None:
                    d_scores_t = d_scores_t * M.cap_derivative(scores_t, cap)
                d_k_new = d_k + matmul(ops.reshape(d_scores_t, ops.shape(raw_t)), rows_q)
                # as they entered the loop (see the forward)
                d_k_new = shim.with_static_shape(d_k_new, d_k.shape)
                d_v_new = shim.with_static_shape(d_v_new, d_v.shape)
                return d_k_new, d_v_new

            def modded_block(i, j, k_j, v_j, d_k, d_v, with_mod):
                # With a score_mod, whose positions are laid out as the logits (B, N, t, s):
                # the queries' layout, and products that read the block transposed.
                q_i, d_out_i = _take(q_blocks, i), _take(d_out_blocks, i)
                lse_i, row_dot_i = _take(lse_blocks, i), _take(row_dot, i)
                rows_q, rows_d_out = M.to_rows(q_i), M.to_rows(d_out_i)
                raw = raw_logits(j, q_i)
                scores = block_logits(i, j, q_i, raw)
                p = ops.where(allowed(i, j, with_mod), ops.exp(scores - lse_i), 0.0)
                applied, keep = p, None
                if scale_keep is not None:
                    keep = keep_block(i, j, ops.shape(p))
                    applied = ops.where(keep, p * scale_keep, 0.0)
                d_p = M.from_rows(matmul(rows_d_out, v_j, transpose_b=True), groups)
                if keep is not None:
                    d_p = ops.where(keep, d_p * scale_keep, 0.0)
                d_scores = p * (d_p - row_dot_i)
                if cap is not None:
                    d_scores = d_scores * M.cap_derivative(scores, cap)
                d_raw, _, _ = M.mod_vjp(
                    score_mod, raw, b_index, num_heads, *positions(i, j), d_scores, (), ()
                )
                d_v_new = d_v + matmul(M.to_rows(applied), rows_d_out, transpose_a=True)
                d_k_new = d_k + matmul(M.to_rows(d_raw), rows_q, transpose_a=True)
                d_k_new = shim.with_static_shape(d_k_new, d_k.shape)
                d_v_new = shim.with_static_shape(d_v_new, d_v.shape)
                return d_k_new, d_v_new

            # Block counts from the shapes this function sees, not the forward's tensors:
            # under an outer XLA program a TensorArray's size must be a compile-time constant
            # (and JAX sizes its arrays while tracing).
            num_q, num_k = ops.shape(d_out_blocks)[0], ops.shape(k_blocks)[0]
            # Without a bias, a scalar stands in for its gradient in the loop state.
            d_bias = ops.zeros((), compute) if bias_grid is None else ops.zeros_like(bias_grid)
            d_params = [ops.zeros_like(x) for x in params]
            d_vars = [ops.zeros(x.shape, x.dtype) for x in variables]
            _, d_qs, d_bias, d_params, d_vars = ops.while_loop(
                lambda i, *_: i < num_q,
                d_query_block,
                (
                    ops.convert_to_tensor(0, "int32"),
                    shim.block_array(num_q, ops.shape(q_blocks)[1:], compute),
                    d_bias,
                    d_params,
                    d_vars,
                ),
            )
            _, d_ks, d_vs = ops.while_loop(
                lambda j, *_: j < num_k,
                d_key_block,
                (
                    ops.convert_to_tensor(0, "int32"),
                    shim.block_array(num_k, ops.shape(k_blocks)[1:], compute),
                    shim.block_array(num_k, ops.shape(v_blocks)[1:], compute),
                ),
            )
            grads = [
                ops.cast(shim.stack_blocks(d_qs), q_blocks.dtype),
                ops.cast(shim.stack_blocks(d_ks), k_blocks.dtype),
                ops.cast(shim.stack_blocks(d_vs), v_blocks.dtype),
            ]
            if bias_grid is not None:
                grads.append(d_bias)
            grads += list(d_params)
            return grads, list(d_vars)

        return out_blocks, visits, grad

    has_bias = bias is not None
    inputs = [q_blocks, k_blocks, v_blocks]
    if has_bias:
        inputs.append(_grid(bias, bias_pattern, num_q, num_k, c))
    if count_visits:  # the forward alone, with its counters (for tests)
        out_blocks, visits, _ = forward(*inputs[:3], inputs[3] if has_bias else None)
        return _from_blocks(out_blocks, t), visits

    # The forward and its gradient read the masks, block kinds, seed and mods' tensors as
    # they are: only the inputs here get gradients.
    @shim.custom_gradient
    def attend_blocks(*inputs):
        q_blocks, k_blocks, v_blocks = inputs[:3]
        bias_grid = inputs[3] if has_bias else None
        out_blocks, _, grad = forward(q_blocks, k_blocks, v_blocks, bias_grid)

        def grad_fn(d_out_blocks, variables=None):
            grads, d_variables = grad(d_out_blocks, variables or ())
            return (grads, d_variables) if variables else grads

        return out_blocks, grad_fn

    out_blocks = attend_blocks(*inputs, *params)
    return _from_blocks(out_blocks, t)  # (B, K, G, T, Hv)


# A block's kind under a mask_mod: no allowed key, some, or every key allowed.
EMPTY, PARTIAL, FULL = 0, 1, 2


def kinds_of_blocks(mask_mod, b_index, num_heads, num_kv_heads, t, s, chunk_size):
    """`(ceil(T / C), ceil(S / C))` int32: each block's kind (`EMPTY`, `PARTIAL`, `FULL`).

    A block is `EMPTY` when `mask_mod` allows no key of it for any example, head and (real)
    query, `FULL` when it allows every key for all of them and no key is padding, and
    `PARTIAL` otherwise. Computed one `(B|1, N|1, C, C)` block at a time, inside the
    compiled program, for the actual lengths: nothing of size `T x S` is formed.
    """
    shim = _backend.get()
    c = chunk_size
    num_q, num_k = (t + c - 1) // c, (s + c - 1) // c
    offsets = ops.arange(c, dtype="int32")

    def kind(n, kinds):
        i, j = n // num_k, n % num_k
        queries, keys = i * c + offsets, j * c + offsets
        real_q, real_k = (queries < t)[:, None], (keys < s)[None, :]  # (C, 1), (1, C)
        allowed = M.mod_mask(
            mask_mod, b_index, num_heads, num_kv_heads,
            ops.minimum(queries, t - 1), ops.minimum(keys, s - 1),
        )  # fmt: skip
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


def key_block_range(i, num_k, chunk_size, is_causal, window):
    """Key blocks `[lo, hi)` that some query of query block `i` may see.

    Causal: keys `s <= t` end at block `i`. Window: keys with `|t - s| < W` for the
    block's queries `t` in `[i C, i C + C - 1]` lie in `[i C - W + 1, i C + C + W - 2]`.
    """
    c = chunk_size
    lo, hi = ops.convert_to_tensor(0, "int32"), ops.convert_to_tensor(num_k, "int32")
    if is_causal:
        hi = ops.minimum(hi, i + 1)
    if window is not None:
        lo = ops.maximum(0, i * c - window + 1) // c
        hi = ops.minimum(hi, (i * c + c - 1 + window - 1) // c + 1)
    return lo, hi


def query_block_range(j, num_q, chunk_size, is_causal, window):
    """Query blocks `[lo, hi)` of which some query may see key block `j`."""
    c = chunk_size
    lo, hi = ops.convert_to_tensor(0, "int32"), ops.convert_to_tensor(num_q, "int32")
    if is_causal:
        lo = ops.convert_to_tensor(j, "int32")
    if window is not None:
        lo = ops.maximum(lo, ops.maximum(0, j * c - window + 1) // c)
        hi = ops.minimum(hi, (j * c + c - 1 + window - 1) // c + 1)
    return lo, hi


def _to_blocks(x, num, chunk_size, axis):
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


def _from_blocks(blocks, length):
    """`(num, B, K, G, C, D)` back to `(B, K, G, length, D)`, dropping the padding."""
    x = ops.transpose(blocks, (1, 2, 3, 0, 4, 5))  # (B, K, G, num, C, D)
    shape = ops.shape(x)
    x = ops.reshape(x, (shape[0], shape[1], shape[2], shape[3] * shape[4], shape[5]))
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


def _take(blocks, i):
    """Block `i` of `blocks`, `(num, …)`."""
    return _backend.get().read_block(blocks, i)


def _block(grid, pattern, i, j):
    """Block (i, j) of a grid from `_grid`, `(B|1, K|1, G|1, C|1, C|1)`."""
    block = _take(grid, i if pattern[2] else 0)
    return _take(block, j if pattern[3] else 0)


def _add_block(d_grid, pattern, i, j, d_scores):
    """Adds the `(B, K, G, C, C)` logit gradient of block (i, j) into the bias grid."""
    d_scores = M.sum_over_broadcast(d_scores, pattern)
    i, j = (i if pattern[2] else 0), (j if pattern[3] else 0)
    return _backend.get().add_to_block(d_grid, i, j, d_scores)
