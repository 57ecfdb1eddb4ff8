"""The host publishes an app's change of serving as soon as the app announces it (e.g. a
frozen vLLM behind the openai backend), not at the next look of its periodic watch."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from llmesh import server


class App:
    service_names = ("llmesh.v1.Inference",)

    def __init__(self) -> None:
        self.serving = True
        self.changed = asyncio.Event()

    async def wait_changed(self) -> None:
        await self.changed.wait()
        self.changed.clear()


async def test_a_change_the_app_announces_is_published_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server, "HEALTH_DETAIL_INTERVAL_S", 3600.0)  # the periodic look never comes
    app = App()
    published: asyncio.Queue[bool] = asyncio.Queue()
    host: Any = SimpleNamespace(app=app, health=None)

    async def set_serving(serving: bool) -> None:
        await published.put(serving)

    host.set_serving = set_serving
    host._next_details = lambda: server.ServiceHost._next_details(host)
    watch = asyncio.create_task(server.ServiceHost._watch_details(host))
    try:
        app.serving = False
        app.changed.set()
        assert await asyncio.wait_for(published.get(), 5) is False
        app.serving = True
        app.changed.set()
        assert await asyncio.wait_for(published.get(), 5) is True
    finally:
        watch.cancel()


async def test_an_app_that_announces_nothing_is_looked_at_every_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server, "HEALTH_DETAIL_INTERVAL_S", 0.01)
    app = SimpleNamespace(service_names=("x",), serving=True)
    published: asyncio.Queue[bool] = asyncio.Queue()
    host: Any = SimpleNamespace(app=app, health=None)

    async def set_serving(serving: bool) -> None:
        await published.put(serving)

    host.set_serving = set_serving
    host._next_details = lambda: server.ServiceHost._next_details(host)
    watch = asyncio.create_task(server.ServiceHost._watch_details(host))
    try:
        app.serving = False
        assert await asyncio.wait_for(published.get(), 5) is False
    finally:
        watch.cancel()
