"""resolve_residency: map each selected position to a device row and update the hot-region
LRU (`docs/semantics.md`). `reference.py` is the jnp definition (the oracle every kernel is
checked against), `triton.py` the one-launch Pallas kernel (its per-row frame, search rule and
position map rule in `frame.py`, `search.py` and `mapped.py`)."""
