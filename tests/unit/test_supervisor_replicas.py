"""`llmesh up` with several replicas of a model: one inference process per listed target."""

from __future__ import annotations

from llmesh.supervisor import Mesh


def test_each_target_of_a_model_is_a_replica_process_of_its_own() -> None:
    mesh = Mesh(env={"LLMESH_MODELS": "tiny=127.0.0.1:50061|127.0.0.1:50062,other=127.0.0.1:50063"})
    assert mesh.replicas("tiny") == ["inference/tiny", "inference/tiny#2"]
    assert mesh.replicas("other") == ["inference/other"]
