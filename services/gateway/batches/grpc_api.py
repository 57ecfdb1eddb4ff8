"""The Batch API on gRPC (llmesh.v1.Batches): the same operations as the HTTP routes, over the
same BatchService, the caller told by the call's key and the request's tenant."""

from __future__ import annotations

import json
from typing import Any

import grpc

from llmesh.errors import InvalidArgument
from llmesh.v1 import batches_pb2, batches_pb2_grpc
from services.gateway.auth import Caller, KeyRing
from services.gateway.batches.service import BatchService
from services.gateway.batches.store import BatchInfo, FileInfo


def file_message(info: FileInfo) -> batches_pb2.BatchFile:
    return batches_pb2.BatchFile(
        id=info.id, bytes=info.bytes, created_at=info.created_at, filename=info.filename, purpose=info.purpose
    )


def batch_message(info: BatchInfo) -> batches_pb2.Batch:
    shape = info.as_openai()
    times = {k: v for k, v in shape.items() if k.endswith("_at") and v}
    errors = [
        batches_pb2.BatchError(code=e.get("code", ""), message=e.get("message", ""), line=e.get("line") or 0)
        for e in (shape["errors"] or {}).get("data", [])
    ]
    return batches_pb2.Batch(
        id=info.id,
        endpoint=info.endpoint,
        input_file_id=shape["input_file_id"],
        completion_window=shape["completion_window"],
        status=info.status,
        output_file_id=shape["output_file_id"] or "",
        error_file_id=shape["error_file_id"] or "",
        request_counts=batches_pb2.BatchRequestCounts(**shape["request_counts"]),
        metadata=json.loads(info.fields["metadata"]) if info.fields.get("metadata") else {},
        errors=errors,
        **times,
    )


class BatchesServicer(batches_pb2_grpc.BatchesServicer):
    def __init__(self, service: BatchService, api_keys: KeyRing) -> None:
        self.service = service
        self.api_keys = api_keys

    def _caller(self, context: grpc.aio.ServicerContext, request: Any) -> Caller:
        authorization = next((v for k, v in context.invocation_metadata() or () if k == "authorization"), None)
        return self.api_keys.caller(authorization if isinstance(authorization, str) else None, request.tenant)

    async def CreateFile(self, request, context):  # type: ignore[no-untyped-def]
        caller = self._caller(context, request)
        info = await self.service.create_file(caller, request.filename, request.purpose, request.content)
        return file_message(info)

    async def GetFile(self, request, context):  # type: ignore[no-untyped-def]
        return file_message(await self.service.file(self._caller(context, request), request.file_id))

    async def GetFileContent(self, request, context):  # type: ignore[no-untyped-def]
        data = await self.service.file_content(self._caller(context, request), request.file_id)
        return batches_pb2.FileContent(content=data)

    async def DeleteFile(self, request, context):  # type: ignore[no-untyped-def]
        info = await self.service.delete_file(self._caller(context, request), request.file_id)
        return batches_pb2.DeleteFileResponse(id=info.id, deleted=True)

    async def CreateBatch(self, request, context):  # type: ignore[no-untyped-def]
        caller = self._caller(context, request)
        info = await self.service.create_batch(
            caller, request.input_file_id, request.endpoint, request.completion_window, dict(request.metadata)
        )
        return batch_message(info)

    async def GetBatch(self, request, context):  # type: ignore[no-untyped-def]
        return batch_message(await self.service.batch(self._caller(context, request), request.batch_id))

    async def CancelBatch(self, request, context):  # type: ignore[no-untyped-def]
        return batch_message(await self.service.cancel(self._caller(context, request), request.batch_id))

    async def ListBatches(self, request, context):  # type: ignore[no-untyped-def]
        if request.limit > 100:
            raise InvalidArgument([("limit", "must be between 1 and 100")])
        found, more = await self.service.batches(self._caller(context, request), request.after, request.limit or 20)
        return batches_pb2.ListBatchesResponse(data=[batch_message(b) for b in found], has_more=more)
