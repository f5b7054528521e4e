"""Generated tokens per second of the JAX engine and of vLLM on the same model, prompts and
sampling, in the same run (the ratios); and the JAX engine's decode step time against its
roofline.

Measured, in this order, each on the same `--prompts` random prompts of 16 to 64 token ids
(seeded), `--samples` samples each at temperature 1, EOS ignored (every sample exactly
`--max-tokens` long), after an untimed warm-up; tokens/s = generated tokens / wall seconds of
one pass over all prompts submitted at once:

- ``jax``: the JAX engine (`JaxEngine`, `--slots` slots, `--dtype`, default fp32: JAX computes
  faster in fp32 on this CPU); warm-up: the same workload (it compiles every bucket).
  128 slots by default, as vLLM too runs well over 64 of the 256 samples at once: measured on
  the default workload on a 2-core AMD EPYC (AVX2), 205 tokens/s and a 601 ms step of 128
  rows (0.51 of its roofline) against 172 tokens/s and a 440 ms step of 64 rows (0.43); with
  the two-level sampler (`rollout_engine.jax.sampling.draw_logprob`), 220 tokens/s and a
  565 ms step of 128 rows (0.56).
- ``vllm``: the project's vLLM backend (`VllmBackend`: in-process `AsyncLLM`, processed
  log-probs returned, prefix caching, eager), once per `--vllm-dtypes` (default bf16 and fp32);
  warm-up: every prompt with 16 new tokens.
- ``bare``: `vllm.LLM(...).generate` directly, bf16, the same prompts and sampling (log-probs
  of the sampled tokens asked for too, as the backend does): the reference of the backend.
- ``bridge``: vLLM bf16 as the main job runs it: a gateway process and an engine process
  (``python -m rollout_engine --backend vllm``), this process submitting the prompts and
  fetching the groups over gRPC as the trainer does (`run_bridge`);
  ``bridge_over_bare_vllm`` is its tokens/s over bare's.

Each measurement (the JAX engine on one workload, vLLM in one dtype on one workload, bare,
bridge) runs in a fresh child process of this script (`measure_in_child`), one after another,
so no engine measures beside another's threads, compiled programs or held memory: in one
process, the JAX engine's eval figure after the random workload and vLLM was 153.0 tokens/s
against 199.3 measured alone (2-core AMD EPYC, avx512_bf16). ``--in-process`` runs them all
in this process as before.

Every vLLM engine runs with `common.CPU_ENV` (1 GiB KV cache, OpenMP threads bound to cores
0-1, no core reserved) and is shut down, its processes gone, before the next starts.
Without those variables vLLM's "auto" binding reserves one of the 2 cores for its scheduler
and computes on the other: the backend made 487 tokens/s instead of 744 on the default
workload (bare bf16: 730), and the old warm-up (a whole second pass of the workload) doubled
the wall time on top; `VllmBackend.start` now sets the same defaults itself when they are
missing (`rollout_engine.vllm.backend.cpu_env_defaults`).
In fp32 the same 1 GiB holds half the KV (17,472 tokens on smollm2: 91 of the default 256
sequences at once, against 182 in bf16), which lowers vLLM fp32's figure.

Roofline of the JAX decode step: the bytes one step reads (all weights, plus the whole KV
cache: at this script's cache length of 64 + max_tokens the attention bound,
`BatcherConfig.kv_bucket`, covers every slot) over the memory bandwidth measured in the same
run, and, since a CPU decode step of many rows is compute-bound, its FLOPs (2 per param per
row, plus attention over the whole cache) over the rate of a decode-shaped matmul in the
engine's `--dtype` (bf16 operands accumulated in fp32, as the engine multiplies), the
fastest of 15 calls in the same run; the roofline is the larger of the two and
``roofline_fraction`` = roofline / measured step.

Usage: python benchmarks/rollout_throughput.py [--model smollm2|tiny|HF_DIR]
    [--engines jax,vllm,bare,bridge] [--vllm-dtypes bfloat16,float32] [--prompts 64] [--samples 4]
    [--max-tokens 128] [--slots 128] [--dtype float32] [--kv-dtype auto|bfloat16|float32]
    [--workload random|eval|both]
    [--in-process]

``--workload eval``: the first ``--prompts`` GSM8K problems as the eval job encodes them (chat
template; the file from `trainer.eval.benchmarks.benchmark_file`, so JAXRL_DATA_DIR must name
the folder holding it: nothing is downloaded), one greedy sample each, EOS on, at most
``--max-tokens`` new tokens, on the jax and vllm engines; its keys carry the suffix ``_eval``
(``jax_over_vllm_bf16_eval``, ``jax_over_vllm_fp32_eval``, ``roofline_fraction_eval``).
``--workload both`` runs random then eval in one process (the ratios of one run). The decode
step of the roofline is timed with every slot busy and EOS ignored in both workloads, at the
workload's context length.
Prints one line per measurement, then one JSON object on the last line: tokens/s as
``jax_tokens_per_s``, ``vllm_bf16_tokens_per_s``, ``vllm_fp32_tokens_per_s``,
``bare_vllm_bf16_tokens_per_s``, ``bridge_vllm_bf16_tokens_per_s``, the ratios
``jax_over_vllm_bf16``, ``jax_over_vllm_fp32``, ``backend_over_bare_vllm_bf16``,
``bridge_over_bare_vllm``, and the JAX step and roofline figures (seconds, bytes, FLOP/s,
GB/s).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Literal, cast

import jax
import jax.numpy as jnp
import numpy as np
from common import CPU_ENV, model_path
from flax import nnx

from models.checkpoints.hf_io import load_hf_checkpoint
from rollout_engine.jax.batcher import BatcherConfig, ContinuousBatcher
from rollout_engine.jax.engine import EngineConfig, JaxEngine
from rollout_engine.jax.sampling import SamplingConfig
from rollout_engine.jax.stops import StopConfig
from rollout_engine.jax.types import Request


@dataclasses.dataclass(frozen=True)
class Workload:
    """One workload of the run: `prompts` (token ids) with `samples` samples each, at
    `temperature` (0: greedy), `max_new` new tokens at most, EOS ignored or not, in a context
    of `max_len` tokens. `suffix` names its keys in the JSON line ("" or "_eval")."""

    name: str
    prompts: list[tuple[int, ...]]
    samples: int
    temperature: float
    ignore_eos: bool
    max_new: int
    max_len: int
    suffix: str


def random_workload(vocab: int, args) -> Workload:
    """``--prompts`` random prompts (`make_prompts`), ``--samples`` each at temperature 1,
    EOS ignored, exactly ``--max-tokens`` new tokens."""
    prompts = make_prompts(args.prompts, vocab)
    return Workload("random", prompts, args.samples, 1.0, True, args.max_tokens,
                    64 + args.max_tokens, "")  # fmt: skip


def eval_workload(path: Path, args) -> Workload:
    """The first ``--prompts`` GSM8K problems as the eval job encodes them (the chat template,
    `eval_throughput.load_problems`: the file from `trainer.eval.benchmarks.benchmark_file`,
    under JAXRL_DATA_DIR), one greedy sample each, EOS on, at most ``--max-tokens`` new tokens.

    Raises:
      FileNotFoundError: the GSM8K file is not on disk (its message says where to put it).
    """
    from eval_throughput import load_problems
    from transformers import AutoTokenizer

    from trainer.launch.data import make_encoder

    encode = make_encoder(AutoTokenizer.from_pretrained(str(path)), None)
    prompts = [tuple(encode(p)) for p in load_problems(["gsm8k"], [args.prompts])["gsm8k"]]
    max_len = max(map(len, prompts)) + args.max_tokens
    return Workload("eval", prompts, 1, 0.0, False, args.max_tokens, max_len, "_eval")


def make_prompts(n: int, vocab: int, seed: int = 0) -> list[tuple[int, ...]]:
    """``n`` random prompts of 16 to 64 tokens (ids 1 to vocab-1), seeded."""
    rng = np.random.default_rng(seed)
    return [
        tuple(int(t) for t in rng.integers(1, vocab, int(rng.integers(16, 65)))) for _ in range(n)
    ]


def memory_bandwidth(nbytes: int = 1 << 28, repeats: int = 5) -> float:
    """Bytes per second (read + write) of the faster of a numpy copy and a JAX elementwise pass
    over ``nbytes``, each the median of ``repeats``: the bandwidth a decode step could reach."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    x = jnp.asarray(src)
    f = jax.jit(lambda a: a * 1.0001)
    f(x).block_until_ready()
    best = 0.0
    for run in (lambda: np.copyto(dst, src), lambda: f(x).block_until_ready()):
        run()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            run()
            times.append(time.perf_counter() - t)
        best = max(best, 2 * nbytes / statistics.median(times))
    return best


def run_jax(path: Path, w: Workload, args) -> dict[str, float]:
    """Tokens/s of the JAX engine on workload `w` (after a warm-up pass of the same
    workload) and its decode step time (every slot busy, EOS ignored)."""
    cfg, model = load_hf_checkpoint(path, dtype=args.dtype)
    params = nnx.split(model)[1]
    prompts, max_len = w.prompts, w.max_len
    kv_dtype = None if args.kv_dtype == "auto" else args.kv_dtype
    bcfg = BatcherConfig(num_slots=args.slots, max_len=max_len, prefill_batch=8, steps_per_call=64,
                         kv_cache_dtype=kv_dtype)  # fmt: skip
    never = StopConfig(eos_ids=(cfg.vocab_size,), pad_id=0)  # never sampled: EOS ignored
    eos = tuple(cfg.eos_token_ids)
    stops = never if w.ignore_eos else StopConfig(eos_ids=eos, pad_id=eos[0])
    ecfg = EngineConfig(bcfg, SamplingConfig(temperature=w.temperature), stops)
    reqs = [
        Request(i, p, num_samples=w.samples, max_new_tokens=w.max_new)
        for i, p in enumerate(prompts)
    ]
    with JaxEngine(cfg, params, ecfg) as engine:
        engine.generate(
            [Request(f"w{r.prompt_id}", r.prompt, r.num_samples, r.max_new_tokens) for r in reqs]
        )  # compiles every bucket
        t = time.perf_counter()
        results = engine.generate(reqs)
        wall = time.perf_counter() - t
    tokens = sum(len(r.tokens) for r in results)
    print(f"jax {w.name}: {tokens} tokens in {wall:.2f} s = {tokens / wall:.1f} tokens/s")

    graphdef = nnx.split(model)[0]
    timing = dataclasses.replace(ecfg, stops=never)
    step_s, kv_bytes = decode_step(cfg, graphdef, params, timing, prompts, w.max_new)
    param_bytes = sum(int(x.nbytes) for x in jax.tree.leaves(params))
    print(f"jax decode step {step_s * 1e3:.2f} ms")
    b_, s_ = args.slots, max_len
    flops = 2 * sum(int(x.size) for x in jax.tree.leaves(params)) * b_
    flops += 4 * b_ * s_ * cfg.num_heads * cfg.head_dim * cfg.num_layers  # q·k and p·v
    return {
        "jax_tokens_per_s": tokens / wall,
        "decode_step_s": step_s,
        "param_bytes": param_bytes,
        "kv_bytes": kv_bytes,
        "step_flops": flops,
        "matmul_flops_per_s": matmul_rate(args.slots, cfg.hidden_size, cfg.vocab_size, args.dtype),
    }


def decode_step(cfg, graphdef, params, ecfg: EngineConfig, prompts, max_tokens: int):
    """(seconds of one decode step with every slot busy, bytes of the KV cache): one long
    sample per slot of `ecfg.batcher`, decoded in calls of (max_tokens - 2) // 6 steps; the
    median over the calls after the first (which fills the slots and compiles) of each call's
    seconds per step. The median, because a call whose attention bound (`kv_bucket`) is new
    compiles its loop inside the call: one call of two timed before counted a compile
    (about 2 s) as decode, 60-70 ms a step at SmolLM2 bf16."""
    per_call = max((max_tokens - 2) // 6, 1)
    timing = dataclasses.replace(ecfg.batcher, steps_per_call=per_call)
    assert ecfg.stops is not None, "the benchmark engines set their stops (EOS ignored)"
    b = ContinuousBatcher(cfg, graphdef, params, timing, ecfg.sampling, ecfg.stops)
    slots = ecfg.batcher.num_slots
    b.submit([Request(f"s{i}", prompts[i % len(prompts)], 1, max_tokens) for i in range(slots)])
    b.step()
    seconds: list[float] = []
    while b.decode_steps + per_call < max_tokens - 1:  # every slot stays busy through the call
        steps0, t = b.decode_steps, time.perf_counter()
        b.step()
        jax.block_until_ready(b.state)
        seconds.append((time.perf_counter() - t) / max(b.decode_steps - steps0, 1))
    step_s = statistics.median(seconds) if seconds else float("nan")
    return step_s, sum(int(x.nbytes) for x in jax.tree.leaves(b.state.cache))


def matmul_rate(b: int, d: int, v: int, dtype: str = "float32", repeats: int = 15) -> float:
    """FLOP/s of a decode-shaped matmul ``[b, d] x [d, v]`` in JAX, the fastest of `repeats`
    calls (the rate this host reached at least once in this run: a roofline's reference is
    the attainable peak; the median of 5 read 250 and 346 GFLOP/s within one run on a
    2-core AMD EPYC with avx512_bf16), its operands in `dtype` and accumulated in float32,
    as the engine's projections multiply (`models.layers.project`): the compute rate of the
    engine's own dtype (on that host about 280-370 GFLOP/s in bf16 against 160 in fp32)."""
    x = jnp.ones((b, d), dtype)
    w = jnp.ones((d, v), dtype)
    f = jax.jit(partial(jnp.dot, preferred_element_type=jnp.float32))
    f(x, w).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(x, w).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * b * d * v / best


VllmDtype = Literal["bfloat16", "float16", "float32"]
SHORT = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}
#: New tokens of each sample in a vLLM warm-up pass (every prompt, every sample).
WARMUP_TOKENS = 16


def wait_children_gone(timeout: float = 60.0) -> None:
    """Wait until this process has no child processes left but multiprocessing's resource
    tracker (a vLLM engine's EngineCore and workers gone), so the next engine starts on freed
    memory; says so if some are still there after `timeout` seconds."""
    import psutil

    def left() -> list[psutil.Process]:
        kids = []
        for p in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if "resource_tracker" not in " ".join(p.cmdline()):
                    kids.append(p)
        return kids

    deadline = time.monotonic() + timeout
    while (kids := left()) and time.monotonic() < deadline:
        time.sleep(0.5)
    if kids:
        print(f"warning: vLLM processes still running after shutdown: {kids}")


def run_vllm(path: Path, w: Workload, dtype: VllmDtype) -> float:
    """Tokens/s of the project's vLLM backend in `dtype` on workload `w` (after a short
    warm-up pass)."""
    prompts = w.prompts
    from gateway import messages as m
    from rollout_engine.vllm.backend import VllmBackend, VllmBackendConfig

    def prompt(sid: str, tokens, max_new: int) -> m.Prompt:
        sampling = m.SamplingParams(
            max_new_tokens=max_new, temperature=w.temperature, ignore_eos=w.ignore_eos
        )
        return m.Prompt(sid, np.asarray(tokens, np.int32), w.samples, sampling)

    async def go() -> float:
        backend = VllmBackend(
            VllmBackendConfig(model=str(path), dtype=dtype, max_model_len=w.max_len)
        )
        try:
            await backend.start()
            await asyncio.gather(
                *(
                    backend.generate(prompt(f"w{i}", p, WARMUP_TOKENS))
                    for i, p in enumerate(prompts)
                )
            )
            t = time.perf_counter()
            groups = await asyncio.gather(
                *(backend.generate(prompt(f"p{i}", p, w.max_new)) for i, p in enumerate(prompts))
            )
            wall = time.perf_counter() - t
        finally:
            await backend.shutdown()
        tokens = sum(len(s.token_ids) for g in groups for s in g)
        print(
            f"vllm {dtype} {w.name}: {tokens} tokens in {wall:.2f} s = {tokens / wall:.1f} tokens/s"
        )
        return tokens / wall

    tps = asyncio.run(go())
    wait_children_gone()
    return tps


def run_bare_vllm(path: Path, prompts, args, dtype: VllmDtype = "bfloat16") -> float:
    """Tokens/s of `vllm.LLM.generate` itself on the same prompts and sampling (the
    reference of the backend), after the same warm-up pass."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=str(path), dtype=dtype, enforce_eager=True, max_model_len=64 + args.max_tokens, seed=0
    )
    try:
        token_prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]

        def params(max_new: int) -> SamplingParams:
            return SamplingParams(
                n=args.samples,
                max_tokens=max_new,
                temperature=1.0,
                ignore_eos=True,
                logprobs=0,  # the sampled token's log-prob, as the backend asks
                detokenize=False,
            )

        llm.generate(token_prompts, params(WARMUP_TOKENS), use_tqdm=False)
        t = time.perf_counter()
        outs = llm.generate(token_prompts, params(args.max_tokens), use_tqdm=False)
        wall = time.perf_counter() - t
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    print(f"bare vllm {dtype}: {tokens} tokens in {wall:.2f} s = {tokens / wall:.1f} tokens/s")
    wait_children_gone()
    return tokens / wall


def run_bridge(path: Path, prompts, args, dtype: VllmDtype = "bfloat16") -> float:
    """Tokens/s of vLLM through the bridge: a gateway process and a ``python -m
    rollout_engine --backend vllm`` process (`stack.engine_stack`: leases, the worker loop,
    returns over gRPC), this process as the trainer submitting every prompt as one group of
    `--samples` and fetching the groups; the same prompts and sampling, after the same
    warm-up pass. The engine takes every prompt at once (``--max-concurrent-prompts``)."""
    from stack import engine_stack

    from gateway import messages as m
    from mappings.registry import family_for_model_type

    def submit(trainer, tag: str, max_new: int) -> int:
        sampling = m.SamplingParams(max_new_tokens=max_new, temperature=1.0, ignore_eos=True)
        batch = [m.Prompt(f"{tag}{i}", np.asarray(p, np.int32), args.samples, sampling)
                 for i, p in enumerate(prompts)]  # fmt: skip
        trainer.submit_prompts(batch, timeout_s=60.0)
        tokens, groups = 0, 0
        while groups < len(batch):
            for g in trainer.fetch_rollouts(len(batch), timeout_s=600.0):
                groups += 1
                tokens += sum(len(c.token_ids) for c in g.completions)
        return tokens

    family = family_for_model_type(json.loads((path / "config.json").read_text())["model_type"])
    engine_args = ("--max-concurrent-prompts", str(len(prompts)))
    with tempfile.TemporaryDirectory() as work:
        with engine_stack(
            Path(work), path, family, dtype, 64 + args.max_tokens, engine_args=engine_args
        ) as (trainer, _):
            submit(trainer, "w", WARMUP_TOKENS)
            t = time.perf_counter()
            tokens = submit(trainer, "p", args.max_tokens)
            wall = time.perf_counter() - t
    print(f"bridge vllm {dtype}: {tokens} tokens in {wall:.2f} s = {tokens / wall:.1f} tokens/s")
    wait_children_gone()
    return tokens / wall


def measure(
    spec: str, path: Path, workloads: dict[str, Workload], prompts: list[tuple[int, ...]], args
) -> dict[str, float]:
    """One measurement of the run, named by `spec`: ``jax:<workload>`` (`run_jax`'s figures),
    ``vllm:<dtype>:<workload>``, ``bare`` or ``bridge`` on the random `prompts`
    (``{"tokens_per_s": ...}``)."""
    kind, *rest = spec.split(":")
    if kind == "jax":
        return run_jax(path, workloads[rest[0]], args)
    os.environ.update(CPU_ENV)
    if kind == "vllm":
        return {"tokens_per_s": run_vllm(path, workloads[rest[1]], cast(VllmDtype, rest[0]))}
    if kind == "bare":
        return {"tokens_per_s": run_bare_vllm(path, prompts, args)}
    if kind == "bridge":
        return {"tokens_per_s": run_bridge(path, prompts, args)}
    raise ValueError(f"unknown measurement {spec!r}")


#: The line a child process prints its figures on (`--child`), then JSON.
CHILD_MARK = "ROLLOUT_THROUGHPUT_CHILD "


def measure_in_child(spec: str) -> dict[str, float]:
    """`measure(spec)` in a fresh Python process (this script with ``--child spec`` and this
    run's other arguments): each engine starts on a machine with no other engine's threads,
    caches, compiled programs or freed-but-held memory around, whatever ran before it.

    Raises:
        RuntimeError: the child failed or printed no figures (its output's tail is in the
            message).
    """
    argv = list(sys.argv[1:])
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), *argv, "--child", spec],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False,
    )  # fmt: skip
    lines = proc.stdout.splitlines()
    for line in lines:
        if not line.startswith(CHILD_MARK):
            print(line, flush=True)
    marked = [line for line in lines if line.startswith(CHILD_MARK)]
    if proc.returncode != 0 or not marked:
        tail = "\n".join(lines[-20:])
        raise RuntimeError(f"measurement {spec} exited {proc.returncode}:\n{tail}")
    return json.loads(marked[-1][len(CHILD_MARK) :])


def main() -> None:
    """Runs the engines asked for and prints the figures and ratios as JSON on the last line."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2")
    parser.add_argument(
        "--engines", default="jax,vllm,bare,bridge", help="any of jax, vllm, bare, bridge"
    )
    parser.add_argument("--vllm-dtypes", default="bfloat16,float32")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--slots", type=int, default=128)
    parser.add_argument("--dtype", default="float32", help="the JAX engine's dtype")
    parser.add_argument(
        "--kv-dtype", default="auto", choices=("auto", "bfloat16", "float32"),
        help="the JAX engine's KV cache dtype (auto: --dtype); float32 with a bfloat16 "
        "cache keeps float32 matmuls and reads the cache by the native kernel",
    )  # fmt: skip
    parser.add_argument(
        "--workload",
        default="random",
        choices=("random", "eval", "both"),
        help="random: random prompts, EOS ignored; eval: GSM8K prompts, greedy, EOS on "
        "(keys suffixed _eval; bare and bridge run on random only); both: one after the other",
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="run every measurement in this process, one after another (default: each in a "
        "fresh child process)",
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.max_tokens < 24:
        parser.error("--max-tokens must be >= 24 (the step timing runs 16 decode steps)")
    engines = set(args.engines.split(","))
    known = {"jax", "vllm", "bare", "bridge"}
    if engines - known:
        parser.error(f"unknown engines {sorted(engines - known)}")
    vllm_dtypes = [cast(VllmDtype, d) for d in args.vllm_dtypes.split(",")]
    if set(vllm_dtypes) - set(SHORT):
        parser.error(f"--vllm-dtypes: each of {sorted(SHORT)}")
    with tempfile.TemporaryDirectory() as tmp:
        path = model_path(args.model, Path(tmp))
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        # a child builds only its own workload (the last field of its spec, if any)
        wanted = {"random", "eval"} if args.workload == "both" else {args.workload}
        if args.child is not None:
            wanted &= {args.child.split(":")[-1]}
        workloads: dict[str, Workload] = {}
        if "random" in wanted:
            workloads["random"] = random_workload(vocab, args)
        if "eval" in wanted:
            workloads["eval"] = eval_workload(path, args)
        prompts = make_prompts(args.prompts, vocab)
        if args.child is not None:
            figures = measure(args.child, path, workloads, prompts, args)
            print(CHILD_MARK + json.dumps(figures), flush=True)
            return
        run = (
            (lambda spec: measure(spec, path, workloads, prompts, args))
            if args.in_process
            else measure_in_child
        )
        out: dict[str, object] = {
            "model": args.model,
            "jax_dtype": args.dtype,
            "jax_kv_dtype": args.dtype if args.kv_dtype == "auto" else args.kv_dtype,
            "workload": args.workload,
            "prompts": args.prompts,
            "samples": args.samples,
            "max_tokens": args.max_tokens,
            "slots": args.slots,
            "isolated": not args.in_process,
        }
        bandwidth = memory_bandwidth() if "jax" in engines else 0.0
        for w in workloads.values():
            x = w.suffix
            if "jax" in engines:
                figures = run(f"jax:{w.name}")
                memory_s = (figures["param_bytes"] + figures["kv_bytes"]) / bandwidth
                compute_s = figures["step_flops"] / figures["matmul_flops_per_s"]
                roofline = max(memory_s, compute_s)
                print(
                    f"{w.name}: bandwidth {bandwidth / 1e9:.1f} GB/s -> {memory_s * 1e3:.2f} ms; "
                    f"matmul ({args.dtype}) {figures['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s "
                    f"-> {compute_s * 1e3:.2f} ms"
                )
                out.update({k + x: v for k, v in figures.items()})
                out["bandwidth_GBps"] = bandwidth / 1e9
                out["memory_roofline_step_s" + x] = memory_s
                out["compute_roofline_step_s" + x] = compute_s
                out["roofline_step_s" + x] = roofline
                out["roofline_fraction" + x] = roofline / figures["decode_step_s"]
            if engines & {"vllm", "bare", "bridge"}:
                out["vllm_env"] = dict(CPU_ENV)
            tps: dict[str, float] = {}
            if "vllm" in engines:
                for dtype in vllm_dtypes:
                    tps[f"vllm_{SHORT[dtype]}"] = run(f"vllm:{dtype}:{w.name}")["tokens_per_s"]
            if w.name == "random" and "bare" in engines:
                tps["bare_vllm_bf16"] = run("bare")["tokens_per_s"]
            if w.name == "random" and "bridge" in engines:
                tps["bridge_vllm_bf16"] = run("bridge")["tokens_per_s"]
            out.update({f"{k}_tokens_per_s{x}": v for k, v in tps.items()})
            jax_tps = out.get("jax_tokens_per_s" + x)
            for key in ("vllm_bf16", "vllm_fp32", "vllm_fp16"):
                if jax_tps is not None and key in tps:
                    out[f"jax_over_{key}{x}"] = float(jax_tps) / tps[key]  # type: ignore[arg-type]
            if "vllm_bf16" in tps and "bare_vllm_bf16" in tps:
                out["backend_over_bare_vllm_bf16"] = tps["vllm_bf16"] / tps["bare_vllm_bf16"]
            if "bridge_vllm_bf16" in tps and "bare_vllm_bf16" in tps:
                out["bridge_over_bare_vllm"] = tps["bridge_vllm_bf16"] / tps["bare_vllm_bf16"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
