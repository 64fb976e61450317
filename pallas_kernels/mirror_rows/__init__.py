"""mirror_rows: device cache rows -> host pool rows (write-back of new tokens, spills).
`reference.py` is the jnp definition, `triton.py` the Pallas kernel."""
