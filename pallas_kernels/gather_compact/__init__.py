"""gather_compact: host pool rows -> device cache rows (the swap-in of a decode step), for one
layer (`gather_compact`) or every layer of an index group at once (`gather_compact_group`).
`reference.py` is the jnp definition, `triton.py` the Pallas kernel."""
