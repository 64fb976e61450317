"""examples/custom_attention.py: a user's own model (its own NNX module implementing
`hisparse_jax.models.ServedModel`, one index group per layer, plain attention) served by
the `Engine`: under pool pressure (rows spilled to host and read back through the hot
regions) its greedy tokens equal the all-resident engine's."""

from __future__ import annotations


def test_custom_model_under_pressure_matches_all_resident(capsys):
    from examples import custom_attention

    custom_attention.main()  # asserts: pages spilled, rows read from host, tokens equal
    out = capsys.readouterr().out
    assert "tokens identical to all-resident: True" in out, out
