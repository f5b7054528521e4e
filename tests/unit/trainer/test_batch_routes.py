"""`RLBatch.routes`: each completion's routes land on its row's first S - 1 positions (prompt
included), -1 elsewhere; rows that do not fit the prompt and completion are refused; a config
asking for routes where they cannot come is refused at the config check."""

import numpy as np
import pytest

from gateway.messages import Completion
from trainer.batch import NO_ROUTE, build_rl_batch
from trainer.config import ConfigError, load_config
from trainer.rollouts import RolloutGroup


def _completion(n: int, routes) -> Completion:
    return Completion(np.arange(1, n + 1), np.full(n, -1.0), "stop", 0, 0,
                      routed_experts=routes, reward=float(n % 2))  # fmt: skip


def test_routes_fill_the_rows_first_positions_and_minus_one_elsewhere():
    r0 = np.arange(4 * 2 * 2).reshape(4, 2, 2)  # prompt 3 + completion 2 - 1 rows
    group = RolloutGroup("g", [7, 8, 9], [_completion(2, r0), _completion(3, None)])
    batch = build_rl_batch([group], pad_id=0)
    assert batch.routes is not None and batch.routes.shape == (2, 8, 2, 2)
    np.testing.assert_array_equal(batch.routes[0, :4], r0)
    assert (batch.routes[0, 4:] == NO_ROUTE).all() and (batch.routes[1] == NO_ROUTE).all()
    assert build_rl_batch([RolloutGroup("h", [7], [_completion(2, None)])]).routes is None


def test_routes_that_do_not_fit_are_refused():
    with pytest.raises(ValueError, match=r"must have prompt \+ completion - 1 = 4 rows; got 2"):
        RolloutGroup("g", [7, 8, 9], [_completion(2, np.zeros((2, 2, 2)))])
    a = RolloutGroup("a", [7], [_completion(2, np.zeros((1 + 2 - 1, 2, 2)))])
    b = RolloutGroup("b", [7], [_completion(2, np.zeros((1 + 2 - 1, 3, 2)))])
    with pytest.raises(ValueError, match=r"routes of different \[layers, k\]"):
        build_rl_batch([a, b])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["loss.routing_replay=engine", "rollout.backend=jax", "rollout.env=calculator"],
         "multi-turn episodes"),
    ],
)  # fmt: skip
def test_a_config_asking_for_routes_where_none_can_come_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=overrides)
    assert load_config(overrides=["loss.routing_replay=engine", "rollout.backend=jax"]).wants_routes
    # either engine, scanned and rematerialised layers: routes come and go through them
    for more in (["rollout.backend=vllm"], ["model.scan_layers=true", "model.remat=full"]):
        assert load_config(overrides=["loss.routing_replay=engine", *more]).wants_routes
    assert not load_config().wants_routes


def test_a_job_asking_for_routes_from_several_trainers_is_refused():
    from trainer.launch.commands import engine_argv
    from trainer.launch.job_config import load_job_config

    asked = ["loss.routing_replay=engine"]
    job = load_job_config(
        None, [*asked, "launch.num_engines=2", "launch.engine_backends=[jax, vllm]"]
    )
    argv = engine_argv(job, 1, "127.0.0.1:1", "tok", "m", 64)
    assert argv[argv.index("--vllm-return-routes") + 1] == "true"  # the vLLM engine records
    with pytest.raises(ConfigError, match="need launch.trainer_processes=1"):
        load_job_config(None, [*asked, "launch.trainer_processes=2"])
