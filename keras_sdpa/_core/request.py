"""What one attention call asks for besides its tensors, written once and checked once.

`scaled_dot_product_attention` builds a `Request` from its keyword arguments, and the layer
builds one from its settings for each call; `plan.make` turns a request and the tensors'
shapes into the `Plan`, and only decides. Adding an option means: the public signature and
its docstring, a field here (with its check), the plan's decision if it has one, and the code
that uses it.
"""

from __future__ import annotations

import dataclasses
import math

from keras_sdpa._core.block_mask import BlockMask
from keras_sdpa._shared import checks
from keras_sdpa._shared.types import MaskMod, ScoreMod, Tensor

IMPLEMENTATIONS = ("auto", "dense", "chunked", "decode")


@dataclasses.dataclass(frozen=True, eq=False)
class Request:
    """The options of one call of the core, checked when it is made.

    The fields up to `block_mask` are `scaled_dot_product_attention`'s keyword arguments
    (but `bias`, a tensor), with its defaults; `flash_attention` and `cached` are the layer's
    two choices besides them (`plan.make` maps the three to one path).
    """

    is_causal: bool = False
    sliding_window: int | None = None
    attn_logits_soft_cap: float | None = None
    scale: float | None = None
    dropout_rate: float = 0.0
    training: bool = False
    seed: int | Tensor | None = None  # an int, a (2,) integer tensor, or None
    return_weights: bool = False
    implementation: str = "auto"
    chunk_size: int | None = None
    score_mod: ScoreMod | None = None
    mask_mod: MaskMod | None = None
    block_mask: BlockMask | None = None
    context_parallel: str | None = None  # the mesh axis that shards the sequence (the ring)
    flash_attention: bool | None = None  # the layer's: True chunked, False dense, None as given
    cached: bool = False  # the layer's call against a key/value cache

    def __post_init__(self):
        checks.check_sliding_window(self.sliding_window)
        checks.check_soft_cap(self.attn_logits_soft_cap)
        if self.scale is not None:
            checks.check_scale(self.scale)
        if not 0.0 <= self.dropout_rate < 1.0:
            raise ValueError(
                f"`dropout_rate` must be in [0, 1). Received: dropout_rate={self.dropout_rate}"
            )
        check_implementation(self.implementation)
        chunk_size = checks.positive_int("chunk_size", self.chunk_size, or_none=True)
        object.__setattr__(self, "chunk_size", chunk_size)  # an int, as the plan keeps it
        checks.check_mod("score_mod", self.score_mod)
        checks.check_mod("mask_mod", self.mask_mod)
        check_flash_attention(self.flash_attention)
        check_context_parallel(self)

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)

    def scale_for(self, head_size):
        """The scale as a float: the one given, else `1 / sqrt(H)`."""
        return float(1.0 / math.sqrt(head_size) if self.scale is None else self.scale)


# The public function's keyword arguments that a request holds (all but `bias`).
CORE_OPTIONS = tuple(field.name for field in dataclasses.fields(Request))[:-2]


def check_flash_attention(flash_attention):
    """The layer's `flash_attention`: `True` chunked, `False` dense, `None` the implementation's."""
    if flash_attention not in (None, True, False):
        raise ValueError(
            "`flash_attention` must be None, True or False. "
            f"Received: flash_attention={flash_attention!r}"
        )
    return flash_attention


def check_context_parallel(request):
    """`context_parallel`: None or a mesh axis's name; with it, no choice of path (the ring is
    its own) and no decoding (one device's work: a few query rows against a cache)."""
    axis = request.context_parallel
    if axis is None:
        return
    if not isinstance(axis, str) or not axis:
        raise ValueError(
            "`context_parallel` must be None or the name of a device mesh axis. "
            f"Received: context_parallel={axis!r}"
        )
    if request.implementation == "decode" or request.cached:
        raise ValueError(
            "`context_parallel` shards a whole sequence; decoding from a cache runs on one "
            f"device. Received: context_parallel={axis!r} with "
            f"implementation={request.implementation!r}, cached={request.cached}"
        )
    for name, default in (
        ("implementation", "auto"),
        ("chunk_size", None),
        ("flash_attention", None),
    ):
        if getattr(request, name) != default:
            raise ValueError(
                f"`{name}` chooses a path on one device; with `context_parallel` the ring is the "
                f"path. Received: context_parallel={axis!r} with {name}={getattr(request, name)!r}"
            )


def check_implementation(implementation, layer=False):
    """`implementation` of the core, or of the layer (`layer`: no `"decode"`, which the layer
    picks itself for a cached call of one query row)."""
    allowed = IMPLEMENTATIONS[:3] if layer else IMPLEMENTATIONS
    if implementation not in allowed:
        names = ", ".join(f'"{name}"' for name in allowed[:-1]) + f' or "{allowed[-1]}"'
        raise ValueError(
            f"`implementation` must be {names}. Received: implementation={implementation!r}"
        )
    return implementation


DEFAULT = Request()  # every option at the public function's default
