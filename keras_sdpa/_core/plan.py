"""Decide once: every static fact of an attention call, in one frozen `Plan`.

`flash_attention` (the layer's), `implementation` (the core's) and a cached call's decode
become one name here, `Plan.path`: `"dense"`, `"chunked"` or `"decode"`. The plan also holds
the chunk size, the lowered mods, the masks' forms and the precision. It is hashable and
compares by value, so it is the compiled program's cache key (a `Literal` to `tf.function`,
a static argument to `jax.jit`).

The paths then compute from it: `ops` runs the program, which calls `_dense`, `_chunked` or
`_decode` with `(q, k, v, plan, tensors)`; those reach each backend through `_backend`.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Hashable

import keras
from keras import ops

from keras_sdpa import _backend, mods
from keras_sdpa._core import block_mask, chunk_sizes, layout
from keras_sdpa._core import request as _request
from keras_sdpa._mods import base as mod_base
from keras_sdpa._mods import builtin
from keras_sdpa._shared import checks as _checks
from keras_sdpa._shared.types import MaskMod, ScoreMod, Tensor


def check_scores(flash_attention, return_attention_scores):
    """The layer's scores need the whole (T, S) matrix, which `flash_attention=True` refuses
    to form."""
    if return_attention_scores and flash_attention:
        raise ValueError(
            "`return_attention_scores=True` needs the whole (T, S) matrix, which "
            "`flash_attention=True` never forms. Received: flash_attention=True, "
            "return_attention_scores=True"
        )


# implementation="auto" goes chunked above this many bytes of float32 scores (B * N * T * S * 4).
AUTO_CHUNKED_BYTES = 1 << 28
# Inside a caller's XLA step with an unknown batch size, "auto" goes chunked above this many
# bytes of one example's float32 scores (N * T * S * 4): 256 MiB at a batch of 8.
AUTO_CHUNKED_BYTES_PER_EXAMPLE = AUTO_CHUNKED_BYTES // 8


@dataclasses.dataclass(frozen=True, slots=True)
class Template:
    """A mod's template (`base.split`) in a plan: compared by its config when it is a built-in
    `mods.Mod` (a new `document(ids)` each call must not trace a new program), else by
    identity. The plan holds the template, so the compiled programs' caches keep it alive
    (and a template keyed by identity is never confused with a later one at its address)."""

    key: Hashable  # a built-in's class and config, or the callable itself
    mod: ScoreMod | MaskMod = dataclasses.field(compare=False)

    @classmethod
    def of(cls, template):
        if template is None:
            return None
        if isinstance(template, mods.Mod):
            kind = type(template)
            return cls(f"{kind.__module__}.{kind.__qualname__}{template._key()!r}", template)
        return cls(template, template)


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """Every static fact of one attention call: what the compiled program is keyed by.

    Frozen and slotted: with no `__weakref__`, `tf.function` keys its trace by the plan's
    value (a `Literal`), as `jax.jit` does a static argument.

    `path` is `"dense"`, `"chunked"` or `"decode"`. With `by_size`, the sizes are only known
    at run time (TensorFlow, unknown lengths): the program runs `path="chunked"` when the
    float32 scores pass `AUTO_CHUNKED_BYTES` and a sequence is longer than a block, and
    `path` otherwise. `dtype` is the query's: the precision follows from it (`operand`,
    `compute`, `logit_scale`). Head counts are static: once `reduce_retracing` relaxes the
    traced shapes, `query.shape[2]` inside the program may be None.
    """

    path: str
    num_heads: int
    num_kv_heads: int
    dtype: str
    scale: float
    chunk_size: int  # the chunked path's key blocks `C_k` (and the "auto" path's threshold)
    # Its query blocks `C_q`; `chunk_size` where None (set at construction: a `replace` of
    # `chunk_size` alone keeps the old `C_q`).
    query_chunk_size: int | None = None
    mask_pattern: tuple[bool, bool, bool, bool] | None = None  # full along (B, N, T, S)
    bias_pattern: tuple[bool, bool, bool, bool] | None = None
    is_causal: bool = False
    window: int | None = None
    cap: float | None = None
    dropout_rate: float = 0.0
    return_weights: bool = False
    score_mod: Template | None = None
    mask_mod: Template | None = None
    by_size: bool = False

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)

    def __post_init__(self):
        if self.query_chunk_size is None:
            object.__setattr__(self, "query_chunk_size", self.chunk_size)

    @property
    def groups(self):
        return self.num_heads // self.num_kv_heads

    @property
    def compute(self):
        """The softmax's precision: float64 for float64 inputs, float32 for every other."""
        return "float64" if self.dtype == "float64" else "float32"

    @property
    def operand(self):
        """The products' operand precision for half-precision inputs (into float32), or None."""
        return self.dtype if self.dtype in layout.HALF_DTYPES else None

    @property
    def logit_scale(self):
        """What multiplies the float32 products `q k^T` of half-precision inputs (the scale
        never rounds to their precision); None where the queries are scaled before."""
        return self.scale if self.operand else None


class CallTensors(typing.NamedTuple):
    """What a call passes to its program besides `q`, `k`, `v`: checked, and in the plan's forms."""

    mask: Tensor | None  # (B|1, N|1, T|1, S|1) booleans
    bias: Tensor | None  # (B|1, N|1, T|1, S|1) floats
    seed: Tensor | None  # (2,) int32, with dropout
    score_tensors: tuple[Tensor, ...]  # the score_mod's per-call tensors (`base.split`)
    mask_tensors: tuple[Tensor, ...]
    block_kinds: Tensor | None  # a BlockMask's kinds, on the chunked path
    variable_values: tuple[Tensor, ...]  # JAX: the values of the variables the mods hold


def make(query, key, value, mask=None, bias=None, request=_request.DEFAULT):
    """The `Plan` and the `CallTensors` of one call: the tensors checked, and `request` (the
    options, checked when it was made) decided against their shapes.

    `flash_attention` (the layer's: `True` chunked, `False` dense) overrides
    `implementation`; `cached` (the layer's call against a key/value cache) runs the decode
    path for one query row when neither chooses. A cached call with `flash_attention=True`
    returns its scores from the dense path (only an uncached one refuses them).
    """
    (mask, mask_pattern), (bias, bias_pattern) = _checked(
        query, key, value, mask, bias, request.score_mod
    )
    implementation = _implementation(request, query.shape[1])
    chunk_size, block_kinds = request.chunk_size, None
    if request.block_mask is not None:
        block_kinds, chunk_size = block_mask.check(
            request.block_mask, request.mask_mod, chunk_size, query, key
        )
    mask_mod, is_causal, sliding_window = lower_mask_mod(
        request.mask_mod, request.is_causal, request.sliding_window
    )
    if mask_mod is None:
        block_kinds = None  # the mask_mod lowered to a causal mask or a window: no block map
    if implementation == "decode" and is_causal:
        _check_decode_alignment(query, key, bool(request.is_causal), request.mask_mod)
    masked = is_causal or mask_mod is not None or chunk_sizes.blocked_mask(mask_pattern, query, key)
    chunk_size, balance = chunk_sizes.chosen(chunk_size, sliding_window, mask_mod, masked)
    dropout_rate = float(request.dropout_rate) if request.training else 0.0
    return_weights = bool(request.return_weights)
    path = _path(implementation, query, key, return_weights, chunk_size, request.score_mod)
    if path == "decode" and dropout_rate > 0.0:
        path = "dense"  # the decode path serves inference; dropout's mask is the dense path's
    query_chunk_size = chunk_size
    if path == "chunked" and block_kinds is None:
        compute_bytes = 8 if keras.backend.standardize_dtype(query.dtype) == "float64" else 4
        sizes = chunk_sizes.fitted(chunk_size, query, key, balance, compute_bytes, masked)
        query_chunk_size, chunk_size = sizes
    seed = _checks.as_seed(request.seed) if dropout_rate > 0.0 else None
    block_kinds = block_kinds if path == "chunked" else None  # only that path has blocks
    call, score_template, mask_template = _call_tensors(
        mask, bias, seed, block_kinds, request.score_mod, mask_mod
    )
    cap = request.attn_logits_soft_cap
    plan = Plan(
        path="dense" if path == "auto" else path,
        by_size=path == "auto",
        num_heads=query.shape[2],
        num_kv_heads=key.shape[2],
        dtype=keras.backend.standardize_dtype(query.dtype),
        scale=request.scale_for(query.shape[-1]),
        chunk_size=chunk_size,
        query_chunk_size=query_chunk_size,
        mask_pattern=mask_pattern,
        bias_pattern=bias_pattern,
        is_causal=bool(is_causal),
        window=sliding_window,
        cap=None if cap is None else float(cap),
        dropout_rate=dropout_rate,
        return_weights=return_weights,
        score_mod=Template.of(score_template),
        mask_mod=Template.of(mask_template),
    )
    return plan, call


def _call_tensors(mask, bias, seed, block_kinds, score_mod, mask_mod):
    """The call's `CallTensors`, and the mods' templates (`base.split`): what the program
    is keyed by, apart from the tensors it takes."""
    score_template, score_tensors = mod_base.split(score_mod)
    mask_template, mask_tensors = mod_base.split(mask_mod)
    variables = mod_base.variables_of(score_template, mask_template)
    call = CallTensors(
        mask=mask,
        bias=bias,
        seed=seed,
        score_tensors=score_tensors,
        mask_tensors=mask_tensors,
        block_kinds=block_kinds,
        variable_values=_backend.get().variable_inputs(variables),
    )
    return call, score_template, mask_template


def _checked(query, key, value, mask, bias, score_mod):
    """The tensors' checks: the inputs, and the mask and the bias with their broadcast
    patterns; the score mod's head count against the query's."""
    _checks.check_inputs(query, key, value)
    mask_and_pattern = bias_and_pattern = (None, None)
    if mask is not None:
        mask_and_pattern = _checks.check_mask(ops.convert_to_tensor(mask), query, key)
    if bias is not None:
        bias_and_pattern = _checks.check_bias(bias, query, key)
    builtin.check_heads(score_mod, query.shape[2])
    return mask_and_pattern, bias_and_pattern


def _implementation(request, length):
    """The one name of the path asked for: `flash_attention`, `implementation` and the cache's
    decode, mapped here and nowhere else."""
    flash_attention, cached = request.flash_attention, request.cached
    if flash_attention is not None:
        if not cached:  # a cached call returns them from the dense path, as it always has
            check_scores(flash_attention, request.return_weights)
        return "chunked" if flash_attention else "dense"
    if cached and request.implementation == "auto" and length == 1:
        # One new token against the cache: the decode path reads the cache in its
        # (B, S, K, H) layout, where the others would transpose a copy of it every token.
        return "decode"
    return request.implementation


def _check_decode_alignment(query, key, given_causal, given_mask_mod):
    """Keras aligns the causal mask at the top left: a decode row would see key 0 alone.
    (With a length unknown while tracing this cannot be told; the docstring says so.)"""
    lengths = (query.shape[1], key.shape[1])
    if None in lengths or lengths[0] == lengths[1]:
        return
    causal_by = "is_causal=True"
    if not given_causal:
        try:
            causal_by = f"mask_mod={given_mask_mod!r}"
        except ValueError:  # a mod whose config cannot be written (per-row tensors)
            causal_by = f"mask_mod={type(given_mask_mod).__name__}(…)"
    raise ValueError(
        "A causal mask aligns query `t` with key `t` (top left, as Keras), so with "
        '`implementation="decode"` a new token would read only the first keys. For '
        "queries at the end of a cache use the layer's `cache_update_index`, or a `mask` "
        f"of the positions each query may read. Received: {causal_by}, "
        f"implementation='decode', T={lengths[0]}, S={lengths[1]}"
    )


def _path(implementation, query, key, return_weights, chunk_size, score_mod):
    path = choose_path(implementation, query, key, return_weights, chunk_size)
    if path == "auto" and score_mod is not None:
        # The run-time choice is a tf.cond around two programs, and TensorFlow cannot take
        # the gradient of the variables a score_mod reads through one ("Tensor.graph is
        # undefined when eager execution is enabled"): decide while tracing instead, from
        # one example's scores, as inside a caller's XLA step.
        path = choose_path_from_one_example(query, key, chunk_size)
    return path


def choose_path(implementation, query, key, return_weights, chunk_size):
    """`"dense"`, `"chunked"`, `"decode"`, or `"auto"` when only the run-time sizes can tell.

    "auto" goes chunked when the scores would pass `AUTO_CHUNKED_BYTES` and a sequence is
    longer than one block: below that, the chunked path holds a whole `(T, S)` block per
    head anyway, as much as dense, and a large batch of short sequences stays dense.
    """
    if implementation == "dense" or return_weights:
        return "dense"
    if implementation in ("chunked", "decode"):
        return implementation
    sizes = [
        chunk_sizes.known(d) for d in (query.shape[0], query.shape[2], query.shape[1], key.shape[1])
    ]
    if any(size is None for size in sizes):  # B, N, T, S
        if _backend.get().inside_compiled():
            # Inside a caller's XLA program (`model.compile(jit_compile=True)`) a run-time
            # choice cannot compile: the gradient of its `tf.cond` needs shapes that XLA
            # only sees as parameters there. With T and S known (a fixed sequence length,
            # the batch left unknown, as Keras traces `fit`), the choice is made here from
            # one example's scores; with unknown lengths the chunked path cannot compile
            # at all there (its block counts must be constants), so it stays dense.
            return choose_path_from_one_example(query, key, chunk_size)
        return "auto"  # decided at run time, from the actual sizes
    large = math.prod(sizes) * 4 > AUTO_CHUNKED_BYTES
    return "chunked" if large and max(sizes[2], sizes[3]) > chunk_size else "dense"


def choose_path_from_one_example(query, key, chunk_size):
    """Chunked when one example's float32 scores pass 32 MiB and a sequence is longer than a
    block; dense otherwise, and for lengths unknown while tracing."""
    n, t, s = query.shape[2], chunk_sizes.known(query.shape[1]), chunk_sizes.known(key.shape[1])
    if t is None or s is None:
        return "dense"
    large = n * t * s * 4 > AUTO_CHUNKED_BYTES_PER_EXAMPLE
    return "chunked" if large and max(t, s) > chunk_size else "dense"


def chunked_by_size(plan, query, key):
    """For a `by_size` plan: whether the actual sizes, at run time, take the chunked path."""
    shape = ops.shape(query)
    b, t, s = shape[0], shape[1], ops.shape(key)[1]
    size = ops.cast(b, "int64") * plan.num_heads * ops.cast(t, "int64") * ops.cast(s, "int64")
    return ops.logical_and(size * 4 > AUTO_CHUNKED_BYTES, ops.maximum(t, s) > plan.chunk_size)


def lower_mask_mod(mask_mod, is_causal, sliding_window):
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
