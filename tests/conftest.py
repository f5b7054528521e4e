"""Shared pytest set-up: 8 host devices for mesh tests, marker enforcement for gpu/vllm."""

import importlib.util
import os

# Must be set before JAX is imported anywhere in the test process.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Real data sets (GSM8K) for the tests that read them: this project's CI keeps them in a
# `shared/data` folder beside the checkout; elsewhere set JAXRL_DATA_DIR (those tests skip
# when the files are absent).
_CI_DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..")
os.environ.setdefault("JAXRL_DATA_DIR", os.path.join(_CI_DATA, "shared", "data"))

import pytest  # noqa: E402


def _has_cuda() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `gpu` tests where no CUDA device is visible, and `vllm` tests where vLLM is absent."""
    has_vllm = importlib.util.find_spec("vllm") is not None
    has_cuda = None
    for item in items:
        if "gpu" in item.keywords:
            if has_cuda is None:
                has_cuda = _has_cuda()
            if not has_cuda:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU; none is visible"))
        if "vllm" in item.keywords and not has_vllm:
            item.add_marker(pytest.mark.skip(reason="vllm is not installed (run scripts/setup.sh)"))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """Factory: tiny_checkpoint(variant, seed=0, **overrides) -> Path of a random HF folder
    (see trainer.checkpoints.tiny.TINY_CONFIGS), built once per session per argument set."""
    from trainer.checkpoints.tiny import make_tiny_checkpoint

    built: dict[tuple, object] = {}

    def get(variant: str = "llama", seed: int = 0, **overrides):
        key = (variant, seed, tuple(sorted(overrides.items())))
        if key not in built:
            folder = tmp_path_factory.mktemp(f"tiny-{variant}-{seed}")
            built[key] = make_tiny_checkpoint(folder, variant, seed=seed, **overrides)
        return built[key]

    return get
