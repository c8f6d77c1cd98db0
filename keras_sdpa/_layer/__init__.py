"""The layer's parts: its call by route, arguments, shapes, masks, the key/value cache. Its
public face is `keras_sdpa.layer`. Imports the core and the rooms below it.
"""
