"""The Batch API on the gateway's HTTP side, in OpenAI's shapes: `/v1/files` (multipart upload,
read, content, delete, list) and `/v1/batches` (create, read, cancel, list with `after`/`limit`).
Errors are raised as the typed errors the HTTP API already answers in OpenAI's error shape."""

from __future__ import annotations

import email.parser
import email.policy
import json
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from llmesh.errors import InvalidArgument
from services.gateway.auth import ApiKeys, Caller, KeyRing
from services.gateway.batches.service import BatchService

FILES, FILE, FILE_CONTENT = "/v1/files", "/v1/files/{file_id}", "/v1/files/{file_id}/content"
BATCHES, BATCH, BATCH_CANCEL = "/v1/batches", "/v1/batches/{batch_id}", "/v1/batches/{batch_id}/cancel"


def _json(payload: Any, status: int = 200) -> Response:
    return Response(
        json.dumps(payload, separators=(",", ":"), ensure_ascii=False), status, media_type="application/json"
    )


def multipart_fields(content_type: str, body: bytes) -> dict[str, tuple[str, bytes]]:
    """A multipart/form-data body's fields: name -> (filename, bytes). The standard library's MIME
    parser, so the upload needs no multipart package."""
    if not content_type.lower().startswith("multipart/form-data"):
        raise InvalidArgument([("file", "the upload must be multipart/form-data with `file` and `purpose`")])
    head = f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode("latin-1")
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + body)
    if not message.is_multipart():
        raise InvalidArgument([("file", "the multipart body could not be read")])
    fields: dict[str, tuple[str, bytes]] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if not isinstance(name, str):
            continue
        payload = part.get_payload(decode=True)
        fields[name] = (part.get_filename() or "", payload if isinstance(payload, bytes) else b"")
    return fields


class BatchApi:
    """The routes over one BatchService, the caller told by its key (its only tenant, else "default")."""

    def __init__(self, service: BatchService, api_keys: ApiKeys | KeyRing) -> None:
        self.service = service
        self.api_keys = api_keys

    def routes(self) -> list[Route]:
        return [
            Route(FILES, self.create_file, methods=["POST"]),
            Route(FILES, self.list_files, methods=["GET"]),
            Route(FILE_CONTENT, self.file_content, methods=["GET"]),
            Route(FILE, self.get_file, methods=["GET"]),
            Route(FILE, self.delete_file, methods=["DELETE"]),
            Route(BATCHES, self.create_batch, methods=["POST"]),
            Route(BATCHES, self.list_batches, methods=["GET"]),
            Route(BATCH_CANCEL, self.cancel_batch, methods=["POST"]),
            Route(BATCH, self.get_batch, methods=["GET"]),
        ]

    def _caller(self, request: Request) -> Caller:
        return self.api_keys.caller(request.headers.get("authorization"))

    async def create_file(self, request: Request) -> Response:
        caller = self._caller(request)
        fields = multipart_fields(request.headers.get("content-type", ""), await request.body())
        if "file" not in fields:
            raise InvalidArgument([("file", "required")])
        purpose = fields.get("purpose", ("", b""))[1].decode("utf-8", "replace").strip()
        filename, data = fields["file"]
        info = await self.service.create_file(caller, filename, purpose, data)
        return _json(info.as_openai())

    async def list_files(self, request: Request) -> Response:
        caller = self._caller(request)
        found = await self.service.files(caller)
        purpose = request.query_params.get("purpose")
        data = [f.as_openai() for f in found if not purpose or f.purpose == purpose]
        return _json({"object": "list", "data": data, "has_more": False})

    async def get_file(self, request: Request) -> Response:
        info = await self.service.file(self._caller(request), request.path_params["file_id"])
        return _json(info.as_openai())

    async def file_content(self, request: Request) -> Response:
        data = await self.service.file_content(self._caller(request), request.path_params["file_id"])
        return Response(data, 200, media_type="application/jsonl")

    async def delete_file(self, request: Request) -> Response:
        info = await self.service.delete_file(self._caller(request), request.path_params["file_id"])
        return _json({"id": info.id, "object": "file", "deleted": True})

    async def create_batch(self, request: Request) -> Response:
        caller = self._caller(request)
        try:
            body = json.loads(await request.body() or b"{}")
        except ValueError as exc:
            raise InvalidArgument([("", f"the body is not valid JSON: {exc}")]) from None
        if not isinstance(body, dict):
            raise InvalidArgument([("", "the body must be a JSON object")])
        metadata = body.get("metadata")
        if metadata is not None and (
            not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values())
        ):
            raise InvalidArgument([("metadata", "must be an object of strings")])
        unknown = set(body) - {"input_file_id", "endpoint", "completion_window", "metadata"}
        if unknown:
            raise InvalidArgument([(sorted(unknown)[0], "unrecognized request argument")])
        for name in ("input_file_id", "endpoint", "completion_window"):
            if not isinstance(body.get(name, ""), str):
                raise InvalidArgument([(name, "must be a string")])
        info = await self.service.create_batch(
            caller,
            body.get("input_file_id", ""),
            body.get("endpoint", ""),
            body.get("completion_window", ""),
            metadata,
        )
        return _json(info.as_openai())

    async def get_batch(self, request: Request) -> Response:
        info = await self.service.batch(self._caller(request), request.path_params["batch_id"])
        return _json(info.as_openai())

    async def cancel_batch(self, request: Request) -> Response:
        info = await self.service.cancel(self._caller(request), request.path_params["batch_id"])
        return _json(info.as_openai())

    async def list_batches(self, request: Request) -> Response:
        after = request.query_params.get("after", "")
        raw_limit = request.query_params.get("limit", "20")
        if not raw_limit.isdigit():
            raise InvalidArgument([("limit", "must be an integer between 1 and 100")])
        found, more = await self.service.batches(self._caller(request), after, int(raw_limit))
        data = [b.as_openai() for b in found]
        return _json(
            {
                "object": "list",
                "data": data,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None,
                "has_more": more,
            }
        )
