"""keras-sdpa: scaled dot-product attention for Keras 3, compiled by XLA."""

import os

# The core is written in TensorFlow and compiled by XLA through tf.function.
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

from keras_sdpa import mods, ops  # noqa: E402
from keras_sdpa.layer import ScaledDotProductAttention  # noqa: E402
from keras_sdpa.ops import BlockMask, create_block_mask, scaled_dot_product_attention  # noqa: E402
from keras_sdpa.swap import AttentionReport, replace_attention, sdpa_scope  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "AttentionReport",
    "BlockMask",
    "ScaledDotProductAttention",
    "create_block_mask",
    "mods",
    "ops",
    "replace_attention",
    "scaled_dot_product_attention",
    "sdpa_scope",
    "__version__",
]
