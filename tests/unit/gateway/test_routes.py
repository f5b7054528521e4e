"""Routing replay on the wire: a completion's routed experts survive the protos exactly, in
1-byte ids up to 256 experts and 2-byte ids above; rows that do not match prompt + completion
- 1, a bad width or an oversized field is refused with a clear error."""

import numpy as np
import pytest

from gateway import convert as cv
from gateway import messages as m
from gateway.bounds import RequestBounds
from gateway.config import GatewayConfig
from gateway.errors import GatewayError
from gateway.routes import encode_routes
from gateway.validate import check_group
from protos import gateway_pb2 as gpb
from protos import rollout_pb2 as rpb


def _completion(routes: np.ndarray | None, n: int = 3) -> m.Completion:
    return m.Completion(
        np.arange(n, dtype=np.int32), np.full(n, -0.5, np.float32), "stop", 0, 0,
        routed_experts=routes,
    )  # fmt: skip


PROMPT = rpb.Prompt(  # 2 prompt tokens: a 3-token completion has 2 + 3 - 1 = 4 route rows
    sample_id="g", token_ids=[7, 8], group_size=1, sampling=rpb.SamplingParams(max_new_tokens=8)
)


def _check(pb: rpb.Completion) -> None:
    check_group(rpb.RolloutGroup(sample_id="g", completions=[pb]), PROMPT, current_version=0)


@pytest.mark.parametrize(("experts", "width"), [(8, 1), (256, 1), (300, 2)])
def test_routes_round_trip_exactly_with_the_narrowest_id_width(experts, width):
    rng = np.random.default_rng(0)
    routes = rng.integers(0, experts, size=(4, 3, 2)).astype(np.int32)  # [P + T - 1, L, k]
    routes[0, 0] = (experts - 1, 0)
    pb = cv.completion_to_pb(_completion(routes))
    assert (pb.routed_layers, pb.routed_k, pb.routed_id_bytes) == (3, 2, width)
    assert len(pb.routed_experts) == 4 * 3 * 2 * width
    _check(pb)
    back = cv.completion_from_pb(rpb.Completion.FromString(pb.SerializeToString()))
    assert back.routed_experts is not None and back.routed_experts.dtype == np.int32
    np.testing.assert_array_equal(back.routed_experts, routes)


def test_a_dense_completion_carries_no_routes():
    pb = cv.completion_to_pb(_completion(None))
    assert (pb.routed_experts, pb.routed_layers, pb.routed_k, pb.routed_id_bytes) == (b"", 0, 0, 0)
    assert cv.completion_from_pb(pb).routed_experts is None


def test_routes_whose_rows_do_not_match_the_tokens_are_refused():
    pb = cv.completion_to_pb(_completion(np.zeros((3, 2, 2), np.int32)))  # one row short
    with pytest.raises(GatewayError) as err:
        _check(pb)
    assert err.value.code == "INVALID_ARGUMENT"
    assert err.value.message == (
        "group 'g' completion 0: expected routed_experts of [4 tokens (prompt + completion - "
        "1), 2 layers, 2] x 1 bytes = 16 bytes, got 12"
    )
    pb.routed_experts = pb.routed_experts[:-1]  # 11 bytes: not whole rows of 4
    with pytest.raises(GatewayError, match="expected routed_experts of whole rows of"):
        cv.completion_from_pb(pb)


@pytest.mark.parametrize(("layers", "k", "width"), [(0, 2, 1), (2, 0, 1), (2, 2, 3), (2, 2, 0)])
def test_routes_with_bad_counts_or_width_are_refused(layers, k, width):
    pb = cv.completion_to_pb(_completion(None))
    pb.routed_experts, pb.routed_layers, pb.routed_k, pb.routed_id_bytes = (
        b"\0" * 16, layers, k, width,
    )  # fmt: skip
    with pytest.raises(GatewayError, match="routed_id_bytes 1 or 2 with routed experts, got"):
        _check(pb)


def test_a_hostile_routes_size_is_refused_before_it_is_read():
    bounds = RequestBounds(GatewayConfig(max_route_bytes=64))
    data, layers, k, width = encode_routes(np.zeros((8, 4, 2), np.int32))  # 64 bytes
    group = rpb.RolloutGroup(sample_id="g", completions=[rpb.Completion(routed_experts=data)])
    bounds.check(gpb.ReturnRequest(groups=[group]))
    group.completions[0].routed_experts = data + b"\0"
    with pytest.raises(GatewayError) as err:
        bounds.check(gpb.ReturnRequest(groups=[group]))
    assert err.value.message == (
        "ReturnRequest.groups[0].completions[0].routed_experts: expected at most 64 bytes, got 65"
    )


def test_encoding_refuses_ids_no_width_holds():
    with pytest.raises(ValueError, match=r"expert ids must lie in \[0, 65536\)"):
        encode_routes(np.array([[[70000]]]))
    with pytest.raises(ValueError, match="routes must be"):
        encode_routes(np.zeros((3, 2)))
    with pytest.raises(ValueError, match="routed_experts must be"):
        _completion(np.zeros((2, 2), np.int32)).validate()


def test_the_ask_for_routes_survives_the_prompts_trip():
    for ask in (False, True):
        p = m.Prompt("s", np.array([1, 2], np.int32), 2, m.SamplingParams(return_routes=ask))
        assert cv.prompt_from_pb(cv.prompt_to_pb(p)).sampling.return_routes is ask
