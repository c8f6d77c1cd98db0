"""Decide once: every static fact of an attention call, in one frozen `Plan`.

`flash_attention` (the layer's), `implementation` (the core's) and a cached call's decode
become one name here, `Plan.path`: `"dense"`, `"chunked"` or `"decode"`. The plan also holds
the chunk size, the lowered mods, the masks' forms and the precision. It is hashable and
compares by value, so it is the compiled program's cache key (a `Literal` to `tf.function`,
a static argument to `jax.jit`).
"""

FLASH_ATTENTION = (None, True, False)
IMPLEMENTATIONS = ("auto", "dense", "chunked", "decode")


def check_flash_attention(flash_attention):
    """The layer's `flash_attention`: `True` chunked, `False` dense, `None` the implementation's."""
    if flash_attention not in FLASH_ATTENTION:
        raise ValueError(
            "`flash_attention` must be None, True or False. "
            f"Received: flash_attention={flash_attention!r}"
        )
    return flash_attention


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
