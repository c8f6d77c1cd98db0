"""Programmable attention: the `Mod` base (`base.py`), the built-in mods (`builtin.py`) and the
causal band and window (`bands.py`). Users import them from `keras_sdpa.mods`. Imports `_backend`
and `_shared`.
"""
