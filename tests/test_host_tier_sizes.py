"""host_tier.sizes: the small size rules and their error texts."""

import types

import numpy as np
import pytest

from host_tier.sizes import cdiv, check_int, config_size, is_int, pow2_bucket, round_up


def test_size_rules():
    assert [cdiv(a, 4) for a in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]
    assert [round_up(a, 4) for a in (0, 1, 4, 5)] == [0, 4, 4, 8]
    assert [pow2_bucket(n) for n in (0, 1, 2, 3, 5, 64)] == [1, 1, 2, 4, 8, 64]
    assert [pow2_bucket(n, 64) for n in (0, 1, 64, 65)] == [64, 64, 64, 128]
    assert is_int(3) and is_int(np.int32(3)) and not is_int(True) and not is_int(3.0)


def test_check_int_names_the_owner_and_the_rule():
    assert check_int("X", "n", np.int64(4)) == 4 and type(check_int("X", "n", np.int64(4))) is int
    with pytest.raises(ValueError, match=r"^X.n must be a positive int, got 0$"):
        check_int("X", "n", 0)
    with pytest.raises(ValueError, match=r"^X.n must be a positive int, got True$"):
        check_int("X", "n", True)
    with pytest.raises(ValueError, match=r"^X.n must be an int >= 2, got 1.5$"):
        check_int("X", "n", 1.5, minimum=2)
    assert check_int("X", "n", 0, minimum=0) == 0


def test_config_size_reads_an_attribute_and_refuses_none():
    config = types.SimpleNamespace(block_size=4, max_pages=None)
    assert config_size(config, "block_size", owner="R") == 4
    with pytest.raises(ValueError, match=r"^R: config.max_pages is None or missing; set it on "
                                         r"the SimpleNamespace$"):
        config_size(config, "max_pages", owner="R")
    with pytest.raises(ValueError, match=r"config.hot_blocks is None or missing; .* or pass "
                                         r"hot_blocks= to R$"):
        config_size(config, "hot_blocks", owner="R", keyword=True)
