"""`SyncPlan`: the sync directive params round-trip exactly; missing, malformed or mismatched
params and engines outside the group are refused with errors that name what came."""

import pytest

from transport.manifest import Manifest
from transport.sync_plan import SyncPlan, SyncPlanError

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
