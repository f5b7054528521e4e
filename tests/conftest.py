"""Shared pytest set-up: 8 host devices for mesh tests, marker enforcement for gpu/vllm, and
the families of mappings/families/ as test parameters (`family_variant`, `family_name`)."""

import importlib.util
import os
import tempfile

# Must be set before JAX is imported anywhere in the test process.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent XLA compilation cache (JAX's own, keyed by program, JAX version and flags) for
# this process and every process it starts (trainers, JAX engines): the tests compile the same
# tiny models' programs many times over. JAXRL_TEST_XLA_CACHE="" turns it off.
_XLA_CACHE = os.environ.get(
    "JAXRL_TEST_XLA_CACHE", os.path.join(tempfile.gettempdir(), "jaxrl-tests-xla")
)
if _XLA_CACHE:
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _XLA_CACHE)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 << 30))  # bytes, LRU
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


def pytest_addoption(parser: pytest.Parser) -> None:
    """`--require-vllm`: a `vllm` test fails (not skips) where vLLM is absent."""
    parser.addoption(
        "--require-vllm",
        action="store_true",
        help="fail the vllm tests when vllm is not installed (on by default when CI is set)",
    )


def _vllm_required(config: pytest.Config) -> bool:
    """In CI (env CI set and not "false"/"0") or with --require-vllm, vLLM must be there."""
    ci = os.environ.get("CI", "").strip().lower() not in ("", "0", "false")
    return ci or bool(config.getoption("--require-vllm"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `gpu` tests where no CUDA device is visible, and `vllm` tests where vLLM is absent
    (in CI, or with --require-vllm, those fail instead: a missing vLLM must not pass)."""
    has_vllm = importlib.util.find_spec("vllm") is not None
    required = _vllm_required(config)
    has_cuda = None
    for item in items:
        if "gpu" in item.keywords:
            if has_cuda is None:
                has_cuda = _has_cuda()
            if not has_cuda:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU; none is visible"))
        if "vllm" in item.keywords and not has_vllm:
            if required:
                item.add_marker(pytest.mark.needs_missing_vllm)
            else:
                item.add_marker(
                    pytest.mark.skip(reason="vllm is not installed (run scripts/setup.sh)")
                )


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Fail, before any fixture starts, a vllm test that must run where vLLM is absent."""
    if "needs_missing_vllm" in item.keywords:
        pytest.fail(
            "vllm is not installed, and this run requires it (CI is set, or --require-vllm): "
            "install it (scripts/setup.sh) instead of skipping the vllm tests"
        )


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """Factory: tiny_checkpoint(variant, seed=0, **overrides) -> Path of a random HF folder
    (see models.checkpoints.tiny.TINY_CONFIGS), built once per session per argument set."""
    from models.checkpoints.tiny import make_tiny_checkpoint

    built: dict[tuple, object] = {}

    def get(variant: str | None = "llama", seed: int = 0, **overrides):
        if variant is None:  # a `family_variant` case of a family with no tiny checkpoint
            pytest.fail(
                "this family has no tiny checkpoint: add a models.checkpoints.tiny.TINY_CONFIGS "
                "entry whose model_type is one of the family's model_types"
            )
        key = (variant, seed, tuple(sorted(overrides.items())))
        if key not in built:
            folder = tmp_path_factory.mktemp(f"tiny-{variant}-{seed}")
            built[key] = make_tiny_checkpoint(folder, variant, seed=seed, **overrides)
        return built[key]

    return get


def family_variants() -> list[tuple[str, str | None]]:
    """(family, tiny variant) for every family module of mappings/families/ and every
    `TINY_CONFIGS` variant whose `model_type` selects it (`mappings.registry.model_types`);
    a family no variant selects gets one pair (family, None), whose tests fail."""
    from mappings.registry import available_families, model_types
    from models.checkpoints.tiny import TINY_CONFIGS

    table = model_types()
    pairs: list[tuple[str, str | None]] = []
    for family in available_families():
        variants = sorted(
            v for v, c in TINY_CONFIGS.items() if table.get(c["model_type"]) == family
        )
        pairs += [(family, v) for v in variants] or [(family, None)]
    return pairs


def family_mapping_cases() -> list[tuple[str, str | None]]:
    """The pairs of `family_variants()` that take different paths through a family's mapping:
    per family, the first variant of each (`tie_word_embeddings`, `attention_bias`) pair (a
    tied checkpoint has no LM head to send; a biased one sends the bias tensors). For the tests
    that start an engine per case."""
    from models.checkpoints.tiny import TINY_CONFIGS

    seen: set[tuple[str, bool, bool]] = set()
    cases = []
    for family, variant in family_variants():
        config = TINY_CONFIGS[variant] if variant is not None else {}
        key = (family, bool(config.get("tie_word_embeddings")), bool(config.get("attention_bias")))
        if key not in seen:
            seen.add(key)
            cases.append((family, variant))
    return cases


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test that takes `family_variant` runs on every pair of `family_variants()`, one that
    takes `family_case` on `family_mapping_cases()`, and one that takes `family_name` once per
    family: so every shared test covers a new family file."""
    for name, pairs in (
        ("family_variant", family_variants),
        ("family_case", family_mapping_cases),
    ):
        if name in metafunc.fixturenames:
            got = pairs()
            metafunc.parametrize(name, got, ids=[f"{f}-{v}" for f, v in got])
    if "family_name" in metafunc.fixturenames:
        from mappings.registry import available_families

        metafunc.parametrize("family_name", available_families())
