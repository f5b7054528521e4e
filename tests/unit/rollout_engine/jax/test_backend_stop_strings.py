"""A turn that meets its stop string ends there inside the JAX engine, through the backend and
the checkpoint's own tokenizer (the twin of the vLLM test
`tests/integration/test_vllm_weight_update.py::test_a_turn_ends_at_its_stop_string_inside_the_engine`):
exactly the greedy tokens up to the one that completes the stop, finish "stop", the episode's
`cut_at_stop` leaves the turn as it is, and the engine decodes no step past it."""

from __future__ import annotations

import asyncio

import numpy as np
from transformers import AutoTokenizer

from gateway import messages as m
from models.checkpoints.tiny import make_tiny_checkpoint
from rollout_engine.episode import cut_at_stop
from rollout_engine.jax.backend import JaxBackend, JaxBackendConfig


def test_a_turn_ends_at_its_stop_string_inside_the_jax_engine(tmp_path) -> None:
    path = make_tiny_checkpoint(tmp_path / "ckpt", "llama")
    tok = AutoTokenizer.from_pretrained(path)

    def decode(ids) -> str:
        return tok.decode(list(ids), skip_special_tokens=True)

    prompt_ids = np.asarray(tok.encode("count to ten", add_special_tokens=False), np.int32)
    greedy = m.SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    cfg = JaxBackendConfig(model=str(path), num_slots=2, max_model_len=64, prefill_batch=1,
                           steps_per_call=64, temperature=0.0, ignore_eos=True)  # fmt: skip

    async def scenario():
        backend = JaxBackend(cfg)
        await backend.start()
        try:
            replica = backend.engine.replicas[0]
            (free,) = await backend.generate(m.Prompt("free", prompt_ids, 1, greedy))
            free_steps = replica.decode_steps
            tokens = free.token_ids.tolist()
            stop = decode(tokens[:9])[-3:]
            (turn,) = await backend.generate(
                m.Prompt("stop", prompt_ids, 1, greedy), stop_strings=(stop,)
            )
            return free, stop, turn, free_steps, replica.decode_steps - free_steps
        finally:
            await backend.shutdown()

    free, stop, turn, free_steps, stop_steps = asyncio.run(scenario())
    tokens = free.token_ids.tolist()
    k = next(k for k in range(1, 17) if stop in decode(tokens[:k]))
    assert 1 <= k < 16, (stop, k)
    assert turn.token_ids.tolist() == tokens[:k]
    assert turn.finish_reason == "stop" and stop in decode(turn.token_ids)
    assert stop not in decode(turn.token_ids[:-1])
    assert cut_at_stop(turn, decode, (stop,)) is turn
    np.testing.assert_allclose(turn.logprobs, free.logprobs[:k], rtol=0, atol=1e-6)
    assert stop_steps == free_steps - (16 - k)  # no decode step past the stop's token
    turn.validate()
