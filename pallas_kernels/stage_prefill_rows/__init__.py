"""stage_prefill_rows: gather the rows a prefill chunk's top-k selects from earlier context
into a staging buffer per layer, once per index group: the resident device copy when the page
has one, else the pinned host copy (`docs/prefill_staging.md`). `reference.py` is the jnp
definition, `triton.py` the one-launch Pallas kernel."""
