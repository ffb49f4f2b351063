"""Other implementations run side by side with specjax on the same weights.

Peers are optional: they need the `peers` extra (`pip install -e ".[peers]"`).
"""
