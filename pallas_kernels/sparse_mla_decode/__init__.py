"""sparse_mla_decode: MLA decode attention over selected flat rows of a paged latent KV cache.
`reference.py` is the jnp definition (and the split combine the kernels share), `triton.py`
the Pallas kernel through the Triton lowering, `mosaic_gpu.py` a Pallas Mosaic GPU kernel
(Hopper, jax >= 0.11; import it only there)."""
