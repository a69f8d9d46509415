"""parallelize's contract on real gloo ranks: shapes, meshes, agreement, the caller's model."""

from __future__ import annotations

import pytest

from support import launch

pytestmark = pytest.mark.dist


def test_other_batch_sizes_and_sequence_lengths():
    for errs in launch("dynamic_shapes", 2):
        for (batch, seq), err in errs.items():
            assert err <= 1e-5, (batch, seq, err)


def test_ranks_that_plan_differently_fail_loudly_instead_of_hanging():
    messages = launch("plan_mismatch", 2, timeout=120)
    for m in messages:
        assert "ranks planned differently" in m


def test_device_mesh_1d_works_and_2d_is_refused():
    for r in launch("mesh_checks", 4):
        assert r["mesh_1d_err"] <= 1e-5
        assert r["mesh_2d"] == ("tpcompile shards over one mesh dimension; got a 2-D mesh (2, 2); "
                                "pass the tensor-parallel sub-mesh, e.g. mesh['tp']")


def test_world_size_one_is_the_identity_plan():
    (r,) = launch("world_size_one", 1)
    assert r["styles"] == {"replicate"}
    assert r["collectives"] == {"forward": {}, "backward": {}}
    assert r["err"] == 0.0


def test_model_is_left_untouched_and_shares_no_storage():
    for r in launch("untouched_model", 2):
        assert r["changed"] == []
        assert r["shared"] == []
        assert r["keys_equal"]
