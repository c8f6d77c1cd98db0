"""The softmax's formulas, one home each for every path (dense, chunked, decode) and the
mods: the logits of a row, its masks, dropout and the gradient into the logits.

The logits of a row are, in this order:

    1. s = scale * q k^T + bias                   (`logits`)
    2. s = cap * tanh(s / cap)                    (the soft cap of Gemma 2)
    3. masked: boolean mask, causal, window       (a masked key gets weight 0: the band
                                                   of `keras_sdpa/_mods/bands.py`, `combine`,
                                                   `additive`)

Everything here is `keras.ops`, the same on both backends; what differs lives in
`keras_sdpa/_backend/`.
"""

from keras import ops

from keras_sdpa import _backend

# Stands in for -inf on masked logits: finite, so `logits - max` never makes a NaN.
MASKED_SCORE = -3.0e38


# Added to a masked logit on the dense path: exp(logit + MASK_PENALTY - row max) is exactly 0
# for any logit a row can hold, and the sum stays finite (no -inf, so no inf - inf).
MASK_PENALTY = -1.0e30


def additive(allowed, dtype):
    """A boolean mask `(…, T|1, S)` in additive form, 0 where allowed and `MASK_PENALTY`
    elsewhere, in `dtype`, and `(…, T|1, 1)` whether each row allows some key; `(None, None)`
    without a mask. The dense and decode paths add it to the logits: one add that XLA fuses
    into the softmax's pass, where selecting with the boolean mask before and after the exp
    cost 35% of the forward (B=256, N=2, T=S=192, H=32: 69 against 51 ms)."""
    if allowed is None:
        return None, None
    penalty = ops.cast(ops.where(allowed, 0.0, MASK_PENALTY), dtype)
    return penalty, ops.any(allowed, axis=-1, keepdims=True)


def combine(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return ops.logical_and(a, b)


def parts(scores, penalty, any_allowed):
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
        lse = ops.where(any_allowed, lse, -MASK_PENALTY)
    return exp, inv_total, lse


def logits(raw, bias, cap):
    """Steps 1 and 2: `raw = scale * q k^T` plus the bias, then the soft cap."""
    if bias is not None:
        raw = raw + bias
    if cap is not None:
        raw = cap * _backend.get().tanh(raw / cap)  # float64 stays float64
    return raw


def cap_derivative(capped, cap):
    """d(cap * tanh(x / cap)) / dx = 1 - tanh^2, from the capped logits themselves."""
    ratio = capped / cap
    return 1.0 - ratio * ratio


def d_logits(probs, d_probs, row_dot, scores, cap):
    """The softmax's gradient into the logits, `P * (dP - rowsum(dO * O))`, back through the
    soft cap (`cap_derivative` at the capped `scores`) where there is one. Every path's
    gradient, in either layout, forms it here."""
    d_scores = probs * (d_probs - row_dot)
    return d_scores if cap is None else d_scores * cap_derivative(scores, cap)


def dropped(x, keep, rate):
    """Inverted dropout of `x` (the weights, or their gradient): `x / (1 - rate)` where the
    keep-mask `keep` is True and zero elsewhere; `x` itself without a keep-mask (None)."""
    if keep is None:
        return x
    return ops.where(keep, x * (1.0 / (1.0 - rate)), 0.0)
