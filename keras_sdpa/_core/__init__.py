"""The core: a `Request` decided once into a `Plan`, then one compiled program that runs one of
three paths (dense, chunked, decode); with `context_parallel`, the ring (`ring.py`), its own
program over a device mesh. Its public face is `keras_sdpa.ops`. Imports the rooms
below it (`_backend`, `_shared`, `_mods`); no path imports another.
"""
