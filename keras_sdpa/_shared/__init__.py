"""The words every room uses: the typed contracts (`types.py`) and the argument checks
(`checks.py`). Imports `_backend` only.
"""
