"""Attention swapped inside built models: the reference scan, `sdpa_scope`'s patch and the
keras-hub families. Its public face is `keras_sdpa.swap`. Imports every room below it.
"""
