"""The dense path: the whole `(T, S)` logits at once, with a hand-written gradient.

Tensors are in the grouped layout of `keras_sdpa._masking`: `q (B, K, G, T, H)`,
`k (B, K, S, H)`, `v (B, K, S, Hv)`.
"""

import keras
from keras import ops

from keras_sdpa import _backend
from keras_sdpa import _masking as M


def softmax_parts(scores, penalty, any_allowed):
    """The stable softmax of the logits, left unnormalized.

    `penalty` is the mask in additive form, 0 where allowed and `MASK_PENALTY`
    where masked (or None), and `any_allowed` says which rows keep a key (or
    None). Returns `exp`, `(…, T, S)`, with `exp(scores - row_max)` where allowed
    and 0 where masked, its reciprocal row sum `inv_total`, `(…, T, 1)`, and the
    row log-sum-exp `lse`, so that `weights = exp * inv_total = exp(scores - lse)`.
    A fully masked row has `inv_total == 0`: its weights and its output are zero,
    and its `lse` is `-MASK_PENALTY`, so that `exp(scores - lse)` is 0 there too.
    """
    if penalty is not None:
        scores = scores + penalty  # masked logits underflow to exp == 0
    row_max = ops.max(scores, axis=-1, keepdims=True)  # (…, T, 1)
    exp = ops.exp(scores - row_max)  # (…, T, S)
    total = ops.sum(exp, axis=-1, keepdims=True)  # (…, T, 1)
    total = ops.where(total > 0.0, total, 1.0)  # no keys at all (S = 0): 0 / 1 = 0
    lse = row_max + ops.log(total)
    inv_total = 1.0 / total
    if any_allowed is not None:
        inv_total = ops.where(any_allowed, inv_total, 0.0)
        lse = ops.where(any_allowed, lse, -M.MASK_PENALTY)
    return exp, inv_total, lse


def attend(
    q,
    k,
    v,
    mask,
    bias,
    keep,
    dropout_rate,
    *,
    bias_pattern,
    is_causal,
    window,
    cap,
    return_weights,
    operand=None,
    logit_scale=None,
    score_mod=None,
    num_heads=None,
    params=(),
):
    """softmax(logits) v on grouped tensors, with a hand-written gradient.

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

    With `operand` (bfloat16 or float16 inputs) every product multiplies in that precision
    and accumulates in float32 (`M.matmul`), `q` arrives unscaled and `logit_scale`
    multiplies the float32 products `q k^T` instead; the softmax and everything around it
    stay float32, and the gradients are returned in the inputs' dtypes.

    With a `score_mod`, it changes the scaled logits before the bias (`M.apply_score_mod`).
    Its gradient goes back through the mod by a tape, to `q` and `k` and to what the mod
    reads: its float tensors `params` and the variables it reads, and the key-side products
    then read the `(T, S)` gradient transposed.

    Returns the output `(B, K, G, T, Hv)` and the weights `(B, K, G, T, S)` or None.
    """
    groups = q.shape[2]
    compute = keras.backend.standardize_dtype(q.dtype) if operand is None else "float32"
    t, s = ops.shape(q)[3], ops.shape(k)[2]

    def matmul(a, b, transpose_b=False, transpose_a=False):
        return M.matmul(a, b, operand, transpose_b, transpose_a)

    def prepare(mask, keep, bias):
        """The masks in additive form and the key-first layouts, from the forward's inputs."""
        constraint = M.band(ops.arange(t), ops.arange(s), is_causal, window)  # (T, S) | None
        if constraint is not None:
            constraint = constraint[None, None, None]  # (1, 1, 1, T, S)
        allowed = M.combine(mask, constraint)  # broadcasts to (B, K, G, T, S)
        # The mask as a bias: one add that XLA fuses into the softmax's pass, where selecting
        # with the boolean mask before and after the exp cost 35% of the forward (B=256, N=2,
        # T=S=192, H=32: 69 against 51 ms).
        penalty, any_allowed = None, None
        if allowed is not None:
            penalty = ops.cast(ops.where(allowed, 0.0, M.MASK_PENALTY), compute)
            any_allowed = ops.any(allowed, axis=-1, keepdims=True)  # (…, T|1, 1)
        keys_first = (M.keys_first(penalty), M.keys_first(keep), M.keys_first(bias))
        return penalty, any_allowed, keys_first

    scale_keep = None if keep is None else 1.0 / (1.0 - dropout_rate)

    def raw_logits(q, k):
        raw = M.from_rows(matmul(M.to_rows(q), k, transpose_b=True), groups)  # (B, K, G, T, S)
        return M.scaled(raw, logit_scale)

    def forward(q, k, v, bias, params, mask, keep, mod_constants):
        # The masks, the keep-mask and the mod's tensors come in as arguments: what the
        # custom gradient reads is in plain sight (both backends' shims would also take it
        # from the enclosing scope, as the chunked path's does).
        penalty, any_allowed, (penalty_t, keep_t, bias_t) = prepare(mask, keep, bias)
        b_index = M.batch_index(ops.shape(q)[0])
        positions = (ops.arange(t), ops.arange(s))
        mod = None if score_mod is None else score_mod.bound(params, mod_constants)
        raw = raw_logits(q, k)
        if mod is not None:
            raw = M.apply_score_mod(mod, raw, b_index, num_heads, *positions)
        scores = M.logits(raw, bias, cap)
        exp, inv_total, lse = softmax_parts(scores, penalty, any_allowed)
        applied = exp if keep is None else ops.where(keep, exp * scale_keep, 0.0)
        out = M.from_rows(matmul(M.to_rows(applied), v), groups) * inv_total  # (B, K, G, T, Hv)
        weights = exp * inv_total if return_weights else None  # (B, K, G, T, S)

        def grad(d_out, d_weights=None, variables=()):
            # rowsum(P * dP) == rowsum(dO * O), a (T, Hv) product, not a (T, S) one.
            row_dot = ops.sum(d_out * out, axis=-1, keepdims=True)  # (B, K, G, T, 1)
            rows_d_out = M.to_rows(d_out)  # (B, K, G * T, Hv)
            d_probs = M.from_rows(matmul(rows_d_out, v, transpose_b=True), groups)
            if keep is not None:
                d_probs = ops.where(keep, d_probs * scale_keep, 0.0)
            probs = exp * inv_total  # (B, K, G, T, S)
            if d_weights is not None:
                d_probs = d_probs + d_weights
                row_dot = row_dot + ops.sum(d_weights * probs, axis=-1, keepdims=True)
            d_scores = probs * (d_probs - row_dot)  # (B, K, G, T, S)
            if cap is not None:
                d_scores = d_scores * M.cap_derivative(scores, cap)
            if mod is not None:
                return grad_through_mod(d_scores, rows_d_out, variables)
            d_q = M.from_rows(matmul(M.to_rows(d_scores), k), groups)  # (B, K, G, T, H)
            d_q = M.scaled(d_q, logit_scale)

            # The same in the (S, G, T) layout, for d_k and d_v.
            raw_t = M.scaled(matmul(k, M.to_rows(q), transpose_b=True), logit_scale)
            k_shape = ops.shape(k)
            raw_t = ops.reshape(raw_t, (k_shape[0], k_shape[1], s, groups, t))
            scores_t = M.logits(raw_t, bias_t, cap)  # (B, K, S, G, T)
            masked_t = scores_t if penalty_t is None else scores_t + penalty_t
            probs_t = ops.exp(masked_t - M.keys_first(lse))
            applied_t = probs_t if keep_t is None else ops.where(keep_t, probs_t * scale_keep, 0.0)
            d_v = matmul(_keys_rows(applied_t), rows_d_out)  # (B, K, S, Hv)
            d_probs_t = ops.reshape(
                matmul(v, rows_d_out, transpose_b=True), ops.shape(probs_t)
            )  # (B, K, S, G, T)
            if keep_t is not None:
                d_probs_t = ops.where(keep_t, d_probs_t * scale_keep, 0.0)
            if d_weights is not None:
                d_probs_t = d_probs_t + M.keys_first(d_weights)
            d_scores_t = probs_t * (d_probs_t - M.keys_first(row_dot))
            if cap is not None:
                d_scores_t = d_scores_t * M.cap_derivative(scores_t, cap)
            d_k = M.scaled(matmul(_keys_rows(d_scores_t), M.to_rows(q)), logit_scale)
            grads = [ops.cast(d_q, q.dtype), ops.cast(d_k, k.dtype), ops.cast(d_v, v.dtype)]
            if bias is not None:
                grads.append(M.sum_to_bias(d_scores, ops.shape(bias), bias_pattern))
            return grads

        def grad_through_mod(d_scores, rows_d_out, variables):
            """The gradient with a score_mod: back through the mod, then the products."""
            d_raw, d_params, d_variables = M.mod_vjp(
                mod, raw_logits(q, k), b_index, num_heads, *positions, d_scores, params,
                variables,
            )
            d_q = M.scaled(M.from_rows(matmul(M.to_rows(d_raw), k), groups), logit_scale)
            d_k = M.scaled(matmul(M.to_rows(d_raw), M.to_rows(q), transpose_a=True), logit_scale)
            probs = exp * inv_total
            applied = probs if keep is None else ops.where(keep, probs * scale_keep, 0.0)
            d_v = matmul(M.to_rows(applied), rows_d_out, transpose_a=True)  # (B, K, S, Hv)
            grads = [ops.cast(d_q, q.dtype), ops.cast(d_k, k.dtype), ops.cast(d_v, v.dtype)]
            if bias is not None:
                grads.append(M.sum_to_bias(d_scores, ops.shape(bias), bias_pattern))
            grads += [ops.cast(g, p.dtype) for g, p in zip(d_params, params)]
            return grads, [ops.convert_to_tensor(g) for g in d_variables]

        if return_weights:
            return (out, weights), grad
        return out, lambda d_out, variables=(): grad(d_out, variables=variables)

    has_bias = bias is not None
    mod_constants = () if score_mod is None else score_mod.constants

    def attend_inputs(inputs, constants):
        q, k, v = inputs[:3]
        bias = inputs[3] if has_bias else None
        result, grad = forward(q, k, v, bias, inputs[3 + has_bias :], *constants)

        def grad_fn(*d, variables=None):
            grads = grad(*d, variables=variables or ())
            if score_mod is None:
                return (grads, [None] * len(variables)) if variables else grads
            grads, d_variables = grads
            return (grads, d_variables) if variables else grads

        return result, grad_fn

    inputs = (q, k, v, *([bias] if has_bias else []), *params)
    constants = (mask, keep, mod_constants)  # no gradient
    result = _backend.get().custom_gradient(lambda *inputs: attend_inputs(inputs, constants))(
        *inputs
    )
    return result if return_weights else (result, None)


def _keys_rows(x):
    """`(B, K, S, G, T)` as `(B, K, S, G * T)`."""
    shape = ops.shape(x)
    return ops.reshape(x, (shape[0], shape[1], shape[2], shape[3] * shape[4]))
