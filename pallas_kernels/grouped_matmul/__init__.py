"""grouped_matmul: rows of lhs, sorted by group, times their group's matrix (the MoE's
token-expert pairs times their experts' weights). `reference.py` is the jnp definition
(`jax.lax.ragged_dot`), `triton.py` a Pallas kernel through the Triton lowering (one program
per (tile of one group's rows, column block); tiles past the last group's rows end at once),
`mosaic_gpu.py` jax's Hopper grouped matmul (`jax.experimental.pallas.ops.gpu.
ragged_dot_mgpu`) wrapped (Hopper GPUs only; import it only there)."""
