"""Every string, bytes, list and map field of every request has a bound; a request one past
it is refused with INVALID_ARGUMENT naming the field and the bound, never echoing the value."""

import numpy as np
import pytest

from gateway import messages as m
from gateway.bounds import RequestBounds
from gateway.config import GatewayConfig, RunSettings
from gateway.errors import GatewayError, clip, shown
from protos import gateway_pb2 as gpb

from .conftest import start_server
from .oversize import cases

SMALL = GatewayConfig(
    max_name_chars=64,
    max_text_chars=11,
    max_task_chars=100,
    max_route_bytes=13,
    max_list_items=3,
    max_prompts_per_call=4,
    max_group_size=5,
    max_prompt_tokens=6,
    max_new_tokens=7,
    max_metric_keys=8,
    max_param_entries=2,
    max_param_bytes=200,
)
SPEC = m.EngineSpec(backend="jax", model_family="llama", dtype="bf16", transports=("gloo",))


def _field(path: str) -> str:
    return path.split(" ")[0].rsplit(".", 1)[1]


def test_every_request_field_is_bounded_at_its_configured_limit():
    bounds = RequestBounds(SMALL)
    all_cases = cases(SMALL)
    methods = {c.method for c in all_cases}
    # all 14 methods but the three whose requests hold only numbers
    assert len(methods) == 11 and not methods & {"FetchRollouts", "WaitSync", "GetStatus"}
    assert len(all_cases) == 58  # an episode's env and task, submitted and returned; routes;
    # the LoRA adapter key of RunSettings and RegisterRequest
    for case in all_cases:
        bounds.check(case.build(case.limit))  # at the bound: accepted
        with pytest.raises(GatewayError) as err:
            bounds.check(case.build(case.limit + 1))
        e = err.value
        expected = f"expected at most {case.limit} {case.unit}, got "
        assert e.code == "INVALID_ARGUMENT" and expected in e.message, (case.path, e.message)
        assert _field(case.path) in e.message and len(e.message) < 200, e.message


def test_param_keys_and_values_are_bounded_together():
    bounds = RequestBounds(SMALL)
    bounds.check(gpb.PublishRequest(params={"ab": "x" * 98, "cd": "y" * 98}))  # 200 chars
    with pytest.raises(GatewayError) as err:
        bounds.check(gpb.PublishRequest(params={"ab": "x" * 98, "cd": "y" * 99}))
    assert err.value.message == (
        "PublishRequest.params (keys and values, the gateway's max_param_bytes): expected at "
        "most 200 characters, got 201"
    )


def test_a_nested_field_is_named_by_its_full_path():
    bounds = RequestBounds(SMALL)
    req = gpb.ReturnRequest(engine_id="e", lease_id="L")
    group = req.groups.add(sample_id="ok")
    req.groups.add(sample_id="ok2").completions.add().token_ids.extend(range(8))
    group.completions.add()
    with pytest.raises(GatewayError) as err:
        bounds.check(req)
    assert err.value.message == (
        "ReturnRequest.groups[1].completions[0].token_ids: expected at most 7 entries, got 8"
    )


def test_shown_and_clip_cut_what_a_message_repeats():
    assert shown("abc") == "'abc'"
    long = shown("x" * 1000)
    assert long == "'" + "x" * 63 + "…(+938 chars)" and len(long) == 77
    assert clip("y" * 5000) == "y" * 999 + "…" and clip("short") == "short"


def test_10mb_fields_over_the_wire_are_refused_in_under_1kb_and_the_server_serves_on():
    run = start_server(GatewayConfig(settings=RunSettings(model_family="llama")))
    huge = "z" * 10_000_000
    try:
        calls = [
            lambda: run.engine.register_engine(
                m.EngineSpec("jax", "llama", "bf16", ("gloo",), name=huge)
            ),
            lambda: run.engine.heartbeat(huge),
            lambda: run.engine.lease_prompts(huge, 1, 0.0),
            lambda: run.engine.return_rollouts("e", "L", [], [huge]),
            lambda: run.engine.ack_version("e", 0, "failed", huge),
            lambda: run.trainer.report_metrics("trainer", 1, {huge: 1.0}),
            lambda: run.trainer.publish_version(1, {"manifest": huge * 2}),
            lambda: run.trainer.submit_prompts([m.Prompt(huge, np.array([1]), 1)]),
            lambda: run.trainer.shutdown(huge),
        ]
        for call in calls:
            with pytest.raises(GatewayError) as err:
                call()
            e = err.value
            assert e.code == "INVALID_ARGUMENT", e
            assert len(e.message.encode()) < 1024 and "z" * 65 not in e.message
        status = run.trainer.status()
        assert status.counters.requests_rejected == len(calls) and not status.shutting_down
        assert run.engine.register_engine(SPEC).engine_id == "jax-1"
    finally:
        run.server.stop(0)


def test_an_unknown_long_id_is_shown_cut():
    run = start_server(GatewayConfig(settings=RunSettings(model_family="llama")))
    try:
        with pytest.raises(GatewayError) as err:
            run.engine.heartbeat("q" * 200)
        assert err.value.code == "NOT_FOUND"
        assert err.value.message.startswith("engine id '" + "q" * 63 + "…(+138 chars)")
    finally:
        run.server.stop(0)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(max_name_chars=63), "max_name_chars: expected >= 64"),
        (
            dict(max_param_bytes=(64 << 20) // 4 + 1),
            "max_param_bytes: expected 0..max_message_bytes / 4",
        ),
        (dict(min_version_ahead=-1), "min_version_ahead: expected >= 0, got -1"),
        (dict(max_metric_sources=0), "max_metric_sources: expected >= 1, got 0"),
        (dict(max_long_polls=-1), "max_long_polls: expected >= 0 (0: derived), got -1"),
    ],
)
def test_bounds_of_the_bounds(kw, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        GatewayConfig(**kw)
    assert GatewayConfig().param_bytes_limit == 4 << 20
