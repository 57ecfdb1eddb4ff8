import pytest

from llmesh import settings
from llmesh.settings import SettingsError, load


def test_defaults_are_valid_for_every_service() -> None:
    for service in settings.SERVICES:
        loaded = load(service, {})
        assert isinstance(loaded, settings.ServiceSettings)
        assert loaded.serving.listen == f"127.0.0.1:{settings.DEFAULT_PORTS[service]}"
        assert loaded.serving.metrics_port == settings.DEFAULT_METRICS_PORTS[service]


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
    assert load("cache", {"LLMESH_SEMANTIC_THRESHOLD": "0.8"}).cache.semantic_threshold == 0.8


def test_a_service_only_sees_its_own_settings() -> None:
    gateway = load("gateway", {})
    assert gateway.peers.inference_target == "127.0.0.1:50053"
    with pytest.raises(AttributeError):
        _ = gateway.store  # type: ignore[attr-defined]


def test_targets_accept_grpc_uris() -> None:
    loaded = load("gateway", {"LLMESH_INFERENCE_TARGET": "dns:///inference.llmesh.svc.cluster.local:50053"})
    assert loaded.peers.inference_target.startswith("dns:///")


def test_invalid_settings_stop_the_process_with_a_clear_message(capsys, monkeypatch) -> None:
    monkeypatch.setenv("LLMESH_GRACE_SECONDS", "-3")
    with pytest.raises(SystemExit) as info:
        settings.load_or_exit(settings.TokenizerServiceSettings)
    assert info.value.code == 2
    assert "LLMESH_GRACE_SECONDS='-3'" in capsys.readouterr().err


def test_the_settings_page_is_generated_from_the_declarations() -> None:
    """docs/settings.md documents every setting, as `python -m llmesh.settings --write` makes it."""
    page = settings.SETTINGS_PAGE.read_text()
    missing = [s.env for s in settings.DECLARED if f"`{s.env}`" not in page]
    assert not missing, f"docs/settings.md is missing {missing}; run `python -m llmesh.settings --write`"
    assert page == settings.settings_page(), "docs/settings.md is stale; run `python -m llmesh.settings --write`"


def test_niceness_may_raise_priority_within_the_kernel_range() -> None:
    assert load("gateway", {"LLMESH_NICE": "-10"}).serving.nice == -10
    assert load("inference", {}).serving.nice == 5
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


def _assert_hides(message: str, secrets: list[str]) -> None:
    """No secret, nor any 6-character piece of one, appears in the message."""
    for secret in secrets:
        pieces = {secret[i : i + 6] for i in range(max(1, len(secret) - 5))}
        shown = sorted(p for p in pieces if p in message)
        assert not shown, f"{message!r} shows {shown} of a secret"


@pytest.mark.parametrize(
    ("env", "raw", "secrets", "problem"),
    [
        (
            "LLMESH_API_KEYS",
            "shortkey=acme;averylongsecretvalue123456",
            ["shortkey", "averylongsecretvalue123456", "acme"],
            "the key of entry 1 is shorter than 16 characters",
        ),
        (
            "LLMESH_API_KEYS",
            "averylongsecretkey000001=acme|beta;anotherlongsecretkey0002",
            ["averylongsecretkey000001", "anotherlongsecretkey0002", "beta"],
            "entry 2 is not key=tenant|tenant",
        ),
        (
            "LLMESH_ADMIN_KEYS",
            "averylongadminsecret0001,shorty",
            ["averylongadminsecret0001", "shorty"],
            "key 2 is shorter than 16 characters",
        ),
        (
            "LLMESH_BACKEND_URLS",
            "https://svc:hunter2hunter2@vllm:8000/v1,ftp://svc:swordfish99@vllm:21",
            ["hunter2hunter2", "swordfish99", "vllm:21"],
            "URL 2 is not an http(s) URL",
        ),
    ],
)
def test_a_malformed_secret_setting_is_named_without_its_value(
    env: str, raw: str, secrets: list[str], problem: str
) -> None:
    service = "inference" if env == "LLMESH_BACKEND_URLS" else "gateway"
    with pytest.raises(SettingsError) as info:
        load(service, {env: raw})
    message = str(info.value)
    assert f"{env}: {problem}" in message
    _assert_hides(message, secrets)


def _quoting(raw: str) -> str:
    # A parser that quotes the value in its error (as int() and most parsers do).
    raise ValueError(f"cannot read {raw!r}")


class _SecretSection(settings.Section):
    token: str = settings.setting("LLMESH_TEST_SECRET", "", "A secret.", _quoting, secret=True)


class _SecretServiceSettings(settings.MeshSettings):
    service = "test"
    secret: _SecretSection


def test_a_secret_settings_parser_text_is_never_echoed() -> None:
    # For a secret setting only the variable and "malformed" are shown.
    with pytest.raises(SettingsError) as info:
        settings.build(_SecretServiceSettings, {"LLMESH_TEST_SECRET": "correct-horse-battery-staple"})
    assert "LLMESH_TEST_SECRET: malformed (the value is secret and not shown)" in str(info.value)
    _assert_hides(str(info.value), ["correct-horse-battery-staple"])


def test_a_malformed_key_setting_stops_the_gateway_without_printing_the_keys(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLMESH_API_KEYS", "shortkey=acme;averylongsecretvalue123456")
    monkeypatch.setenv("LLMESH_ADMIN_KEYS", "averylongadminsecret0001,shorty")
    with pytest.raises(SystemExit):
        settings.load_or_exit(settings.GatewayServiceSettings)
    err = capsys.readouterr().err
    assert "LLMESH_API_KEYS:" in err and "LLMESH_ADMIN_KEYS:" in err
    _assert_hides(err, ["shortkey", "averylongsecretvalue123456", "averylongadminsecret0001", "shorty"])


def test_every_setting_that_holds_a_key_password_or_url_is_secret() -> None:
    secret = {s.env for s in settings.DECLARED if s.secret}
    assert secret == {
        "LLMESH_API_KEYS",
        "LLMESH_ADMIN_KEYS",
        "LLMESH_ADMIN_TOKEN",
        "LLMESH_ADMISSION_REDIS_URL",
        "LLMESH_BACKEND_API_KEY",
        "LLMESH_BACKEND_URLS",
        "LLMESH_REDIS_URL",
        "LLMESH_STATE_REDIS_URL",
        "LLMESH_MESH_TOKEN",
        "QDRANT_URL",
        "QDRANT_API_KEY",
    }


def test_urls_shown_in_logs_and_model_info_hide_their_password() -> None:
    from services.inference.openai_backend import Replica

    assert settings.redact_url("redis://:pw-secret@10.0.0.1:6379/0") == "redis://:***@10.0.0.1:6379/0"
    assert settings.redact_url("rediss://app:pw-secret@[::1]:6380") == "rediss://app:***@[::1]:6380"
    assert settings.redact_url("http://vllm:8000/v1") == "http://vllm:8000/v1"
    assert settings.redact_url("redis://:pw-secret@[::1") == "(unparseable URL)"
    replica = Replica("https://svc:hunter2hunter2@vllm:8000/v1")
    assert replica.shown == "https://svc:***@vllm:8000/v1"
    assert replica.base_url == "https://svc:hunter2hunter2@vllm:8000/v1"  # requests still authenticate


def test_the_openai_backend_relays_at_the_engines_priority_unless_told_otherwise() -> None:
    from llmesh import server

    openai = {"LLMESH_INFERENCE_BACKEND": "openai", "LLMESH_BACKEND_URLS": "http://127.0.0.1:8000/v1"}
    assert server.service_niceness(load("inference", openai), openai) == 0
    assert server.service_niceness(load("inference", {}), {}) == 5  # the builtin engine computes: below the gateway
    told = {**openai, "LLMESH_NICE": "7"}
    assert server.service_niceness(load("inference", told), told) == 7
    assert server.service_niceness(load("retrieval", openai), openai) == 5
