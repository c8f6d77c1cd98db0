"""The chunked path: the online softmax in `(C, C)` blocks, never holding `(T, S)`.

Tensors are in the grouped layout of `keras_sdpa._core.layout`: `q (B, K, G, T, H)`,
`k (B, K, S, H)`, `v (B, K, S, Hv)`. A block of queries holds all `G` heads of a
group, so each block product reads its key block once, whatever the grouping.

Written once on `keras.ops`. The loops are `keras.ops.while_loop`s with traced bounds (a
`tf.while_loop` or a `jax.lax.while_loop`); what differs per backend is in
`keras_sdpa._backend` (`# ---- the chunked path's loops`): the per-block outputs (a
`TensorArray`, or a preallocated array updated in place), reading a block, adding one into
the bias's blocking, the per-block dropout seed, and a custom gradient whose forward reads the
masks, block kinds and mods' tensors without taking them as inputs.
"""

import typing

from keras import ops

from keras_sdpa import _backend
from keras_sdpa._core import layout, mod_calls, softmax
from keras_sdpa._core.blocks import (
    Blocking,
    add_block,
    block,
    from_blocks,
    grid_of,
    take,
    to_blocks,
)
from keras_sdpa._shared.types import Tensor


def attend(q, k, v, plan, tensors, count_visits=False):
    """softmax(logits) v in blocks of `C_q = plan.query_chunk_size` queries and
    `C_k = plan.chunk_size` keys.

    The online softmax of Rabe & Staats (2021, "Self-attention Does Not Need
    O(n^2) Memory") and FlashAttention (Dao et al., 2022): for each block of
    queries the blocks of keys arrive one at a time, and a running row maximum
    `m`, row sum `total` and output `acc` are rescaled by `exp(m_old - m_new)`
    as each arrives. The gradient recomputes every block from `q`, `k` and the
    saved log-sum-exp: one pass over key blocks for `dq`, `dk` and `dv`
    (FlashAttention-2's), or with a bias or a score_mod two (one over query
    blocks for `dq` and the bias's or mod's gradient, one over key blocks for
    `dk` and `dv`), so memory is `O(T + S)` plus a few `(C_q, C_k)` blocks per
    head, forward and backward.

    Blocks that no query of the block may see are skipped, forward and backward:
    above the diagonal with `is_causal`, and outside the band with a window, so
    a window of `W` costs `O(T * W)`, not `O(T * S)`.

    Dropout draws each block's keep-mask from a stateless stream (Philox on TensorFlow,
    ThreeFry on JAX) keyed by the seed folded in with the block's index, and the gradient
    draws the same mask again.

    The precision is the dense path's (`plan.operand`, `plan.logit_scale`): with bfloat16
    or float16 inputs the block products multiply in that precision and accumulate in
    float32, and the running maximum, sums, output and gradients are carried in float32.

    A `mask_mod` sorts the blocks (`tensors.block_kinds`, computed here unless given): a
    block that it empties for every example and head is never computed, forward or
    backward, and on a block that it fills the mod is not called. A `score_mod` changes
    each block's scaled logits; the gradient goes back through it in each block (a tape, or
    `jax.vjp`), summed densely into the gradients of `tensors.params` (its float tensors,
    and on JAX the values of the float variables the mods hold) and, on TensorFlow, of the
    variables it reads.

    Returns the output `(B, K, G, T, Hv)` and None (no weights), or with `count_visits`, as
    a `(2,)` int32 tensor, the number of blocks the forward pass computed and how many of
    them called the mask_mod (then without the custom gradient: the counters are for tests).
    """
    blocking = Blocking(q, k, plan, tensors)
    (cq, ck), num_q, num_k = blocking.sizes, blocking.num_q, blocking.num_k
    blocks = _Blocks(
        q=to_blocks(q, num_q, cq, axis=3),  # (nq, B, K, G, C_q, H)
        k=to_blocks(k, num_k, ck, axis=2),  # (nk, B, K, C_k, H)
        v=to_blocks(v, num_k, ck, axis=2),  # (nk, B, K, C_k, Hv)
    )
    if tensors.bias is not None:  # (nq|1, nk|1, B|1, K|1, G|1, C_q|1, C_k|1)
        bias = grid_of(tensors.bias, plan.bias_pattern, num_q, num_k, blocking.sizes)
        blocks = blocks._replace(bias=bias)
    if count_visits:  # the forward alone, with its counters (for tests)
        out_blocks, _, visits = _forward(blocking, blocks)
        return from_blocks(out_blocks, blocking.t), visits
    has_bias, params = blocks.bias is not None, tensors.params

    # The forward and its gradient read the masks, block kinds, seed and mods' tensors as
    # they are: only the inputs here get gradients.
    def attend_blocks(*inputs):
        forward = blocks._replace(
            q=inputs[0], k=inputs[1], v=inputs[2], bias=inputs[3] if has_bias else None
        )
        out_blocks, lse_blocks, _ = _forward(blocking, forward)

        def grad_fn(d_out_blocks, variables=None):
            saved = forward._replace(out=out_blocks, lse=lse_blocks, d_out=d_out_blocks)
            grads, d_variables = _grad(blocking, saved, params, variables or ())
            return (grads, d_variables) if variables else grads

        return out_blocks, grad_fn

    inputs = [blocks.q, blocks.k, blocks.v, *([blocks.bias] if has_bias else []), *params]
    out_blocks = _backend.get().custom_gradient(attend_blocks)(*inputs)
    return from_blocks(out_blocks, blocking.t), None  # (B, K, G, T, Hv)


def _penalized(scores, penalty):
    """`scores + penalty`, or `scores` where no key of the block is masked (None)."""
    return scores if penalty is None else scores + penalty


class _Blocks(typing.NamedTuple):
    """The operands in blocks (`(num, …)`), and in the gradient what the forward saved."""

    q: Tensor  # (nq, B, K, G, C_q, H)
    k: Tensor  # (nk, B, K, C_k, H)
    v: Tensor  # (nk, B, K, C_k, Hv)
    bias: Tensor | None = None  # a grid from `grid_of`
    out: Tensor | None = None  # (nq, B, K, G, C_q, Hv)
    lse: Tensor | None = None  # (nq, B, K, G, C_q, 1)
    d_out: Tensor | None = None  # (nq, B, K, G, C_q, Hv)
    row_dot: Tensor | None = None  # (nq, B, K, G, C_q, 1): rowsum(dO * O)


# ---- the forward: for each query block, the key blocks in an online softmax


def _forward(blocking, blocks):
    """The output blocks `(nq, B, K, G, C, Hv)`, their log-sum-exp `(nq, B, K, G, C, 1)` and
    the `(2,)` visit counters."""
    shim = _backend.get()
    out_shape = (*ops.shape(blocks.q)[1:-1], ops.shape(blocks.v)[-1])  # (B, K, G, C, Hv)
    _, outs, lses, visits = ops.while_loop(
        lambda i, *_: i < blocking.num_q,
        lambda i, outs, lses, visits: _forward_query_block(blocking, blocks, i, outs, lses, visits),
        (
            ops.convert_to_tensor(0, "int32"),
            shim.block_array(blocking.num_q, out_shape, blocking.plan.compute),
            shim.block_array(blocking.num_q, (*out_shape[:-1], 1), blocking.plan.compute),
            ops.zeros((2,), "int32"),
        ),
    )
    return shim.stack_blocks(outs), shim.stack_blocks(lses), visits


def _forward_query_block(blocking, blocks, i, outs, lses, visits):
    """Query block `i` over its key blocks; its normalized output and log-sum-exp written."""
    shim, compute = _backend.get(), blocking.plan.compute
    q_i = take(blocks.q, i)  # (B, K, G, C, H)
    row = ops.zeros_like(q_i[..., :1], dtype=compute)  # (B, K, G, C, 1)

    def key_block(j, *carried):
        def compute_block(with_mod):
            return _forward_key_block(blocking, blocks, i, j, q_i, *carried, with_mod)

        return (j + 1, *blocking.visit(i, j, carried, compute_block))

    lo, hi = blocking.key_range(i)
    acc = ops.zeros((*ops.shape(q_i)[:4], ops.shape(blocks.v)[-1]), compute)
    _, m, total, acc, visits = ops.while_loop(
        lambda j, *_: j < hi, key_block, (lo, row + softmax.MASKED_SCORE, row, acc, visits)
    )
    seen = m > 0.5 * softmax.MASK_PENALTY  # False on fully masked rows: zero output
    safe_total = ops.where(seen, total, 1.0)
    outs = shim.write_block(outs, i, acc * ops.where(seen, 1.0 / safe_total, 0.0))
    lses = shim.write_block(lses, i, ops.where(seen, m + ops.log(safe_total), 0.0))
    return i + 1, outs, lses, visits


def _forward_key_block(blocking, blocks, i, j, q_i, m, total, acc, visits, with_mod):
    """Key block `j` into the running maximum `m`, row sum `total` and output `acc`."""
    shim = _backend.get()
    # Masked keys get `MASK_PENALTY` added, the dense path's form: one add that XLA fuses
    # into the softmax's passes, where selecting before and after the exp made two more
    # passes over the block. A row with no allowed key yet takes weights among its masked
    # keys, which the first allowed key's correction `exp(m - m_new)` (exp(-1e30)) zeroes;
    # one that never sees one is zeroed at the end (its maximum stays near MASK_PENALTY).
    scores = blocking.logits(blocks, i, j, q_i)  # (B, K, G, C, C)
    scores = _penalized(scores, blocking.penalty(i, j, with_mod))
    m_new = ops.maximum(m, ops.max(scores, axis=-1, keepdims=True))
    p = ops.exp(scores - m_new)  # (B, K, G, C, C)
    correction = ops.exp(m - m_new)  # (B, K, G, C, 1)
    total_new = total * correction + ops.sum(p, axis=-1, keepdims=True)
    p = softmax.dropped(p, blocking.keep(i, j, ops.shape(p)), blocking.plan.dropout_rate)
    update = layout.from_rows(
        blocking.matmul(layout.to_rows(p), take(blocks.v, j)), blocking.groups
    )
    acc_new = acc * correction + update  # (B, K, G, C, Hv)
    # Broadcasting with a mask block can hide a size known before (K = 1): the
    # loop's carried shapes must stay as they entered.
    m_new = shim.with_static_shape(m_new, m.shape)
    total_new = shim.with_static_shape(total_new, total.shape)
    acc_new = shim.with_static_shape(acc_new, acc.shape)
    counted = ops.convert_to_tensor([1, int(with_mod)], "int32")
    return m_new, total_new, acc_new, visits + counted


# ---- the gradient: one pass over key blocks (dq, dk, dv); with a bias or a score_mod, one
# over query blocks (dq, the bias, the mod's tensors) and one over key blocks (dk, dv); each
# recomputing its blocks from the saved log-sum-exp


def _grad(blocking, blocks, params, variables):
    """The inputs' gradients (`dq`, `dk`, `dv` blocks, the bias blocking's, the params') and the
    variables'."""
    shim, compute = _backend.get(), blocking.plan.compute
    blocks = blocks._replace(row_dot=ops.sum(blocks.d_out * blocks.out, axis=-1, keepdims=True))
    # Block counts from the shapes this function sees, not the forward's tensors:
    # under an outer XLA program a TensorArray's size must be a compile-time constant
    # (and JAX sizes its arrays while tracing).
    num_q, num_k = ops.shape(blocks.d_out)[0], ops.shape(blocks.k)[0]
    if blocks.bias is None and blocking.tensors.score_mod is None:  # nothing but dq, dk, dv
        d_params = [ops.zeros_like(x) for x in params]
        d_vars = [ops.zeros(x.shape, x.dtype) for x in variables]
        return _grad_one_pass(blocking, blocks, num_k) + d_params, d_vars
    # Without a bias, a scalar stands in for its gradient in the loop state.
    d_bias = ops.zeros((), compute) if blocks.bias is None else ops.zeros_like(blocks.bias)
    variables = list(variables)
    _, d_qs, d_bias, d_params, d_vars = ops.while_loop(
        lambda i, *_: i < num_q,
        lambda i, *carried: _d_query_block(blocking, blocks, params, variables, i, *carried),
        (
            ops.convert_to_tensor(0, "int32"),
            shim.block_array(num_q, ops.shape(blocks.q)[1:], compute),
            d_bias,
            [ops.zeros_like(x) for x in params],
            [ops.zeros(x.shape, x.dtype) for x in variables],
        ),
    )
    _, d_ks, d_vs = ops.while_loop(
        lambda j, *_: j < num_k,
        lambda j, d_ks, d_vs: _d_key_block(blocking, blocks, j, d_ks, d_vs),
        (
            ops.convert_to_tensor(0, "int32"),
            shim.block_array(num_k, ops.shape(blocks.k)[1:], compute),
            shim.block_array(num_k, ops.shape(blocks.v)[1:], compute),
        ),
    )
    grads = [
        ops.cast(shim.stack_blocks(d_qs), blocks.q.dtype),
        ops.cast(shim.stack_blocks(d_ks), blocks.k.dtype),
        ops.cast(shim.stack_blocks(d_vs), blocks.v.dtype),
    ]
    if blocks.bias is not None:
        grads.append(d_bias)
    return grads + list(d_params), list(d_vars)


def _grad_one_pass(blocking, blocks, num_k):
    """`[dq, dk, dv]` in one pass over the key blocks (FlashAttention-2's backward): each
    block's weights and logit gradient are computed once, for `dk_j`, `dv_j` and, added into
    its row of a `(nq, 1, B, K, G, C, H)` array, `dq_i`. The two-pass form recomputes them
    for `dq`: 2 exponentials and 7 products a block against 1 and 5 here."""
    shim, compute = _backend.get(), blocking.plan.compute
    d_q = ops.zeros((ops.shape(blocks.q)[0], 1, *ops.shape(blocks.q)[1:]), compute)
    _, d_q, d_ks, d_vs = ops.while_loop(
        lambda j, *_: j < num_k,
        lambda j, d_q, d_ks, d_vs: _d_key_block(blocking, blocks, j, d_ks, d_vs, d_q),
        (
            ops.convert_to_tensor(0, "int32"),
            d_q,
            shim.block_array(num_k, ops.shape(blocks.k)[1:], compute),
            shim.block_array(num_k, ops.shape(blocks.v)[1:], compute),
        ),
    )
    return [
        ops.cast(layout.scaled(d_q[:, 0], blocking.plan.logit_scale), blocks.q.dtype),
        ops.cast(shim.stack_blocks(d_ks), blocks.k.dtype),
        ops.cast(shim.stack_blocks(d_vs), blocks.v.dtype),
    ]


def _d_query_block(blocking, blocks, params, variables, i, d_qs, d_bias, d_params, d_vars):
    """`dq_i = sum_j dS_ij k_j`, and block row i's share of the bias's and the mod's."""
    row_i = tuple(take(x, i) for x in (blocks.q, blocks.d_out, blocks.lse, blocks.row_dot))
    q_i = row_i[0]

    def key_block(j, *carried):
        def compute_block(with_mod):
            return _d_query_key_block(
                blocking, blocks, params, variables, i, j, row_i, *carried, with_mod
            )

        return (j + 1, *blocking.visit(i, j, carried, compute_block))

    lo, hi = blocking.key_range(i)
    _, d_q, d_bias, d_params, d_vars = ops.while_loop(
        lambda j, *_: j < hi,
        key_block,
        (lo, ops.zeros_like(q_i, dtype=blocking.plan.compute), d_bias, d_params, d_vars),
    )
    d_qs = _backend.get().write_block(d_qs, i, layout.scaled(d_q, blocking.plan.logit_scale))
    return i + 1, d_qs, d_bias, d_params, d_vars


def _d_query_key_block(
    blocking, blocks, params, variables, i, j, row_i, d_q, d_bias, d_params, d_vars, with_mod
):
    """Block (i, j)'s share of `dq_i`, of the bias's gradient and of the mod's. `row_i` is
    query block i's `q`, `dO`, log-sum-exp and `rowsum(dO * O)`, taken once per row."""
    plan = blocking.plan
    q_i, d_out_i, lse_i, row_dot_i = row_i
    raw = blocking.raw_logits(blocks, j, q_i)
    scores = blocking.logits(blocks, i, j, q_i, raw)
    p = ops.exp(_penalized(scores, blocking.penalty(i, j, with_mod)) - lse_i)  # masked: 0
    d_p = layout.from_rows(
        blocking.matmul(layout.to_rows(d_out_i), take(blocks.v, j), transpose_b=True),
        blocking.groups,
    )
    d_p = softmax.dropped(d_p, blocking.keep(i, j, ops.shape(p)), plan.dropout_rate)
    d_scores = softmax.d_logits(p, d_p, row_dot_i, scores, plan.cap)  # (B, K, G, C, C)
    d_raw, new_params, new_vars = d_scores, d_params, d_vars
    if blocking.tensors.score_mod is not None:
        d_raw, g_params, g_vars = mod_calls.mod_vjp(
            blocking.tensors.score_mod,
            raw,
            blocking.b_index,
            plan.num_heads,
            *blocking.positions(i, j),
            d_scores,
            params,
            variables,
        )
        new_params = [a + b for a, b in zip(d_params, g_params)]
        new_vars = [a + ops.convert_to_tensor(b) for a, b in zip(d_vars, g_vars)]
    d_q_block = blocking.matmul(layout.to_rows(d_raw), take(blocks.k, j))
    d_q_new = d_q + layout.from_rows(d_q_block, blocking.groups)
    # As it entered the loop (see the forward).
    d_q_new = _backend.get().with_static_shape(d_q_new, d_q.shape)
    new_bias = d_bias
    if blocks.bias is not None:
        new_bias = add_block(d_bias, plan.bias_pattern, i, j, d_scores)
    return d_q_new, new_bias, new_params, new_vars


def _d_key_block(blocking, blocks, j, d_ks, d_vs, d_q=None):
    """`dk_j = sum_i dS_ij^T q_i` and `dv_j = sum_i P_ij^T dO_i`; with `d_q` (the one-pass
    form's `(nq, 1, …)` array), `dS_ij k_j` added into its row `i` too."""
    shim, compute = _backend.get(), blocking.plan.compute
    k_j, v_j = take(blocks.k, j), take(blocks.v, j)
    share = _modded_block if blocking.tensors.score_mod is not None else _transposed_block

    def query_block(i, *carried):
        def compute_block(with_mod):
            return share(blocking, blocks, i, j, k_j, v_j, *carried, with_mod)

        return (i + 1, *blocking.visit(i, j, carried, compute_block))

    lo, hi = blocking.query_range(j)
    zeros = (ops.zeros_like(k_j, dtype=compute), ops.zeros_like(v_j, dtype=compute))
    _, d_k, d_v, *d_q = ops.while_loop(
        lambda i, *_: i < hi, query_block, (lo, *zeros, *([] if d_q is None else [d_q]))
    )
    d_ks = shim.write_block(d_ks, j, layout.scaled(d_k, blocking.plan.logit_scale))
    return j + 1, *d_q, d_ks, shim.write_block(d_vs, j, d_v)


def _transposed_block(blocking, blocks, i, j, k_j, v_j, d_k, d_v, *d_q_and_mod):
    """Block (i, j)'s share of `dk_j` and `dv_j`, in the (keys, group, queries) layout, so
    that no product reads a block transposed (XLA's CPU matmul is slow at that); and with the
    one-pass form's `d_q` (before `with_mod`), of `dq_i`, the one product that does."""
    *d_q, with_mod = d_q_and_mod
    plan, (cq, ck), shim = blocking.plan, blocking.sizes, _backend.get()
    q_i, d_out_i = take(blocks.q, i), take(blocks.d_out, i)
    rows_q, rows_d_out = layout.to_rows(q_i), layout.to_rows(d_out_i)
    lse_t = layout.keys_first(take(blocks.lse, i))  # (B, K, 1, G, C)
    raw_t = blocking.matmul(k_j, rows_q, transpose_b=True)  # (B, K, C_k, G * C_q)
    raw_t = layout.scaled(raw_t, plan.logit_scale)
    shape_t = (*ops.shape(raw_t)[:3], blocking.groups, cq)
    bias_t = None
    if blocks.bias is not None:
        bias_t = layout.keys_first(block(blocks.bias, plan.bias_pattern, i, j))
    scores_t = softmax.logits(ops.reshape(raw_t, shape_t), bias_t, plan.cap)
    penalty_t = layout.keys_first(blocking.penalty(i, j, with_mod))
    p_t = ops.exp(_penalized(scores_t, penalty_t) - lse_t)  # (B, K, C_k, G, C_q); masked: 0
    keep_t = layout.keys_first(blocking.keep(i, j, (*shape_t[:2], blocking.groups, cq, ck)))
    applied_t = softmax.dropped(p_t, keep_t, plan.dropout_rate)
    d_v_new = d_v + blocking.matmul(ops.reshape(applied_t, ops.shape(raw_t)), rows_d_out)
    d_p_t = ops.reshape(blocking.matmul(v_j, rows_d_out, transpose_b=True), shape_t)
    d_p_t = softmax.dropped(d_p_t, keep_t, plan.dropout_rate)
    row_dot_t = layout.keys_first(take(blocks.row_dot, i))
    d_scores_t = softmax.d_logits(p_t, d_p_t, row_dot_t, scores_t, plan.cap)
    d_scores_t = ops.reshape(d_scores_t, ops.shape(raw_t))  # (B, K, C_k, G * C_q)
    d_k_new = d_k + blocking.matmul(d_scores_t, rows_q)
    # as they entered the loop (see the forward)
    news = [shim.with_static_shape(d_k_new, d_k.shape), shim.with_static_shape(d_v_new, d_v.shape)]
    if d_q:  # dq_i += dS_ij k_j
        d_q_i = layout.from_rows(
            blocking.matmul(d_scores_t, k_j, transpose_a=True), blocking.groups
        )
        news.append(shim.add_to_block(d_q[0], i, 0, d_q_i))
    return tuple(news)


def _modded_block(blocking, blocks, i, j, k_j, v_j, d_k, d_v, with_mod):
    """Block (i, j)'s share of `dk_j` and `dv_j` with a score_mod, whose positions are laid
    out as the logits (B, N, t, s): the queries' layout, and products that read the block
    transposed."""
    plan, shim = blocking.plan, _backend.get()
    q_i, d_out_i = take(blocks.q, i), take(blocks.d_out, i)
    lse_i, row_dot_i = take(blocks.lse, i), take(blocks.row_dot, i)
    rows_q, rows_d_out = layout.to_rows(q_i), layout.to_rows(d_out_i)
    raw = blocking.raw_logits(blocks, j, q_i)
    scores = blocking.logits(blocks, i, j, q_i, raw)
    p = ops.exp(_penalized(scores, blocking.penalty(i, j, with_mod)) - lse_i)  # masked: 0
    keep = blocking.keep(i, j, ops.shape(p))
    applied = softmax.dropped(p, keep, plan.dropout_rate)
    d_p = layout.from_rows(blocking.matmul(rows_d_out, v_j, transpose_b=True), blocking.groups)
    d_p = softmax.dropped(d_p, keep, plan.dropout_rate)
    d_scores = softmax.d_logits(p, d_p, row_dot_i, scores, plan.cap)
    d_raw, _, _ = mod_calls.mod_vjp(
        blocking.tensors.score_mod,
        raw,
        blocking.b_index,
        plan.num_heads,
        *blocking.positions(i, j),
        d_scores,
        (),
        (),
    )
    d_v_new = d_v + blocking.matmul(layout.to_rows(applied), rows_d_out, transpose_a=True)
    d_k_new = d_k + blocking.matmul(layout.to_rows(d_raw), rows_q, transpose_a=True)
    return shim.with_static_shape(d_k_new, d_k.shape), shim.with_static_shape(d_v_new, d_v.shape)
