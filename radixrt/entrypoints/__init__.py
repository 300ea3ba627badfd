"""How radixrt starts: the `radixrt` console script, the server launcher (single, data-parallel, TP node follower), the demo."""
