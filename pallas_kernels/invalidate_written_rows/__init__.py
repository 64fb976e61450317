"""invalidate_written_rows: drop the hot copies of host rows that were just rewritten.
`reference.py` is the jnp definition, `triton.py` the Pallas kernel."""
