"""gRPC side of the inference service: messages in, engine calls, messages out."""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import socket
import time
from collections.abc import AsyncIterator

import grpc

from llmesh import errors
from llmesh.server import Readiness, set_status_for
from llmesh.settings import InferenceServiceSettings
from llmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from services.inference.backend import InferenceBackend
from services.inference.engine import (
    FINISH_CANCELLED,
    FINISH_LENGTH,
    FINISH_STOP,
    FINISH_STOP_SEQUENCE,
    EngineConfig,
    GenerationEvent,
    ModelDescription,
    TokenLogprob,
)
from services.inference.engine.decoding import ResponseFormatSpec, SamplingParams
from services.inference.engine.load import EngineLoad
from services.inference.lifecycle import ModelManager
from services.inference.multiplex import Multiplexer
from services.inference.openai_backend import BackendConfig, LocalTokenizer, OpenAIBackend

log = logging.getLogger("llmesh.inference")

# Prompts above this size are tokenized on a worker thread so the event loop keeps serving.
THREAD_THRESHOLD_CHARS = 16 * 1024

FINISH_REASONS = {
    FINISH_STOP: common_pb2.FINISH_REASON_STOP,
    FINISH_LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FINISH_STOP_SEQUENCE: common_pb2.FINISH_REASON_STOP_SEQUENCE,
    FINISH_CANCELLED: common_pb2.FINISH_REASON_CANCELLED,
}


def format_from_proto(form: common_pb2.ResponseFormat) -> ResponseFormatSpec | None:
    """None for free text ("" or "text")."""
    if form.type in ("", "text"):
        return None
    return ResponseFormatSpec(
        kind=form.type,
        schema=form.json_schema,
        strict=form.strict,
        name=form.name,
        regex=form.regex,
        choices=tuple(form.choices),
        grammar=form.grammar,
    )


def sampling_from_proto(
    msg: common_pb2.SamplingParams, form: common_pb2.ResponseFormat | None = None
) -> SamplingParams:
    return SamplingParams(
        response_format=format_from_proto(form) if form is not None else None,
        max_new_tokens=msg.max_new_tokens,
        temperature=msg.temperature,
        top_p=msg.top_p,
        seed=msg.seed if msg.HasField("seed") else None,
        stop=tuple(msg.stop),
        ignore_eos=msg.ignore_eos,
        top_k=msg.top_k,
        min_p=msg.min_p,
        repetition_penalty=msg.repetition_penalty,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        stop_token_ids=tuple(msg.stop_token_ids),
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        logprobs=msg.logprobs,
        top_logprobs=msg.top_logprobs,
        min_new_tokens=msg.min_new_tokens,
        keep_special_tokens=msg.keep_special_tokens,
        include_stop_str=msg.include_stop_str,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        prompt_only=msg.prompt_only,
    )


def logprob_to_proto(entry: TokenLogprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=entry.token_id,
        token=entry.token,
        logprob=entry.logprob,
        bytes=entry.bytes,
        top=[
            common_pb2.TopLogprob(token_id=t.token_id, token=t.token, logprob=t.logprob, bytes=t.bytes)
            for t in entry.top
        ],
    )


def response_for(event: GenerationEvent) -> inference_pb2.InferenceResponse:
    # Once per streamed event: only the fields the event carries are set.
    reply = inference_pb2.InferenceResponse(text=event.text)
    if event.token_ids:
        reply.token_ids.extend(event.token_ids)
    elif event.tokens:
        reply.tokens = event.tokens
    if event.batch_id:
        reply.batch_id = event.batch_id
    if event.logprobs:
        reply.logprobs.extend([logprob_to_proto(entry) for entry in event.logprobs])
    if event.prompt_logprobs:
        reply.prompt_logprobs.extend([logprob_to_proto(entry) for entry in event.prompt_logprobs])
    if event.finish_reason is not None:
        reply.finish_reason = FINISH_REASONS[event.finish_reason]
        reply.usage.input_tokens = event.input_tokens
        reply.usage.output_tokens = event.output_tokens
        reply.usage.prefix_cached_input_tokens = event.cached_input_tokens
    return reply


def model_info(desc: ModelDescription) -> inference_pb2.ModelInfo:
    return inference_pb2.ModelInfo(
        model_id=desc.model_id,
        version=desc.version,
        sha256=desc.digest,
        device=desc.device,
        dtype=desc.dtype,
        max_context_tokens=desc.max_context_tokens,
        max_batch_size=desc.max_batch_size,
    )


#: WatchLoad's defaults and bounds (seconds): a change is pushed within MIN, and a report goes
#: out at least every MAX so a watcher can tell a frozen replica from an idle one.
LOAD_MIN_INTERVAL_S = 0.01
LOAD_MAX_INTERVAL_S = 1.0
LOAD_INTERVAL_BOUNDS_S = (0.001, 60.0)


def load_report(load: EngineLoad | None, desc: ModelDescription, replica: str) -> inference_pb2.LoadReport:
    """The wire form of an engine's load (`reported` False when the backend reports none)."""
    report = inference_pb2.LoadReport(model_id=desc.model_id, version=desc.version, replica=replica)
    if load is None:
        return report
    report.reported = True
    report.running = load.running
    report.max_running = load.max_running
    report.waiting = load.waiting
    report.kv_blocks_free = load.kv_blocks_free
    report.kv_blocks_total = load.kv_blocks_total
    report.block_tokens = load.block_tokens
    report.waiting_prompt_tokens = load.waiting_prompt_tokens
    report.step_seconds = load.step_seconds or 0.0
    report.prefill_tokens_per_second = load.prefill_tokens_per_second or 0.0
    report.prefix_hit_rate = load.prefix_hit_rate
    report.prefix_hashes.extend(h & ((1 << 64) - 1) for h in load.prefix_hashes)
    report.running_batch = load.running_batch
    report.waiting_batch = load.waiting_batch
    report.waiting_batch_prompt_tokens = load.waiting_batch_prompt_tokens
    return report


def watch_intervals(request: inference_pb2.WatchLoadRequest) -> tuple[float, float]:
    """(min, max) seconds between reports; INVALID_ARGUMENT naming the field when out of bounds."""
    low, high = LOAD_INTERVAL_BOUNDS_S
    problems = []
    least = request.min_interval_seconds or LOAD_MIN_INTERVAL_S
    most = request.max_interval_seconds or max(LOAD_MAX_INTERVAL_S, least)
    if not low <= least <= high:
        problems.append(("min_interval_seconds", f"must be 0 (the default) or in [{low:g}, {high:g}]"))
    if not low <= most <= high or most < least:
        problems.append(("max_interval_seconds", f"must be 0 (the default) or in [min_interval_seconds, {high:g}]"))
    if problems:
        raise errors.InvalidArgument(problems)
    return least, most


def check_admin(context: grpc.aio.ServicerContext, admin_token: str) -> None:
    """`authorization: Bearer <LLMESH_ADMIN_TOKEN>`; an empty setting disables admin RPCs."""
    if not admin_token:
        raise errors.PermissionDenied(
            "admin RPCs are disabled (LLMESH_ADMIN_TOKEN is not set)", reason="ADMIN_DISABLED"
        )
    header = next((v for k, v in context.invocation_metadata() or () if k == "authorization"), None)
    if not isinstance(header, str) or not header.startswith("Bearer "):
        raise errors.Unauthenticated(
            "admin RPCs need `authorization: Bearer <token>` metadata", reason="MISSING_CREDENTIALS"
        )
    if not hmac.compare_digest(header.removeprefix("Bearer ").strip().encode(), admin_token.encode()):
        raise errors.Unauthenticated("invalid admin token", reason="INVALID_CREDENTIALS")


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, manager: Readiness[InferenceBackend], settings: InferenceServiceSettings) -> None:
        self._manager = manager
        self._admin_token: str = settings.inference.admin_token
        self.multiplexer = Multiplexer(self.generate)
        #: This process among the model's replicas (a restart is a new replica).
        self.replica = f"{socket.gethostname()}:{os.getpid()}"

    async def Generate(  # type: ignore[override]
        self, request: inference_pb2.InferenceRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.InferenceResponse]:
        async for response in self.generate(request):
            yield response

    async def GenerateMany(  # type: ignore[override]
        self, requests: AsyncIterator[inference_pb2.GenerateManyRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateManyResponse]:
        """Generations over one stream (services/inference/multiplex.py): each is `generate`."""
        try:
            async for response in self.multiplexer.serve(requests, context):
                yield response
        except Exception as exc:  # a bidi handler is not wrapped by the interceptor: its mapping here
            set_status_for(exc, context, "/llmesh.v1.Inference/GenerateMany")

    async def generate(self, request: inference_pb2.InferenceRequest) -> AsyncIterator[inference_pb2.InferenceResponse]:
        """One generation, as Generate streams it and as each of GenerateMany's runs."""
        manager = self._manager.get()
        params = sampling_from_proto(request.sampling, request.response_format)
        which = request.WhichOneof("input")
        if which == "text":
            encoder = manager.encoder
            if len(request.text) > THREAD_THRESHOLD_CHARS:
                ids = await asyncio.to_thread(encoder.encode, request.text)
                if manager.encoder is not encoder:  # switched meanwhile: use the new tokenizer
                    ids = await asyncio.to_thread(manager.encoder.encode, request.text)
            else:
                ids = encoder.encode(request.text)
        elif which == "token_ids":
            ids = list(request.token_ids.ids)
        else:
            raise errors.InvalidArgument([("input", "either text or token_ids is required")])
        await manager.prepare(params)
        # Synchronous from here to submit: the request binds to the engine serving right now.
        stream = manager.submit(ids, params, request.request_id, request.priority)
        try:
            async for event in stream:
                yield response_for(event)
        finally:
            # Client cancel or deadline: the handler task is cancelled, which lands here and
            # frees the sequence (the builtin engine's batch row within one decode step; the
            # openai backend's HTTP stream at once).
            stream.cancel()

    async def GetModelInfo(
        self, request: inference_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.ModelInfo:
        return model_info(self._manager.get().description)

    async def WatchLoad(  # type: ignore[override]
        self, request: inference_pb2.WatchLoadRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.LoadReport]:
        """Samples the backend's load every `min` seconds (plain counters: cheap) and sends it
        when it changed, or when `max` seconds passed since the last report."""
        least, most = watch_intervals(request)
        sequence = 0
        last: inference_pb2.LoadReport | None = None
        sent_at = 0.0
        while True:
            backend = self._manager.get()
            report = load_report(backend.load(), backend.description, self.replica)
            now = time.monotonic()
            if report != last or now - sent_at >= most:
                last = report
                sent_at = now
                sequence += 1
                out = inference_pb2.LoadReport()
                out.CopyFrom(report)
                out.sequence = sequence
                yield out
            await asyncio.sleep(least)

    async def LoadModel(
        self, request: inference_pb2.LoadModelRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.ModelInfo:
        check_admin(context, self._admin_token)
        manager = self._manager.get()
        log.info("LoadModel %s requested", request.version)
        return model_info(await manager.load_version(request.version))


class InferenceApp:
    service_names = (inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name,)

    def __init__(self, settings: InferenceServiceSettings) -> None:
        self.settings = settings
        self.manager: Readiness[InferenceBackend] = Readiness()
        self.servicer: InferenceServicer | None = None

    def register(self, server: grpc.aio.Server) -> None:
        self.servicer = InferenceServicer(self.manager, self.settings)
        inference_pb2_grpc.add_InferenceServicer_to_server(self.servicer, server)

    async def drain(self, grace: float) -> None:
        """Alongside the server's drain: GenerateMany streams take no new generations and end when
        theirs have finished (a long-lived stream would otherwise hold the drain for its grace)."""
        if self.servicer is not None:
            self.servicer.multiplexer.drain()

    async def start(self) -> None:
        backend: ModelManager | OpenAIBackend
        s = self.settings
        if s.inference.backend == "openai":
            tokenizer = await asyncio.to_thread(LocalTokenizer.load, s.runtime.models_path, s.inference.model)
            backend = OpenAIBackend(BackendConfig.from_settings(s.backend, s.generation), tokenizer)
        else:
            backend = ModelManager(
                s.runtime.models_path,
                s.inference.model,
                EngineConfig.from_settings(s.engine, s.generation),
                s.inference.device,
            )
        try:
            await backend.start()
        except BaseException:
            await backend.close()
            raise
        self.manager.set(backend)

    @property
    def serving(self) -> bool:
        """Health follows the backend: NOT_SERVING while no backend replica lists the model."""
        return self.manager.ready and self.manager.get().serving

    async def wait_changed(self) -> None:
        """Returns when the backend announces a change of health (the openai backend's replicas
        going silent or answering again), so the host publishes it at once; never for a backend
        that announces none (the host's interval decides)."""
        wait = getattr(self.manager.get(), "wait_changed", None) if self.manager.ready else None
        if wait is None:
            await asyncio.Event().wait()
        else:
            await wait()

    async def stop(self) -> None:
        if self.manager.ready:
            manager = self.manager.get()
            self.manager.clear()
            await manager.close()
