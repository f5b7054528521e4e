"""vLLM CPU engine + a separate sender process over gloo: weights of tiny model B pushed into
an engine started on tiny model A give exactly B's outputs (transformers as the reference).

One engine for the whole module (starting one takes ~20 s); the tests run in order and each
states the version it expects to find.
"""

import asyncio
import dataclasses
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from envs.registry import make_env
from gateway import convert as cv
from gateway import messages as m
from models.checkpoints.tiny import make_tiny_checkpoint
from rollout_engine.episode import chat_glue, cut_at_stop
from transport.manifest import Manifest, ManifestError

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _load_helpers():
    path = Path(__file__).with_name("vllm_helpers.py")
    spec = importlib.util.spec_from_file_location("vllm_helpers", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


H = _load_helpers()
PROMPTS = [[1, 5, 9, 23, 7], [1, 40, 41, 42], [1, 17, 3, 99, 100, 12, 8]]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_models")
    a = make_tiny_checkpoint(root / "A", "llama", seed=1)
    b = make_tiny_checkpoint(root / "B", "llama", seed=2)
    for loop, backend, sender in H.engine_world(a):
        hf = {"A": H.hf_model(a), "B": H.hf_model(b)}
        w = {"loop": loop, "backend": backend, "sender": sender, "A": a, "B": b, "hf": hf}
        yield w
        if w["sender"] is not sender:  # replaced by a test
            w["sender"].close()


def run(world, coro):
    return world["loop"].run_until_complete(coro)


def _prompt(sid, tokens, g, **sampling) -> m.Prompt:
    return m.Prompt(sid, np.asarray(tokens, np.int32), g, m.SamplingParams(**sampling))


def greedy(world, prompt, n=12):
    p = _prompt("p", prompt, 1, max_new_tokens=n, temperature=0.0, ignore_eos=True)
    (sample,) = run(world, world["backend"].generate(p))
    return list(sample.token_ids), sample


def push(world, name: str, version: int, bucket_bytes: int, cmd: str = "send"):
    sender, backend = world["sender"], world["backend"]
    manifest = sender.offer(cmd, world[name], version, bucket_bytes)
    try:
        stats = run(world, backend.update_weights(manifest))
    except Exception as e:  # noqa: BLE001 - checked by the caller
        return e, sender.result()
    return stats, sender.result()


def test_serves_model_a_at_version_0(world):
    assert world["backend"].weight_version == 0
    for prompt in PROMPTS:
        tokens, sample = greedy(world, prompt)
        assert tokens == H.hf_greedy(world["hf"]["A"], prompt, 12)
        assert sample.version_spans == ((0, 0, 12),)
        assert sample.finish_reason == "length"


def test_a_turn_ends_at_its_stop_string_inside_the_engine(world):
    """vLLM ends a sample at a stop string, kept in the output: exactly the greedy tokens up
    to the one that completes it (the cut `cut_at_stop` makes), finish "stop", and the
    episode's cut leaves that turn as it is."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(world["A"])

    def decode(ids):
        return tok.decode(list(ids), skip_special_tokens=True)

    tokens, _ = greedy(world, PROMPTS[0], n=16)
    stop = decode(tokens[:9])[-3:]
    k = next(k for k in range(1, 17) if stop in decode(tokens[:k]))
    assert 1 <= k < 16, (stop, k)
    p = _prompt("stop", PROMPTS[0], 1, max_new_tokens=16, temperature=0.0, ignore_eos=True)
    (turn,) = run(world, world["backend"].generate(p, stop_strings=(stop,)))
    assert turn.token_ids.tolist() == tokens[:k]
    assert turn.finish_reason == "stop" and stop in decode(turn.token_ids)
    assert cut_at_stop(turn, decode, (stop,)) is turn
    turn.validate()


def test_a_later_turn_finds_its_history_in_the_prefix_cache(world):
    """The prefix cache is on and hit: a turn continuing a 300-token history (the earlier
    prompt, its 4 sampled tokens and 20 new ones) finds every whole block of what the engine
    computed before (2 blocks of 128 tokens, vLLM's CPU default) in the cache, by vLLM's own
    counters (`rollout_engine.vllm.prefix_cache`)."""
    from rollout_engine.vllm.prefix_cache import prefix_cache_counts

    first = [(7 * i) % 90 + 3 for i in range(276)]
    tokens, _ = greedy(world, first, n=4)
    history = first + tokens + [(5 * i) % 90 + 3 for i in range(20)]
    before = prefix_cache_counts()
    turn = _prompt("turn2", history, 1, max_new_tokens=4, temperature=0.0, ignore_eos=True)
    run(world, world["backend"].generate(dataclasses.replace(turn, continues=True)))
    got = prefix_cache_counts() - before
    assert (got.queries, got.hits) == (300, 256)


def _episode(world, sampling: m.SamplingParams):
    """One countdown episode (3 turns, a real reasoning-gym entry) on the engine serving A,
    played by the worker's episode runner; returns (prompt ids, record, tokenizer)."""
    import reasoning_gym
    from transformers import AutoTokenizer

    from rollout_engine.episode import EpisodeRunner

    tok = AutoTokenizer.from_pretrained(world["A"])
    text = tok.apply_chat_template(
        [{"role": "user", "content": "reach 116"}], tokenize=False, add_generation_prompt=True
    )
    ids = tok.encode(text, add_special_tokens=False)
    entry = reasoning_gym.create_dataset("countdown", size=1, seed=1, min_numbers=3,
                                         max_numbers=3)[0]  # fmt: skip
    episode = m.Episode("countdown", json.dumps({"entry": entry}), 3, 400, 200)
    prompt = m.Prompt("ep", np.asarray(ids, np.int32), 1, sampling, episode=episode)
    (record,) = run(world, EpisodeRunner(str(world["A"])).group(world["backend"].generate, prompt))
    return ids, record, tok, entry


def _turn_starts(record: m.Completion) -> list[int]:
    forced = set(record.forced_positions)
    n = len(record.token_ids)
    return [j for j in range(n) if j not in forced and (j == 0 or j - 1 in forced)]


def test_multi_turn_episode_token_for_token(world):
    """Issue 17 on vLLM: each model turn of a 3-turn episode is transformers' greedy
    continuation of the whole history (as token ids), the observations are the template's ids
    around countdown's feedback, and only the model's tokens are outside the forced mask."""
    greedy_turns = m.SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    prompt_ids, record, tok, entry = _episode(world, greedy_turns)
    starts = _turn_starts(record)
    assert len(starts) == 3 and record.finish_reason == "length"
    ids = record.token_ids.tolist()
    env, glue = make_env("countdown"), chat_glue(tok)  # the feedback replayed on the turns
    env.reset({"entry": entry})
    for k, start in enumerate(starts):
        history = prompt_ids + ids[:start]
        turn = ids[start : start + 6]
        assert turn == H.hf_greedy(world["hf"]["A"], history, 6), k
        feedback = env.step(tok.decode(turn, skip_special_tokens=True)).observation
        if k < 2:
            assert feedback is not None
            want = glue.around(turn, tok.encode(feedback, add_special_tokens=False))
            assert ids[start + 6 : starts[k + 1]] == want, k
            text = tok.decode(want)
            assert text.startswith("<|im_end|>\n<|im_start|>user\n") and text.endswith(
                "<|im_end|>\n<|im_start|>assistant\n"
            )
    model = [j for s in starts for j in range(s, s + 6)]
    assert sorted(set(range(len(ids))) - set(record.forced_positions)) == model


def test_multi_turn_turn_three_logprobs_equal_a_full_forward(world):
    """vLLM's log-probs of turn 3 (T=0.7, sampled after two turns and two observations in its
    prefix cache) equal transformers' forward of the whole sequence within 1e-4."""
    hot = m.SamplingParams(temperature=0.7, max_new_tokens=6, ignore_eos=True, seed=11)
    prompt_ids, record, _, _ = _episode(world, hot)
    third = _turn_starts(record)[2]
    ids = record.token_ids.tolist()
    full = H.hf_logprobs(world["hf"]["A"], prompt_ids, ids, 0.7)
    np.testing.assert_allclose(record.logprobs[third:], full[third:], atol=1e-4, rtol=0)


def test_update_to_b_matches_transformers(world):
    stats, (kind, rest) = push(world, "B", 1, 1 << 20)
    assert kind == "done", rest
    assert json.loads(rest)["version"] == 1 and stats.version == 1
    assert world["backend"].weight_version == 1
    hf_b = world["hf"]["B"]
    for prompt in PROMPTS:
        tokens, sample = greedy(world, prompt)
        assert tokens == H.hf_greedy(hf_b, prompt, 12)
        assert sample.version_spans == ((1, 0, 12),)
    p = _prompt("t", PROMPTS[0], 3, max_new_tokens=16, temperature=0.7, seed=123, ignore_eos=True)
    res = run(world, world["backend"].generate(p))
    assert len(res) == 3
    for s in res:
        ref = H.hf_logprobs(hf_b, PROMPTS[0], list(s.token_ids), 0.7)
        assert max(abs(x - y) for x, y in zip(s.logprobs, ref, strict=True)) < 1e-4


def test_broken_manifest_is_refused_and_engine_keeps_serving(world):
    before = [greedy(world, p)[0] for p in PROMPTS]
    err, (kind, rest) = push(world, "A", 2, 1 << 20, cmd="send_broken")
    assert isinstance(err, ManifestError)
    msg = str(err)
    assert "unknown names ['model.layers.0.self_attn.not_a_proj.weight']" in msg
    assert "missing names" in msg and "shape [3, 5]" in msg
    assert kind == "error" and "refused" in rest
    assert world["backend"].weight_version == 1
    assert [greedy(world, p)[0] for p in PROMPTS] == before


def test_two_versions_back_to_back_end_on_the_second(world):
    stats, (kind, rest) = push(world, "B", 2, 4096)
    assert kind == "done" and json.loads(rest)["buckets"] > 10
    stats, (kind, rest) = push(world, "A", 3, 1 << 16)
    assert kind == "done", rest
    assert world["backend"].weight_version == 3
    for prompt in PROMPTS:
        tokens, sample = greedy(world, prompt)
        assert tokens == H.hf_greedy(world["hf"]["A"], prompt, 12)
        assert sample.version_spans == ((3, 0, 12),)


def test_long_shared_prompt_after_update_uses_new_weights(world):
    prompt = [1] + [(7 * i) % 120 + 4 for i in range(300)]
    tokens_a, _ = greedy(world, prompt, 8)  # fills the prefix cache under A (version 3)
    assert tokens_a == H.hf_greedy(world["hf"]["A"], prompt, 8)
    stats, (kind, rest) = push(world, "B", 4, 1 << 20)
    assert kind == "done", rest
    tokens_b, sample = greedy(world, prompt, 8)
    assert tokens_b == H.hf_greedy(world["hf"]["B"], prompt, 8)
    assert tokens_b != tokens_a
    assert sample.version_spans == ((4, 0, 8),)


def test_requests_in_flight_continue_with_new_weights(world):
    """An update mid-request: the request continues with the new weights, and its version
    spans say where. Timing decides whether an update lands mid-request, so up to five
    pushes (alternating A and B) are tried; at least one must switch, and every outcome must
    match transformers token for token."""
    backend, sender = world["backend"], world["sender"]
    prompt = PROMPTS[1]
    request = _prompt("long", prompt, 1, max_new_tokens=480, temperature=0.0, ignore_eos=True)
    names = {v: "B" if v % 2 == 0 else "A" for v in range(4, 20)}  # 4 is B (the last push)

    async def scenario(version, delay):
        task = asyncio.create_task(backend.generate(request))
        await asyncio.sleep(delay)
        manifest = sender.offer("send", world[names[version]], version, 1 << 20)
        await backend.update_weights(manifest)
        return await task

    switched = 0
    for i, delay in enumerate([0.3, 0.15, 0.6, 0.05, 1.0]):
        version = 5 + i
        res = run(world, scenario(version, delay))
        assert sender.result()[0] == "done"
        (sample,) = res
        tokens, spans = list(sample.token_ids), sample.version_spans
        assert spans[-1][2] == 480 and spans[0][1] == 0
        if len(spans) == 2:
            (v0, _, k), (v1, k1, _) = spans
            assert (v0, v1, k1) == (version - 1, version, k) and 0 < k < 480
            assert (sample.version_start, sample.version_end) == (v0, v1)
            world["crossed"] = (prompt, sample)
            assert tokens[:k] == H.hf_greedy(world["hf"][names[v0]], prompt, k)
            assert tokens[k : k + 8] == H.hf_greedy(world["hf"][names[v1]], prompt + tokens[:k], 8)
            switched += 1
            break
        assert len(spans) == 1
        first = H.hf_greedy(world["hf"][names[spans[0][0]]], prompt, 8)
        assert tokens[:8] == first
    assert switched == 1
    # leave the engine on B at version 10, as the later tests expect
    version = backend.weight_version
    if names[version] != "B":
        stats, (kind, _) = push(world, "B", version + 1, 1 << 20)
        assert kind == "done"
    assert names[backend.weight_version] == "B"


def test_a_request_across_an_update_gives_the_batch_its_per_token_versions(world):
    """The completion that crossed an update (previous test), through the proto and back as
    the gateway hands it to the trainer, into an `RLBatch`: the per-token versions are its two
    spans at their exact loss positions, -1 at the prompt and the padding."""
    from trainer.batch import NO_VERSION, build_rl_batch
    from trainer.rollouts import RolloutGroup

    prompt, sample = world["crossed"]
    (v0, _, k), (v1, _, end) = sample.version_spans
    fetched = cv.completion_from_pb(cv.completion_to_pb(sample))
    assert fetched.version_spans == sample.version_spans
    group = RolloutGroup("long", prompt, [dataclasses.replace(fetched, reward=1.0)])
    batch = build_rl_batch([group], version=v1)
    p, length = len(prompt), batch.length
    want = np.full(length, NO_VERSION, np.int32)
    want[p - 1 : p - 1 + k] = v0
    want[p - 1 + k : p - 1 + end] = v1
    assert batch.token_versions.shape == (1, length) and batch.token_versions.dtype == np.int32
    np.testing.assert_array_equal(batch.token_versions[0], want)
    assert (batch.version_start[0], batch.lag[0]) == (v0, 1)
    np.testing.assert_array_equal(batch.loss_mask[0] > 0, want != NO_VERSION)


def test_file_transport_update(world, tmp_path):
    from safetensors.torch import load_file

    from transport.file import FileSender

    backend = world["backend"]
    run(world, backend.connect_transport({"kind": "file", "root": str(tmp_path), "timeout_s": 30}))
    state = load_file(str(world["B"] / "model.safetensors"))
    man = Manifest.of(0, [(n, tuple(t.shape)) for n, t in state.items()], "float32", 1 << 16)
    man = man.__class__(backend.weight_version + 1, man.tensors, man.bucket_bytes)
    FileSender(tmp_path).send(man, state.items())
    stats = run(world, backend.update_weights(man))
    assert stats.version == man.version and backend.weight_version == man.version
    for prompt in PROMPTS:
        assert greedy(world, prompt)[0] == H.hf_greedy(world["hf"]["B"], prompt, 12)


def test_file_deltas_update_the_engine_exactly(world, tmp_path):
    """The file data plane with delta=true (`transport.file_delta`): a keyframe of A, then B
    and A again as XOR deltas; after each, vLLM's greedy tokens are transformers' own."""
    import json

    from safetensors.torch import load_file

    from transport.file import version_dir
    from transport.file_delta import CHAIN, DeltaFileSender

    backend = world["backend"]
    cfg = {"kind": "file", "root": str(tmp_path), "timeout_s": 30, "delta": True}
    run(world, backend.connect_transport(cfg))
    sender = DeltaFileSender(tmp_path, keep=3)
    first = backend.weight_version + 1
    for version, name in enumerate(("A", "B", "A"), start=first):
        state = load_file(str(world[name] / "model.safetensors"))
        man = Manifest.of(
            version, [(n, tuple(t.shape)) for n, t in state.items()], "float32", 1 << 16
        )
        sent = sender.send(man, state.items())
        stats = run(world, backend.update_weights(man))
        assert stats.version == version == backend.weight_version
        for prompt in PROMPTS:
            assert greedy(world, prompt)[0] == H.hf_greedy(world["hf"][name], prompt, 12)
        chain = json.loads((version_dir(tmp_path, version) / CHAIN).read_text())
        assert chain["base"] == (None if version == first else version - 1)
        assert sent.wire_bytes == sum(chain["stored_bytes"])


def test_shm_update_serves_what_a_gloo_update_serves(world):
    """The shm data plane (`transport.shm`): B through a shared-memory segment serves, token
    for token and log-prob for log-prob, what B over gloo serves; a stale segment (another
    version's bytes) is refused and the engine keeps serving the version it holds."""
    import os
    import shutil

    from safetensors.torch import load_file

    from transport.shm import ShmSender, segment_path

    backend = world["backend"]
    world["sender"].close()
    world["sender"] = gloo = H.Sender()
    run(world, backend.connect_transport(_gloo(gloo)))
    v = backend.weight_version + 1
    stats, (kind, rest) = push(world, "B", v, 1 << 16)
    assert kind == "done", rest
    sampled = _prompt("s", PROMPTS[2], 2, max_new_tokens=12, temperature=0.7, seed=7)

    def served():
        tokens = [greedy(world, p)[0] for p in PROMPTS]
        samples = run(world, backend.generate(sampled))
        return tokens, [(list(x.token_ids), list(x.logprobs)) for x in samples]

    over_gloo = served()
    stats, (kind, rest) = push(world, "A", v + 1, 1 << 20)  # the shm push must change them
    assert kind == "done", rest
    assert served()[0] != over_gloo[0]
    root = f"/dev/shm/jaxrl-test-{os.getpid()}"
    run(world, backend.connect_transport({"kind": "shm", "root": root, "timeout_s": 20}))
    sender = ShmSender(root)
    try:
        state = load_file(str(world["B"] / "model.safetensors"))
        shapes = [(n, tuple(t.shape)) for n, t in state.items()]
        man = Manifest.of(v + 2, shapes, "float32", 1 << 16)
        assert sender.send(man, state.items()).num_buckets == len(man.buckets()) > 5
        assert run(world, backend.update_weights(man)).version == v + 2
        assert served() == over_gloo  # exact: the same bytes loaded
        os.rename(segment_path(root, v + 2), segment_path(root, v + 3))
        with pytest.raises(Exception, match="stale segment: it holds version"):
            run(world, backend.update_weights(dataclasses.replace(man, version=v + 3)))
        assert backend.weight_version == v + 2
        assert served() == over_gloo
    finally:
        sender.close()  # v + 2 (renamed away) is not there to unlink: the renamed file stays
        shutil.rmtree(root, ignore_errors=True)


def test_sender_dying_mid_update_stops_serving_until_a_whole_version(world):
    backend = world["backend"]
    world["sender"].close()
    world["sender"] = sender = H.Sender()
    run(world, backend.connect_transport(_gloo(sender, timeout_s=10)))
    version = backend.weight_version + 1
    manifest = sender.offer("send_partial", world["A"], version, 4096)
    with pytest.raises(Exception, match=f"receiving version {version} failed"):
        run(world, backend.update_weights(manifest))
    assert sender.result()[0] == "dying"
    assert backend.weight_version is None
    with pytest.raises(RuntimeError, match="no whole weight version"):
        greedy(world, PROMPTS[0])
    world["sender"] = sender = H.Sender()
    run(world, backend.connect_transport(_gloo(sender)))
    stats, (kind, rest) = push(world, "A", version + 1, 1 << 20)
    assert kind == "done", rest
    assert backend.weight_version == version + 1
    for prompt in PROMPTS:
        assert greedy(world, prompt)[0] == H.hf_greedy(world["hf"]["A"], prompt, 12)


def _gloo(sender, timeout_s=120):
    return {"kind": "gloo", "host": "127.0.0.1", "port": sender.port, "timeout_s": timeout_s}
