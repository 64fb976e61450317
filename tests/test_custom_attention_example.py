"""examples/custom_attention.py: a user's own attention layer through the KV-cache handle
gives the same outputs with rows read from the pinned host pool (HiSparse) as all-resident."""

from __future__ import annotations


def test_custom_attention_example_matches_all_resident(capsys):
    from examples import custom_attention

    custom_attention.main()  # asserts: rows came from host and outputs equal all-resident
    out = capsys.readouterr().out
    assert "max |AllResident - HiSparse|" in out, out
