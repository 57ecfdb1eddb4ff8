import pytest

from llmesh import settings
from llmesh.settings import SettingsError, load


def test_defaults_are_valid_for_every_service() -> None:
    for service in settings.SERVICES:
        loaded = load(service, {})
        assert loaded.listen == f"127.0.0.1:{settings.DEFAULT_PORTS[service]}"
        assert loaded.metrics_port == settings.DEFAULT_METRICS_PORTS[service]


def test_bad_values_are_all_reported_with_their_names() -> None:
    with pytest.raises(SettingsError) as info:
        load("inference", {"LLMESH_MAX_BATCH_SIZE": "0", "LLMESH_DEVICE": "tpu", "LLMESH_LISTEN": "nowhere"})
    message = str(info.value)
    assert "LLMESH_MAX_BATCH_SIZE='0'" in message
    assert "LLMESH_DEVICE='tpu'" in message
    assert "LLMESH_LISTEN='nowhere'" in message


def test_threshold_must_be_a_similarity_in_unit_interval() -> None:
    with pytest.raises(SettingsError, match="LLMESH_SEMANTIC_THRESHOLD"):
        load("cache", {"LLMESH_SEMANTIC_THRESHOLD": "1.5"})
    assert load("cache", {"LLMESH_SEMANTIC_THRESHOLD": "0.8"}).semantic_threshold == 0.8


def test_a_service_only_sees_its_own_settings() -> None:
    gateway = load("gateway", {})
    assert gateway.inference_target == "127.0.0.1:50053"
    with pytest.raises(AttributeError):
        _ = gateway.redis_url


def test_targets_accept_grpc_uris() -> None:
    loaded = load("gateway", {"LLMESH_INFERENCE_TARGET": "dns:///inference.llmesh.svc.cluster.local:50053"})
    assert loaded.inference_target.startswith("dns:///")


def test_invalid_settings_stop_the_process_with_a_clear_message(capsys, monkeypatch) -> None:
    monkeypatch.setenv("LLMESH_GRACE_SECONDS", "-3")
    with pytest.raises(SystemExit) as info:
        settings.load_or_exit("tokenizer")
    assert info.value.code == 2
    assert "LLMESH_GRACE_SECONDS='-3'" in capsys.readouterr().err


def test_readme_lists_every_setting() -> None:
    readme = (settings.Path(__file__).resolve().parents[2] / "README.md").read_text()
    missing = [s.env for s in settings.DECLARED if f"`{s.env}`" not in readme]
    assert not missing, f"README settings table is missing {missing}; paste `python -m llmesh.settings`"


def test_niceness_may_raise_priority_within_the_kernel_range() -> None:
    assert load("gateway", {"LLMESH_NICE": "-10"}).nice == -10
    assert load("inference", {}).nice == 5
    for bad in ("-21", "20", "high"):
        with pytest.raises(SettingsError, match="LLMESH_NICE"):
            load("gateway", {"LLMESH_NICE": bad})


def test_raising_priority_without_the_capability_warns_and_keeps_going(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import os

    from llmesh import server

    real_nice = os.nice

    def nice(increment: int) -> int:
        if increment < 0:
            raise PermissionError(1, "Operation not permitted")
        return real_nice(increment)

    monkeypatch.setattr(os, "nice", nice)
    before = real_nice(0)
    assert server.apply_niceness(-10) == before
    assert "CAP_SYS_NICE" in caplog.text
    assert server.apply_niceness(0) == before
