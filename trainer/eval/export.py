"""`python -m trainer export RUN_DIR[/checkpoints/STEP] OUT_DIR`: a training checkpoint as an HF
folder (config.json, model.safetensors, the tokenizer files with the chat template) that
transformers and vLLM load.

`export_once` exports a step once into ``RUN_DIR/exports/STEP`` and reuses it (each
``python -m trainer eval --model RUN_DIR`` of that step).

The run's own ``RUN_DIR/config.yaml`` (written by the main job) names the base checkpoint and the
train step; the orbax checkpoint is restored onto this process's devices through the train
step's abstract state (params, optimizer moments, step), and its params are written with the
family's mapping (`models.checkpoints.hf_io.save_hf_checkpoint`), in `model.param_dtype`.
"""

from __future__ import annotations

from pathlib import Path


def locate_checkpoint(path: str | Path) -> tuple[Path, int | None]:
    """``(RUN_DIR, STEP)`` of ``RUN_DIR`` (STEP None: the newest) or ``RUN_DIR/checkpoints/STEP``.

    Raises:
      FileNotFoundError: neither form, or no RUN_DIR/config.yaml.
    """
    path = Path(path).absolute()
    if path.parent.name == "checkpoints" and path.name.isdigit():
        run_dir, step = path.parent.parent, int(path.name)
    else:
        run_dir, step = path, None
    if not (run_dir / "config.yaml").is_file() or not (run_dir / "checkpoints").is_dir():
        raise FileNotFoundError(
            f"{path}: expected a run folder (config.yaml, checkpoints/) or RUN_DIR/checkpoints/STEP"
        )
    return run_dir, step


def export_checkpoint(path: str | Path, out_dir: str | Path, adapter: bool = False) -> Path:
    """Write the checkpoint at `path` (see `locate_checkpoint`) as an HF folder `out_dir`.

    A LoRA run (``lora.rank > 0``) is written with its adapters merged into the base weights
    (W + alpha/r A B: a plain HF folder), or with `adapter` as a PEFT adapter folder
    (`models.checkpoints.peft_io`) for the run's base checkpoint.

    Returns:
      `out_dir`.

    Raises:
      FileNotFoundError: no run folder, no checkpoint (or not that step); ConfigError: the
        run's config.yaml does not validate; ValueError: `adapter` for a run without LoRA.
    """
    from models.checkpoints.hf_io import load_hf_checkpoint, read_hf_config, save_hf_checkpoint
    from models.checkpoints.peft_io import save_peft_adapter
    from models.lora import merge_lora
    from models.sharding import make_mesh
    from trainer.build import train_step_from_config
    from trainer.checkpointing import Checkpointer
    from trainer.launch.job_config import load_job_config
    from trainer.launch.model_source import resolve_model

    run_dir, step = locate_checkpoint(path)
    job = load_job_config(run_dir / "config.yaml")
    cfg = job.run
    base = resolve_model(cfg.model.path, cfg.trainer.seed)
    _, model = load_hf_checkpoint(base, dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype)
    import jax

    mesh = make_mesh(1, 1, devices=jax.devices()[:1])
    train_step = train_step_from_config(cfg, model, mesh)
    with Checkpointer(run_dir / "checkpoints") as checkpointer:
        state, _ = checkpointer.restore(train_step.abstract_state(), step)
    trained = train_step.model(state)
    if adapter:
        return save_peft_adapter(trained, out_dir, base=base)
    merge_lora(trained)
    save_hf_checkpoint(
        trained,
        out_dir,
        hf_config=read_hf_config(base),
        dtype=cfg.model.param_dtype,
        tokenizer_from=base,
    )
    return Path(out_dir)


def newest_step(run_dir: Path) -> int:
    """The newest saved step in ``run_dir/checkpoints`` (its numbered folders).

    Raises:
      FileNotFoundError: no checkpoint.
    """
    folder = run_dir / "checkpoints"
    steps = sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit() and p.is_dir())
    if not steps:
        raise FileNotFoundError(f"no checkpoint in {folder}")
    return steps[-1]


def export_once(path: str | Path) -> tuple[Path, Path, int]:
    """The HF folder of the checkpoint at `path` (see `locate_checkpoint`), exported once into
    ``RUN_DIR/exports/STEP`` and reused by every later call (each evaluation of that step,
    whatever its ``--out``): written into a side folder and renamed, so a folder there is whole.

    Returns:
      ``(HF folder, RUN_DIR, STEP)``.

    Raises:
      as `export_checkpoint`.
    """
    import os
    import shutil

    run_dir, step = locate_checkpoint(path)
    step = newest_step(run_dir) if step is None else step
    folder = run_dir / "exports" / str(step)
    if not (folder / "config.json").is_file():
        tmp = folder.with_name(f"{step}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        export_checkpoint(run_dir / "checkpoints" / str(step), tmp)
        try:
            tmp.rename(folder)
        except OSError:  # another evaluation exported it meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
    return folder, run_dir, step
