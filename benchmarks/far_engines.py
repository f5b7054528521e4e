"""Far engines fed by compressed deltas over slow links (issue 26 item 5): real training steps
on a cluster in a box, each version handed to the delta stream (`transport.delta_stream`),
two far engines behind 100 and 20 Mbit/s, against the same run on unlimited links and the same
run without far engines.

Three runs, one box (`deploy.local.cluster_box`: hosts ``trainer``, ``far100``, ``far20``):
- ``far``: ``far100``'s link limited to 100 Mbit/s, ``far20``'s to 20 Mbit/s (``tc tbf``);
- ``unlimited``: the same, no rate limit (the kernel's veth pairs);
- ``no_far``: the trainer alone (no sender, no engine): the reference of the trainer's time.
In each, the trainer (on host ``trainer``) runs the project's `TrainStep` (forward, fused
log-probs, GRPO loss, backward, AdamW) in fp32 on `--model` (``smollm2``: SmolLM2-135M-Instruct;
``small``: a random 27M-param Llama; ``tiny``: a random 1M-param Llama, for the test), a fresh
`dense_batch` per step, for `--steps` steps; after each step it copies the params to host and
hands the version (bf16 on the wire) to the `DeltaStreamSender` (listening on the trainer's
address), which returns at once; each far engine (a process on its host) pulls the newest
version above the one it holds, as a delta or a keyframe, rebuilds it bit for bit (SHA-256),
loads it into JAX arrays and asks again. The far engines do not sample: they measure the data
plane and each engine's lag, not rollouts. Version 0 (the checkpoint) reaches every engine
before the first step (the keyframe a new engine gets); after the last step the trainer waits
for every engine to load the last version.

Figures, per link rate (``unlimited``, ``100``, ``20`` Mbit/s): ``full_bf16_bytes`` (a version's
payload), the median bytes and seconds of a delta push and of a keyframe push (request to the
engine's ack: encode, link, rebuild, load), ``encode_s_total`` (the sender's hashing and
encoding for that engine, on the trainer's host), versions loaded and skipped, and the engine's lag
distribution (the trainer's newest version minus the engine's held one, sampled after every
step's hand-over). Per run: ``step_s`` (median loop seconds per step over steps 2..N: train
step, host copy, hand-over) and ``idle_fraction`` (the share of the loop's time over steps
2..N not in the train step); ``far_over_no_far_step_s``, ``far_idle_over_no_far``.

Measured (SmolLM2, 20 steps, lr 1e-5, full_every 10, zstd 3; a 2-core AMD EPYC with AVX-512
and AVX-512 BF16, shared with other jobs; the trainer, both engines and the sender's encoding
share its 2 cores): a version is 269 MB in bf16; a keyframe 192 MB (0.71); a delta 4.6 MB
(0.017) at one version's distance, 7.4 MB (0.027) across skipped versions. A delta push takes
9-12 s from request to ack (3 s of it on the wire at 20 Mbit/s; the rest is encoding, rebuild
and load on the shared cores), a keyframe 12.6 s unlimited, 19.9 s at 100 Mbit/s, 85 s at
20 Mbit/s. Lag (newest minus held, after each hand-over): unlimited always 1; 100 Mbit/s
1 (10 of 20 steps) to 5; 20 Mbit/s 1 (9 of 20) to 11, loading 12 of 21 versions: the periodic
keyframe at version 10 is what holds the slow engine back (the sender's default is now
full_every 0: a keyframe only when an engine holds no kept version; not re-measured yet).
Trainer: 8.9 s per step with the far engines against 7.1 s without (1.27x; its hand-over
0.34 s against 0.18 s; idle fraction 0.041 against 0.024); on unlimited links 11.9 s per
step, as both engines then rebuild every version on the same 2 cores.

Needs root, iproute2 and tc. Run: ``flock /tmp/jaxrl-heavy.lock .venv/bin/python
benchmarks/far_engines.py [--model smollm2] [--steps 20]``. Prints one line per run and per
engine, then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: deploy/ is no package
from deploy.local.cluster_box import ClusterBox  # noqa: E402
from deploy.local.hosts_job import child_env  # noqa: E402

PORT = 47100
"""The delta stream's port on host ``trainer``."""
LINKS = {"far100": 100.0, "far20": 20.0}
"""Far engine hosts and their link rates in Mbit/s in the ``far`` run."""
TINY = dict(
    model_type="llama", vocab_size=2048, hidden_size=128, intermediate_size=384,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-5,
    max_position_embeddings=512,
)  # fmt: skip


def _build(name: str):  # noqa: ANN202 - a Decoder (JAX imported here, in the child only)
    from flax import nnx
    from train_step import build_model

    from models.config import ModelConfig
    from models.decoder import Decoder

    if name == "tiny":
        return Decoder(ModelConfig.from_hf(TINY, dtype="float32"), rngs=nnx.Rngs(0))
    return build_model(name, "float32")


def trainer(args: argparse.Namespace) -> None:
    """Role ``trainer``: train, hand each version to the sender, write the figures to
    `args.out` (JSON)."""
    import jax
    import numpy as np
    from train_step import dense_batch

    from models.params import flat_params
    from models.sharding import make_mesh
    from trainer.losses import make_loss
    from trainer.optim import OptimizerConfig, make_optimizer
    from trainer.train_step import TrainStep
    from transport.delta_stream import DeltaStreamSender
    from transport.manifest import Manifest

    model = _build(args.model)
    tx = make_optimizer(
        OptimizerConfig(learning_rate=args.lr, total_steps=args.steps, max_grad_norm=1.0)
    )
    step = TrainStep(model, make_loss("grpo"), tx, make_mesh(1, 1, devices=jax.devices()[:1]))
    state = step.init_state(model)

    def host() -> dict[str, np.ndarray]:
        return {k: np.asarray(v) for k, v in flat_params(step.model(state)).items()}

    params = host()
    shapes = [(k, v.shape) for k, v in params.items()]

    def manifest(v: int) -> Manifest:
        return Manifest.of(v, shapes, "bfloat16", 64 << 20)

    sender = None
    if args.engines:
        sender = DeltaStreamSender(
            args.bind, PORT, keep=2, full_every=args.full_every, level=args.level, timeout_s=900
        )
    try:
        if sender is not None:
            sender.send(manifest(0), params.items())
            _wait_held(sender, args.engines, 0, args.timeout_s)
        rows: list[dict] = []
        lags: dict[str, list[int]] = {e: [] for e in args.engines}
        for v in range(1, args.steps + 1):
            batch = dense_batch(args.batch, args.seq_len, model.cfg.vocab_size, seed=v)
            t0 = time.perf_counter()
            state, metrics = step(state, batch)
            float(metrics["loss"])
            t1 = time.perf_counter()
            params = host()
            if sender is not None:
                sender.send(manifest(v), params.items())
                for e in sender.engines:
                    name = e.name.split("@")[0]
                    if name in lags and e.dropped is None:
                        lags[name].append(v - (e.holds if e.holds is not None else -1))
            t2 = time.perf_counter()
            rows.append({"version": v, "train_s": t1 - t0, "handoff_s": t2 - t1})
            print(f"step {v}: train {t1 - t0:.2f} s, hand-over {t2 - t1:.3f} s", flush=True)
        catch_up_s = 0.0
        if sender is not None:
            t0 = time.perf_counter()
            _wait_held(sender, args.engines, args.steps, args.timeout_s)
            catch_up_s = time.perf_counter() - t0
            sender.wait_idle(args.timeout_s)
        pushes = [
            {"engine": p.engine.split("@")[0], "version": p.version, "base": p.base,
             "wire_bytes": p.wire_bytes, "seconds": p.seconds, "encode_s": p.encode_s,
             "loaded": p.loaded}
            for p in (sender.pushes if sender else [])
        ]  # fmt: skip
        out = {"rows": rows, "lags": lags, "pushes": pushes, "catch_up_s": catch_up_s,
               "full_bf16_bytes": manifest(0).total_bytes}  # fmt: skip
        Path(args.out).write_text(json.dumps(out))
    finally:
        if sender is not None:
            sender.close()


def _wait_held(sender, engines: list[str], version: int, timeout_s: float) -> None:  # noqa: ANN001
    """Wait until every engine of `engines` holds `version` (its last connection's; an
    engine that loaded it and hung up holds it).

    Raises:
        TimeoutError: one does not after `timeout_s` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        held = {e.name.split("@")[0]: e.holds for e in list(sender.engines)}
        if all(held.get(e) == version for e in engines):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"engines hold {held}, not version {version}, after {timeout_s} s")
        time.sleep(0.05)


def engine(args: argparse.Namespace) -> None:
    """Role ``engine``: pull the newest version until `args.last` is loaded; each version is
    rebuilt, checked and loaded into JAX arrays."""
    import jax.numpy as jnp
    import ml_dtypes
    import torch

    from transport.base import TransferError
    from transport.delta_receiver import DeltaStreamReceiver

    weights: dict[str, object] = {}

    def load(bucket: list[tuple[str, torch.Tensor]]) -> None:
        for n, t in bucket:
            weights[n] = jnp.asarray(t.view(torch.int16).numpy().view(ml_dtypes.bfloat16))

    host, port = args.connect.rsplit(":", 1)
    r = DeltaStreamReceiver(host, int(port), args.name, timeout_s=args.timeout_s)
    deadline = time.monotonic() + args.timeout_s
    try:
        while True:
            try:
                m = r.receive_newest(load)
            except TransferError as e:  # the trainer is still starting: retry until deadline
                if time.monotonic() > deadline or r.held_version is not None:
                    raise
                print(f"{args.name}: waiting for the trainer ({e})", flush=True)
                time.sleep(1.0)
                continue
            print(f"{args.name}: loaded version {m.version}", flush=True)
            if m.version >= args.last:
                return
    finally:
        r.close()


def _run(box: ClusterBox, name: str, rates: dict[str, float | None], args, tmp: Path) -> dict:  # noqa: ANN001
    """One run on `box`: the trainer and one engine per entry of `rates` (host -> Mbit/s or
    None). Returns the trainer's figures; every process is ended on every path."""
    for h in LINKS:
        box.limit_rate(h, rates.get(h))
    me = [sys.executable, str(Path(__file__).resolve())]
    common = ["--timeout-s", str(args.timeout_s)]
    env = child_env(None)
    out = tmp / f"{name}.json"
    procs: list[subprocess.Popen] = []
    try:
        trainer_p = box.popen(
            "trainer",
            [*me, "trainer", "--out", str(out), "--model", args.model, "--steps", str(args.steps),
             "--lr", str(args.lr), "--batch", str(args.batch), "--seq-len", str(args.seq_len),
             "--full-every", str(args.full_every), "--level", str(args.level),
             "--bind", box.address("trainer"), "--engines", *rates, *common],
            env=env,
        )  # fmt: skip
        procs.append(trainer_p)
        for h in rates:
            procs.append(box.popen(h, [*me, "engine", "--name", h, "--connect",
                                       f"{box.address('trainer')}:{PORT}", "--last",
                                       str(args.steps), *common], env=env))  # fmt: skip
        rc = trainer_p.wait(args.timeout_s * 3)
        if rc != 0:
            raise RuntimeError(f"run {name}: the trainer exited with {rc}")
        for p in procs[1:]:
            if p.wait(args.timeout_s) != 0:
                raise RuntimeError(f"run {name}: an engine exited with {p.returncode}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return json.loads(out.read_text())


def _loop(run: dict) -> dict[str, float]:
    rows = run["rows"][1:] or run["rows"]  # step 1 compiles
    wall = sum(r["train_s"] + r["handoff_s"] for r in rows)
    return {"step_s": statistics.median(r["train_s"] + r["handoff_s"] for r in rows),
            "idle_fraction": 1 - sum(r["train_s"] for r in rows) / wall,
            "handoff_s": statistics.median(r["handoff_s"] for r in rows)}  # fmt: skip


def _link(run: dict, engine_name: str, steps: int) -> dict:
    pushes = [p for p in run["pushes"] if p["engine"] == engine_name and p["loaded"]]
    deltas = [p for p in pushes if p["base"] is not None]
    keys = [p for p in pushes if p["base"] is None]
    loaded = {p["version"] for p in pushes}

    def med(xs: list[dict], k: str) -> float | None:
        return statistics.median(x[k] for x in xs) if xs else None

    return {
        "delta_bytes": med(deltas, "wire_bytes"), "keyframe_bytes": med(keys, "wire_bytes"),
        "delta_s": med(deltas, "seconds"), "keyframe_s": med(keys, "seconds"),
        "encode_s_total": sum(p["encode_s"] for p in pushes),
        "versions_loaded": len(loaded), "versions_skipped": steps + 1 - len(loaded),
        "lag": dict(sorted(Counter(run["lags"][engine_name]).items())),
        "lag_max": max(run["lags"][engine_name], default=0),
        "refused": sum(1 for p in run["pushes"] if p["engine"] == engine_name and not p["loaded"]),
    }  # fmt: skip


def top(args: argparse.Namespace) -> None:
    """Role ``top``: make the box, do the three runs, print the figures."""
    from cross_host import host_cpu

    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp, ClusterBox(["trainer", *LINKS]) as box:
        plan: dict[str, dict[str, float | None]] = {
            "far": dict(LINKS),
            "unlimited": dict.fromkeys(LINKS),
            "no_far": {},
        }
        for name, rates in plan.items():
            t0 = time.perf_counter()
            runs[name] = _run(box, name, rates, args, Path(tmp))
            print(f"run {name}: {time.perf_counter() - t0:.1f} s, {_loop(runs[name])}", flush=True)
    full = runs["far"]["full_bf16_bytes"]
    links = {"unlimited": _link(runs["unlimited"], "far100", args.steps),
             "100": _link(runs["far"], "far100", args.steps),
             "20": _link(runs["far"], "far20", args.steps)}  # fmt: skip
    for rate, fig in links.items():
        print(f"link {rate}: {json.dumps(fig)}", flush=True)
    loops = {k: _loop(v) for k, v in runs.items()}
    result = {
        "benchmark": "far_engines", "model": args.model, "steps": args.steps,
        "full_every": args.full_every, "zstd_level": args.level, "lr": args.lr,
        "full_bf16_bytes": full, "links": links,
        "delta_over_full_bf16": {
            k: (v["delta_bytes"] / full if v["delta_bytes"] else None) for k, v in links.items()
        },
        "runs": loops,
        "far_over_no_far_step_s": loops["far"]["step_s"] / loops["no_far"]["step_s"],
        "far_idle_over_no_far": loops["far"]["idle_fraction"]
        / max(loops["no_far"]["idle_fraction"], 1e-9),
        "catch_up_s": {"far": runs["far"]["catch_up_s"],
                       "unlimited": runs["unlimited"]["catch_up_s"]},
        **host_cpu(),
    }  # fmt: skip
    print(json.dumps(result))


def main() -> None:
    """Parse the role and its options; run it."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("role", nargs="?", default="top", choices=("top", "trainer", "engine"))
    p.add_argument("--model", default="small", choices=("smollm2", "small", "tiny"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument(
        "--full-every",
        type=int,
        default=0,
        help="a keyframe after every N-1 deltas; 0 (the sender's default): only "
        "when an engine holds nothing kept",
    )
    p.add_argument("--level", type=int, default=3, help="zstd level")
    p.add_argument("--timeout-s", type=float, default=900.0)
    p.add_argument("--out", help="trainer: where to write its figures")
    p.add_argument("--bind", default="127.0.0.1", help="trainer: the sender's address")
    p.add_argument("--engines", nargs="*", default=[], help="trainer: far engines' names")
    p.add_argument("--name", help="engine: its name")
    p.add_argument("--connect", help="engine: the sender's HOST:PORT")
    p.add_argument("--last", type=int, default=0, help="engine: stop once it holds this")
    p.add_argument(
        "--generate",
        action="store_true",
        help="the real main job with generating JAX engines (benchmarks/far_engines_job.py) "
        "instead of receivers that only rebuild and load",
    )
    p.add_argument("--max-lag", type=int, default=1, help="--generate: rollout.max_lag")
    args = p.parse_args()
    if args.generate:
        from far_engines_job import main as generate

        generate(args)
        return
    {"top": top, "trainer": trainer, "engine": engine}[args.role](args)


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()
