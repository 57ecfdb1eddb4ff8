"""How spans leave a process: export batches small enough that encoding one never holds the GIL
for long, and a GIL switch interval that bounds how long the request thread waits for it."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from llmesh import telemetry
from llmesh.spans import LeanTracerProvider


class Batches(SpanExporter):
    def __init__(self) -> None:
        self.sizes: list[int] = []

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.sizes.append(len(spans))
        return SpanExportResult.SUCCESS


@pytest.fixture
def switch_interval() -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(before)


def export_sizes(spans: int, environ: dict[str, str]) -> list[int]:
    exporter = Batches()
    provider = LeanTracerProvider()
    provider.add_span_processor(telemetry.batch_processor(exporter, environ))
    tracer = provider.get_tracer("test")
    for n in range(spans):
        tracer.start_span(f"s{n}").end()
    provider.force_flush()
    provider.shutdown()
    return exporter.sizes


def test_spans_are_exported_in_small_batches(switch_interval: None) -> None:
    sizes = export_sizes(300, {})
    assert sum(sizes) == 300
    assert max(sizes) == telemetry.EXPORT_BATCH < 512  # the SDK's own default would send them in one call


def test_the_standard_variable_still_sets_the_batch(switch_interval: None) -> None:
    sizes = export_sizes(300, {"OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "300"})
    assert sizes == [300]


def test_a_queue_smaller_than_the_batch_is_accepted(switch_interval: None) -> None:
    # The SDK refuses a batch larger than its queue: the batch shrinks to the queue instead.
    assert export_sizes(16, {"OTEL_BSP_MAX_QUEUE_SIZE": "16"}) == [16]


def test_exporting_shortens_the_gil_switch_interval_and_never_lengthens_it(switch_interval: None) -> None:
    telemetry.batch_processor(Batches(), {}).shutdown()
    assert sys.getswitchinterval() == pytest.approx(telemetry.EXPORT_SWITCH_INTERVAL_S, rel=0.05)
    sys.setswitchinterval(0.0001)
    telemetry.batch_processor(Batches(), {}).shutdown()
    assert sys.getswitchinterval() == pytest.approx(0.0001, rel=0.05)
