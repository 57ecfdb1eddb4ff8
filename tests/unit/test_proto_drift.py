"""The committed stubs in llmesh/v1 must be exactly what `make proto` generates."""

from pathlib import Path

from llmesh import proto_gen


def test_committed_stubs_match_protos(tmp_path: Path) -> None:
    generated = proto_gen.generate(tmp_path)
    assert generated, "protoc produced nothing"
    committed = {p.relative_to(proto_gen.ROOT) for p in (proto_gen.ROOT / proto_gen.PACKAGE_DIR).glob("*_pb2*.py*")}
    assert set(generated) == committed, "stub files differ from the protos; run `make proto`"
    stale = [str(rel) for rel in generated if (tmp_path / rel).read_bytes() != (proto_gen.ROOT / rel).read_bytes()]
    assert not stale, f"stubs out of date, run `make proto`: {stale}"


def test_every_service_in_the_contract_has_stubs() -> None:
    from llmesh.v1 import cache_pb2, gateway_pb2, inference_pb2, retrieval_pb2, tokenizer_pb2

    services = {
        name
        for module in (cache_pb2, gateway_pb2, inference_pb2, retrieval_pb2, tokenizer_pb2)
        for name in module.DESCRIPTOR.services_by_name
    }
    assert services == {"Cache", "Gateway", "Inference", "Retrieval", "Tokenizer"}
    assert gateway_pb2.DESCRIPTOR.package == "llmesh.v1"
