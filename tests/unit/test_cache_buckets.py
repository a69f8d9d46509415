"""Cache lengths ``generate`` captures: few buckets, none shorter than needed, within limits."""

from __future__ import annotations

import pytest

from tpcompile.runtime.cache_modules import cache_length


@pytest.mark.parametrize("needed, bucket", [
    (1, 64), (64, 64), (65, 128), (513, 1024), (1024, 1024), (1025, 2048), (3000, 3072),
])
def test_powers_of_two_up_to_1024_then_multiples_of_1024(needed, bucket):
    assert cache_length(needed) == bucket


def test_a_limit_the_tokens_fit_caps_the_bucket():
    assert cache_length(10, limit=40) == 40  # a 40-position model: no 64-position cache
    assert cache_length(10, limit=4096) == 64
    assert cache_length(50, limit=40) == 64  # past the limit: the model's own error, not ours
