"""The typed settings: each service's model of sections, built from the one declaration per
setting, with bounds, choices, durations and secrets checked at load."""

from __future__ import annotations

import dataclasses

import pydantic
import pytest

from llmesh import settings
from llmesh.settings import SettingsError, load


def test_each_service_gets_its_typed_model_of_sections() -> None:
    gateway = load("gateway", {"LLMESH_BREAKER_WINDOW": "40", "LLMESH_ROUTING_PICK": "round_robin"})
    assert isinstance(gateway, settings.GatewayServiceSettings)
    assert isinstance(gateway.breaker, settings.BreakerSettings) and gateway.breaker.window == 40
    assert gateway.routing.pick == "round_robin"
    assert gateway.admission.lanes == {"interactive": 1.0, "batch": 0.5}
    inference = load("inference", {"LLMESH_MAX_BATCH_SIZE": "8", "LLMESH_BACKEND_URLS": "http://a/v1,http://b/v1/"})
    assert isinstance(inference, settings.InferenceServiceSettings)
    assert inference.engine.max_batch_size == 8
    assert inference.backend.urls == ("http://a/v1", "http://b/v1")
    assert inference.generation.max_new_tokens == 512
    assert isinstance(load("cli", {}), settings.CliSettings)


@pytest.mark.parametrize(
    ("env", "raw"),
    [
        ("LLMESH_BREAKER_WINDOW", "0"),  # a count: > 0
        ("LLMESH_BREAKER_FAILURE_RATE", "1.5"),  # a rate: in [0, 1]
        ("LLMESH_BREAKER_CONSECUTIVE_FAILURES", "-1"),  # >= 0
        ("LLMESH_ROUTING_PICK", "random"),  # one of the declared choices
        ("LLMESH_LOG_LEVEL", "debug"),  # choices are exact
        ("LLMESH_BREAKER_WAIT_SECONDS", "-1"),  # a duration: finite and > 0
        ("LLMESH_BREAKER_WAIT_SECONDS", "inf"),
        ("LLMESH_BREAKER_WAIT_SECONDS", "nan"),
        ("LLMESH_HOP_SEARCH_SECONDS", "1s"),  # seconds as a number
        ("LLMESH_BREAKER_PROBE_SECONDS", "inf"),  # >= 0, still finite
        ("LLMESH_ADMISSION_LANES", "batch=0.5,batch=1"),
    ],
)
def test_bounds_choices_and_durations_are_refused_naming_the_variable(env: str, raw: str) -> None:
    with pytest.raises(SettingsError) as info:
        load("gateway", {env: raw})
    assert f"{env}={raw!r}" in str(info.value)


def test_durations_are_seconds_as_floats() -> None:
    loaded = load("gateway", {"LLMESH_BREAKER_WAIT_SECONDS": "0.5", "LLMESH_BREAKER_PROBE_SECONDS": "0"})
    assert loaded.breaker.wait_seconds == 0.5 and isinstance(loaded.breaker.wait_seconds, float)
    assert loaded.breaker.probe_seconds == 0.0  # 0: no probes
    assert isinstance(loaded.hops.cache_lookup_seconds, float)


def test_settings_are_immutable() -> None:
    loaded = load("gateway", {})
    with pytest.raises(pydantic.ValidationError):
        loaded.breaker.window = 1  # type: ignore[misc]


def test_a_secret_is_left_out_of_the_models_repr_and_of_the_refusals_traceback() -> None:
    key = "averylongsecretvalue123456"
    loaded = load("gateway", {"LLMESH_API_KEYS": f"{key}=acme", "LLMESH_MESH_TOKEN": "mesh-token-secret"})
    assert loaded.auth.api_keys == f"{key}=acme"
    shown = repr(loaded) + str(loaded)
    assert key not in shown and "mesh-token-secret" not in shown
    with pytest.raises(SettingsError) as info:
        load("gateway", {"LLMESH_API_KEYS": "shortkey=acme", "LLMESH_BREAKER_WINDOW": "0"})
    # pydantic's own error shows every input: it must not ride along as the refusal's context.
    assert info.value.__context__ is None and info.value.__cause__ is None
    assert "shortkey" not in str(info.value)


def test_the_process_environment_is_read_through_pydantic_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMESH_BREAKER_WINDOW", "33")
    monkeypatch.setenv("LLMESH_LISTEN", "127.0.0.1:0")
    built = settings.GatewayServiceSettings()  # type: ignore[call-arg]
    assert built.breaker.window == 33 and built.serving.listen == "127.0.0.1:0"
    assert settings.build(settings.GatewayServiceSettings) == built
    monkeypatch.setenv("LLMESH_BREAKER_WINDOW", "zero")
    with pytest.raises(SettingsError, match="LLMESH_BREAKER_WINDOW='zero'"):
        settings.build(settings.GatewayServiceSettings)


def test_a_section_built_in_python_is_typed_by_name() -> None:
    breaker = settings.BreakerSettings(window=5)
    assert breaker.window == 5 and breaker.minimum_calls == 10
    from services.gateway.breaker import BreakerConfig

    assert BreakerConfig.from_settings(breaker).window_size == 5


def test_every_setting_is_declared_once_and_every_section_is_read() -> None:
    envs = [s.env for s in settings.DECLARED]
    assert len(envs) == len(set(envs))
    sections = set(settings.CliSettings.sections().values()) | {settings.ServingSettings}
    declared = {c for c in _subclasses(settings.Section) if c.__module__ == settings.__name__}
    assert declared == sections, "a section no model reads"
    for s in settings.DECLARED:
        assert s.services or s.env in {d.env for d in settings.SupervisorSettings.declarations()}, s.env
        for service in s.services:
            model = settings.MODELS[service]
            assert s in settings.declared_in(model) or s in settings.ServingSettings.declarations()


def test_which_services_read_a_setting_follows_from_their_models() -> None:
    assert settings.BY_ENV["LLMESH_BREAKER_WINDOW"].services == ("gateway",)
    assert settings.BY_ENV["LLMESH_MAX_NEW_TOKENS"].services == ("gateway", "inference")
    assert settings.BY_ENV["LLMESH_TOKENIZER_TARGET"].services == ("gateway", "retrieval")
    assert settings.BY_ENV["LLMESH_LISTEN"].services == settings.SERVICES
    assert settings.BY_ENV["LLMESH_RESTART_LIMIT_PER_MINUTE"].services == ()
    assert dataclasses.is_dataclass(settings.BY_ENV["LLMESH_LISTEN"])


def _subclasses(cls: type) -> set[type]:
    found = set()
    for sub in cls.__subclasses__():
        found |= {sub, *_subclasses(sub)}
    return found
