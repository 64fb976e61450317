"""sparse_mla_decode: MLA decode attention over selected flat rows of a paged latent KV cache.
`reference.py` is the jnp definition (and the split combine the kernels share), `triton.py`
the Pallas kernel through the Triton lowering (its program in `triton_body.py`, its K-tile
readers in `triton_tiles.py`, its split-K combine kernel in `combine.py`), `mosaic_gpu.py` a
Pallas Mosaic GPU kernel (Hopper, jax >= 0.11; import it only there) and `mosaic_gpu_fp8.py` its
row-copy sibling (one bulk copy per selected row; fp8_ds_mla and bf16 rows)."""
