"""The dense path: the whole `(T, S)` logits at once, with a hand-written gradient.

Tensors are in the grouped layout of `keras_sdpa._core.layout`: `q (B, K, G, T, H)`,
`k (B, K, S, H)`, `v (B, K, S, Hv)`.
"""

from keras import ops

from keras_sdpa import _backend
from keras_sdpa._core import layout, mod_calls, softmax
from keras_sdpa._mods import bands


def attend(q, k, v, plan, tensors):
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

    With `plan.operand` (bfloat16 or float16 inputs) every product multiplies in that
    precision and accumulates in float32 (`layout.matmul`), `q` arrives unscaled and
    `plan.logit_scale` multiplies the float32 products `q k^T` instead; the softmax and
    everything around it stay float32, and the gradients are returned in the inputs' dtypes.

    With a `score_mod`, it changes the scaled logits before the bias (`mod_calls.apply_score_mod`).
    Its gradient goes back through the mod by a tape, to `q` and `k` and to what the mod
    reads: its float tensors `tensors.params` and the variables it reads, and the key-side
    products then read the `(T, S)` gradient transposed.

    Returns the output `(B, K, G, T, Hv)` and the weights `(B, K, G, T, S)` or None.
    """
    mask = mod_calls.with_mask_mod(tensors.mask, q, ops.shape(k)[2], plan, tensors.mask_mod)
    keep = _keep(q, k, plan, tensors.seed)  # (B, K, G, T, S) or None
    has_bias, score_mod = tensors.bias is not None, tensors.score_mod
    # The masks, the keep-mask and the mod's tensors come in as arguments: what the
    # custom gradient reads is in plain sight (both backends' shims would also take it
    # from the enclosing scope, as the chunked path's does). No gradient reaches them.
    constants = (mask, keep, () if score_mod is None else score_mod.constants)

    def attend_inputs(*inputs):
        q, k, v = inputs[:3]
        bias = inputs[3] if has_bias else None
        forward = _Forward(q, k, v, bias, inputs[3 + has_bias :], *constants, plan, score_mod)
        return forward.result, forward.grad_fn

    inputs = (q, k, v, *([tensors.bias] if has_bias else []), *tensors.params)
    result = _backend.get().custom_gradient(attend_inputs)(*inputs)
    return result if plan.return_weights else (result, None)


def _keep(q, k, plan, seed):
    """Dropout's keep-mask, `(B, K, G, T, S)`, drawn for `(B, N, T, S)`; None without."""
    if plan.dropout_rate <= 0.0:
        return None
    b, t, s = ops.shape(q)[0], ops.shape(q)[3], ops.shape(k)[2]
    uniform = _backend.get().uniform((b, plan.num_heads, t, s), seed, plan.compute)
    return layout.grouped(uniform >= plan.dropout_rate, (True,) * 4, plan.num_kv_heads, plan.groups)


def _prepare(mask, keep, bias, t, s, plan):
    """The masks in additive form and the key-first layouts, from the forward's inputs."""
    constraint = bands.band(ops.arange(t), ops.arange(s), plan.is_causal, plan.window)
    if constraint is not None:  # (T, S)
        constraint = constraint[None, None, None]  # (1, 1, 1, T, S)
    allowed = softmax.combine(mask, constraint)  # broadcasts to (B, K, G, T, S)
    penalty, any_allowed = softmax.additive(allowed, plan.compute)  # the mask as a bias
    keys_first = (layout.keys_first(penalty), layout.keys_first(keep), layout.keys_first(bias))
    return penalty, any_allowed, keys_first


def _raw_logits(q, k, plan):
    raw = layout.matmul(layout.to_rows(q), k, plan.operand, True)  # (B, K, G * T, S)
    return layout.scaled(layout.from_rows(raw, plan.groups), plan.logit_scale)  # (B, K, G, T, S)


class _Forward:
    """The forward pass of one call, and what its gradient reads back (`grad_fn`)."""

    def __init__(self, q, k, v, bias, params, mask, keep, mod_constants, plan, score_mod):
        self.q, self.k, self.v, self.bias, self.params, self.plan = q, k, v, bias, params, plan
        self.keep, self.t, self.s = keep, ops.shape(q)[3], ops.shape(k)[2]
        self.penalty, any_allowed, self.keys_first = _prepare(
            mask, keep, bias, self.t, self.s, plan
        )
        self.b_index = layout.batch_index(ops.shape(q)[0])
        self.positions = (ops.arange(self.t), ops.arange(self.s))
        self.mod = None if score_mod is None else score_mod.bound(params, mod_constants)
        raw = _raw_logits(q, k, plan)
        if self.mod is not None:
            raw = mod_calls.apply_score_mod(
                self.mod, raw, self.b_index, plan.num_heads, *self.positions
            )
        self.scores = softmax.logits(raw, bias, plan.cap)
        self.exp, self.inv_total, self.lse = softmax.parts(self.scores, self.penalty, any_allowed)
        applied = softmax.dropped(self.exp, keep, plan.dropout_rate)
        out = layout.from_rows(layout.matmul(layout.to_rows(applied), v, plan.operand), plan.groups)
        self.out = out * self.inv_total  # (B, K, G, T, Hv)
        self.result = self.out
        if plan.return_weights:
            self.result = (self.out, self.exp * self.inv_total)  # and (B, K, G, T, S)

    def grad_fn(self, *d, variables=None):
        """The gradients of the inputs (and, TensorFlow, of the variables the mod read)."""
        d_out, d_weights = d if self.plan.return_weights else (d[0], None)
        variables = variables or ()
        if self.mod is not None:
            grads, d_variables = self._grad_through_mod(d_out, d_weights, variables)
            return (grads, d_variables) if variables else grads
        grads = self._grad(d_out, d_weights)
        return (grads, [None] * len(variables)) if variables else grads

    def _d_scores(self, d_out, d_weights):
        """`dS = P * (dP - rowsum(dO * O))`, `(B, K, G, T, S)`, and the pieces it reuses."""
        plan, groups = self.plan, self.plan.groups
        # rowsum(P * dP) == rowsum(dO * O), a (T, Hv) product, not a (T, S) one.
        row_dot = ops.sum(d_out * self.out, axis=-1, keepdims=True)  # (B, K, G, T, 1)
        rows_d_out = layout.to_rows(d_out)  # (B, K, G * T, Hv)
        d_probs = layout.from_rows(layout.matmul(rows_d_out, self.v, plan.operand, True), groups)
        d_probs = softmax.dropped(d_probs, self.keep, plan.dropout_rate)
        probs = self.exp * self.inv_total  # (B, K, G, T, S)
        if d_weights is not None:
            d_probs = d_probs + d_weights
            row_dot = row_dot + ops.sum(d_weights * probs, axis=-1, keepdims=True)
        d_scores = softmax.d_logits(
            probs, d_probs, row_dot, self.scores, plan.cap
        )  # (B, K, G, T, S)
        return d_scores, row_dot, rows_d_out

    def _grad(self, d_out, d_weights):
        q, k, v, plan, groups = self.q, self.k, self.v, self.plan, self.plan.groups
        operand, logit_scale = plan.operand, plan.logit_scale
        d_scores, row_dot, rows_d_out = self._d_scores(d_out, d_weights)
        d_q = layout.from_rows(
            layout.matmul(layout.to_rows(d_scores), k, operand), groups
        )  # (B, K, G, T, H)
        d_q = layout.scaled(d_q, logit_scale)

        # The same in the (S, G, T) layout, for d_k and d_v.
        penalty_t, keep_t, bias_t = self.keys_first
        raw_t = layout.scaled(layout.matmul(k, layout.to_rows(q), operand, True), logit_scale)
        k_shape = ops.shape(k)
        raw_t = ops.reshape(raw_t, (k_shape[0], k_shape[1], self.s, groups, self.t))
        scores_t = softmax.logits(raw_t, bias_t, plan.cap)  # (B, K, S, G, T)
        masked_t = scores_t if penalty_t is None else scores_t + penalty_t
        probs_t = ops.exp(masked_t - layout.keys_first(self.lse))
        applied_t = softmax.dropped(probs_t, keep_t, plan.dropout_rate)
        d_v = layout.matmul(_keys_rows(applied_t), rows_d_out, operand)  # (B, K, S, Hv)
        d_probs_t = ops.reshape(
            layout.matmul(v, rows_d_out, operand, True), ops.shape(probs_t)
        )  # (B, K, S, G, T)
        d_probs_t = softmax.dropped(d_probs_t, keep_t, plan.dropout_rate)
        if d_weights is not None:
            d_probs_t = d_probs_t + layout.keys_first(d_weights)
        d_scores_t = softmax.d_logits(
            probs_t, d_probs_t, layout.keys_first(row_dot), scores_t, plan.cap
        )
        d_k = layout.scaled(
            layout.matmul(_keys_rows(d_scores_t), layout.to_rows(q), operand), logit_scale
        )
        grads = [ops.cast(d_q, q.dtype), ops.cast(d_k, k.dtype), ops.cast(d_v, v.dtype)]
        if self.bias is not None:
            grads.append(layout.sum_to_bias(d_scores, ops.shape(self.bias), plan.bias_pattern))
        return grads

    def _grad_through_mod(self, d_out, d_weights, variables):
        """The gradient with a score_mod: back through the mod, then the products."""
        q, k, plan, groups = self.q, self.k, self.plan, self.plan.groups
        operand, logit_scale = plan.operand, plan.logit_scale
        d_scores, _, rows_d_out = self._d_scores(d_out, d_weights)
        d_raw, d_params, d_variables = mod_calls.mod_vjp(
            self.mod,
            _raw_logits(q, k, plan),
            self.b_index,
            plan.num_heads,
            *self.positions,
            d_scores,
            self.params,
            variables,
        )
        d_q = layout.from_rows(layout.matmul(layout.to_rows(d_raw), k, operand), groups)
        d_q = layout.scaled(d_q, logit_scale)
        d_k = layout.matmul(layout.to_rows(d_raw), layout.to_rows(q), operand, False, True)
        d_k = layout.scaled(d_k, logit_scale)
        probs = self.exp * self.inv_total
        applied = softmax.dropped(probs, self.keep, plan.dropout_rate)
        d_v = layout.matmul(
            layout.to_rows(applied), rows_d_out, operand, False, True
        )  # (B, K, S, Hv)
        grads = [ops.cast(d_q, q.dtype), ops.cast(d_k, k.dtype), ops.cast(d_v, self.v.dtype)]
        if self.bias is not None:
            grads.append(layout.sum_to_bias(d_scores, ops.shape(self.bias), plan.bias_pattern))
        grads += [ops.cast(g, p.dtype) for g, p in zip(d_params, self.params)]
        return grads, [ops.convert_to_tensor(g) for g in d_variables]


def _keys_rows(x):
    """`(B, K, S, G, T)` as `(B, K, S, G * T)`."""
    shape = ops.shape(x)
    return ops.reshape(x, (shape[0], shape[1], shape[2], shape[3] * shape[4]))
