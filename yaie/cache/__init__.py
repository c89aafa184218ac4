"""KV cache bookkeeping. Pure Python: no torch import anywhere in this package."""
