"""`SyncPlan`: the sync directive params round-trip exactly; missing, malformed or mismatched
params and engines outside the group are refused with errors that name what came."""

import pytest

from transport.manifest import Manifest
from transport.sync_plan import FarLeg, SyncPlan, SyncPlanError, is_far_name

MANIFEST = Manifest.of(3, [("a.weight", (4, 2)), ("b.bias", (4,))], "bfloat16", 1024)
TRANSPORT = {"kind": "gloo", "host": "127.0.0.1", "port": 4567, "timeout_s": 60.0}


def test_round_trip():
    plan = SyncPlan(TRANSPORT, MANIFEST, {"e-1": 1, "e-2": 3}, 5, group=2)
    params = plan.to_params()
    assert sorted(params) == ["group", "manifest", "ranks", "transport", "world_size"]
    assert all(isinstance(v, str) for v in params.values())
    back = SyncPlan.from_params(params, 3)
    assert back == plan
    assert back.version == 3 and back.rank_of("e-2") == 3


def test_missing_and_malformed_params():
    params = SyncPlan(TRANSPORT, MANIFEST, {"e-1": 1}, 2).to_params()
    with pytest.raises(SyncPlanError, match=r"lacks params \['ranks'\]"):
        SyncPlan.from_params({k: v for k, v in params.items() if k != "ranks"}, 3)
    with pytest.raises(SyncPlanError, match="malformed sync directive params"):
        SyncPlan.from_params({**params, "manifest": "{not json"}, 3)
    with pytest.raises(SyncPlanError, match="targets version 4, its manifest is of version 3"):
        SyncPlan.from_params(params, 4)
    with pytest.raises(SyncPlanError, match="transport: expected a JSON object"):
        SyncPlan.from_params({**params, "transport": "[1]"}, 3)


def test_ranks_and_membership():
    with pytest.raises(SyncPlanError, match=r"ranks: expected 1\.\.1, got \{'e-1': 2\}"):
        SyncPlan(TRANSPORT, MANIFEST, {"e-1": 2}, 2)
    with pytest.raises(SyncPlanError, match="world_size: expected >= 2, got 1"):
        SyncPlan(TRANSPORT, MANIFEST, {}, 1)
    with pytest.raises(SyncPlanError, match="expected a dict with a 'kind'"):
        SyncPlan({"host": "x"}, MANIFEST, {"e-1": 1}, 2)
    plan = SyncPlan(TRANSPORT, MANIFEST, {"e-1": 1}, 2)
    with pytest.raises(SyncPlanError, match="engine 'e-9' is not in the data-plane group"):
        plan.rank_of("e-9")


FAR = {"kind": "delta_stream", "host": "10.0.0.1", "port": 29600, "timeout_s": 60.0}
FAR_MANIFEST = Manifest.of(3, [("a.weight", (4, 2)), ("b.bias", (4,))], "bfloat16", 64)


def test_a_mixed_plan_sends_far_engines_to_the_delta_stream_and_the_rest_to_the_group():
    """A mixed plan round-trips with its far leg; an engine registered under a far name (or
    that name and "-HOST") takes the delta stream and the far manifest, any other its group
    rank; ``engine1`` never matches ``engine10``."""
    leg = FarLeg(("engine1",), FAR, FAR_MANIFEST)
    plan = SyncPlan(TRANSPORT, MANIFEST, {"engine0-1": 1}, 2, group=4, far=leg)
    params = plan.to_params()
    assert sorted(params) == ["far", "group", "manifest", "ranks", "transport", "world_size"]
    back = SyncPlan.from_params(params, 3)
    assert back == plan
    assert back.leg("engine1-7", "engine1") == (FAR, FAR_MANIFEST, 1)
    assert back.leg("engine1-far-7", "engine1-far") == (FAR, FAR_MANIFEST, 1)
    assert back.leg("engine0-1", "engine0") == (TRANSPORT, MANIFEST, 1)
    with pytest.raises(SyncPlanError, match="'engine10-9' is not in the data-plane group"):
        back.leg("engine10-9", "engine10")
    assert [is_far_name(n, ("engine1",)) for n in ("engine1", "engine1-x", "engine10", "e1")] == [
        True, True, False, False,
    ]  # fmt: skip
    assert (
        SyncPlan.from_params(SyncPlan(TRANSPORT, MANIFEST, {"e": 1}, 2).to_params(), 3).far is None
    )


def test_a_malformed_or_mismatched_far_leg_is_refused():
    params = SyncPlan(TRANSPORT, MANIFEST, {"e": 1}, 2, far=FarLeg(("e1",), FAR, FAR_MANIFEST))
    good = params.to_params()
    with pytest.raises(SyncPlanError, match="malformed far leg for version 3"):
        SyncPlan.from_params({**good, "far": "{not json"}, 3)
    with pytest.raises(SyncPlanError, match="malformed far leg"):
        SyncPlan.from_params({**good, "far": '{"names": ["e1"]}'}, 3)
    gloo = FarLeg(("e1",), TRANSPORT, FAR_MANIFEST).to_json()
    with pytest.raises(SyncPlanError, match="expected a delta_stream transport"):
        SyncPlan.from_params({**good, "far": gloo}, 3)
    other = FarLeg(("e1",), FAR, Manifest.of(2, [("a.weight", (4, 2))], "bfloat16", 64))
    with pytest.raises(SyncPlanError, match="whole-tensor manifest of version 3, got version 2"):
        SyncPlan.from_params({**good, "far": other.to_json()}, 3)
