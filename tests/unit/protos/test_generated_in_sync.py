"""The checked-in generated stubs equal what grpcio-tools makes from the .proto files now."""

from pathlib import Path

import pytest

from protos import generate

PROTOS = Path(generate.__file__).resolve().parent


def test_generated_stubs_match_the_protos(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    written = generate.generate(tmp_path)
    assert sorted(p.name for p in written) == generate.generated_names()
    drift = [p.name for p in written if p.read_bytes() != (PROTOS / p.name).read_bytes()]
    assert not drift, f"regenerate with `python -m protos.generate`; stale: {drift}"


def test_generated_modules_import_as_a_package() -> None:
    from protos import gateway_pb2, gateway_pb2_grpc, rollout_pb2

    assert gateway_pb2.DESCRIPTOR.package == "jaxrl.gateway.v1"
    assert rollout_pb2.Prompt.DESCRIPTOR.full_name == "jaxrl.gateway.v1.Prompt"
    assert hasattr(gateway_pb2_grpc, "GatewayStub")
