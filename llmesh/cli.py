"""`llmesh` command line: run the mesh, ask it, feed it documents, prepare models."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from google.protobuf.json_format import MessageToDict

from llmesh.v1 import common_pb2, gateway_pb2


def _print_json(message: object) -> None:
    print(json.dumps(MessageToDict(message, preserving_proto_field_name=True), indent=2))  # type: ignore[arg-type]


def _client(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from llmesh.client import Mesh

    return Mesh(
        args.target,
        api_key=args.api_key,
        ca_file=args.ca_file,
        cert_file=args.cert_file,
        key_file=args.key_file,
        timeout=args.timeout,
    )


def cmd_up(args: argparse.Namespace) -> int:
    """Starts the mesh and supervises it: a service that dies is restarted (see Supervision);
    Ctrl-C or SIGTERM stops the mesh (status 0), so does a service that keeps dying (status 1)."""
    from llmesh.redis_server import EmbeddedRedisError, redacted, up_state_default
    from llmesh.settings import DEFAULT_PORTS, CliSettings, load_or_exit
    from llmesh.supervisor import LogEcho, Supervision
    from llmesh.supervisor import Mesh as Processes

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # The mesh's credential, new for each start: the internal services answer only the processes
    # started here (any other local process reaches their ports, but not their methods).
    os.environ.setdefault("LLMESH_MESH_TOKEN", secrets.token_urlsafe(32))
    # The gateway's durable state (batch jobs, stored responses) in the embedded state Redis,
    # unless one is named; the admission window stays per process (see llmesh/redis_server.py).
    os.environ.update(up_state_default(os.environ))
    supervision = Supervision.from_settings(load_or_exit(CliSettings))
    procs = Processes(ports=DEFAULT_PORTS, echo_logs=not args.quiet, supervision=supervision)
    say = (procs.echo or LogEcho(os.environ.get("LLMESH_LOG_FORMAT", "auto"))).say
    stop = {"now": False}

    def on_signal(signum: int, frame: object) -> None:
        stop["now"] = True
        procs.request_stop()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    started = time.perf_counter()
    try:
        procs.start(timeout=args.start_timeout)
    except (RuntimeError, EmbeddedRedisError) as exc:
        say(f"llmesh up: {exc}", level="ERROR")
        return 1
    try:
        openai_api = procs.procs["gateway"].http_base_url(10)
    except RuntimeError:
        openai_api = "off"  # LLMESH_HTTP_LISTEN is empty
    say(
        f"mesh ready in {time.perf_counter() - started:.1f}s (Ctrl-C stops)",
        gateway=procs.target("gateway"),
        openai_api=openai_api,
        redis=redacted(procs.redis.url) if procs.redis else "LLMESH_REDIS_URL",
        state_redis=redacted(procs.redis_state.url) if procs.redis_state else "LLMESH_STATE_REDIS_URL",
        metrics=f"{supervision.metrics_host}:{procs.metrics.port}" if procs.metrics else "off",
    )
    if procs.models:
        say("models: " + ", ".join(f"{m} at {procs.target(f'inference/{m}')}" for m in procs.models))
    try:
        # Short waits: the signal handler runs between them.
        while not stop["now"] and not procs.failed.wait(0.5):
            pass
        if procs.failure is not None:
            failure = procs.failure
            say(
                f"{failure}; stopping",
                level="ERROR",
                process=failure.service,
                exit=failure.exit,
                restarts_last_minute=failure.restarts_last_minute,
            )
    finally:
        say("stopping (draining in-flight calls)")
        procs.stop()
        say("stopped")
    return 1 if procs.failure is not None else 0


def _ask_options(args: argparse.Namespace) -> dict[str, object]:
    options: dict[str, object] = {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "collection": args.collection,
        "tenant": args.tenant,
        "model": args.model,
    }
    if args.seed is not None:
        options["seed"] = args.seed
    if args.no_cache:
        options["use_cache"] = False
    if args.no_retrieval:
        options["use_retrieval"] = False
    return options


# What each degradation the gateway reports means to the person who asked.
DEGRADATION_NOTES = {
    "cache_unavailable": "no cache: the cache was unreachable, so this answer was generated and not cached",
    "retrieval_unavailable": "no context: retrieval was unreachable, so the answer ignores your documents",
    "max_new_tokens_capped": "tokens capped: the mesh was busy, max_new_tokens was lowered ({tokens} tokens generated)",
    "tokenizer_estimate": "the tokenizer was unreachable: admission used an estimated token count",
}


def answer_notes(response: gateway_pb2.GenerateResponse) -> list[str]:
    """Short notes on how an answer was made: served from the cache, or degraded."""
    notes = []
    if response.cache.hit:
        tier = common_pb2.CacheTier.Name(response.cache.tier).removeprefix("CACHE_TIER_").lower()
        similarity = "" if tier == "exact" else f", similarity {response.cache.similarity:.2f}"
        notes.append(f"served from the cache ({tier} match{similarity})")
    for what in response.degradations:
        note = DEGRADATION_NOTES.get(what, "degraded: {what}")
        notes.append(note.format(tokens=response.usage.output_tokens, what=what))
    return notes


def _print_notes(response: gateway_pb2.GenerateResponse) -> None:
    for note in answer_notes(response):
        print(f"llmesh: {note}", file=sys.stderr)


def cmd_ask(args: argparse.Namespace) -> int:
    with _client(args) as mesh:
        if args.stream:
            final = None
            for message in mesh.stream(args.question, **_ask_options(args)):
                if message.HasField("final"):
                    final = message.final
                elif not args.json:
                    print(message.delta, end="", flush=True)
            if args.json and final is not None:
                _print_json(final)
            elif not args.json:
                print(flush=True)
            if final is not None:
                _print_notes(final)
            return 0
        response = mesh.ask(args.question, **_ask_options(args))
        if args.json:
            _print_json(response)
        else:
            print(response.text, flush=True)
        _print_notes(response)
    return 0


def cmd_ingest(args: argparse.Namespace) -> int:
    files = [Path(f) for f in args.files]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        print(f"llmesh ingest: no such file: {', '.join(missing)}", file=sys.stderr)
        return 2
    totals = {"documents": 0, "chunks": 0, "collection_version": 0}
    with _client(args) as mesh:
        for i, path in enumerate(files, 1):
            text = path.read_text(encoding="utf-8", errors="replace")
            result = mesh.ingest(
                [(path.name, text)],
                collection=args.collection,
                tenant=args.tenant,
                chunk_tokens=args.chunk_tokens,
                overlap_tokens=args.overlap_tokens,
            )
            totals["documents"] += result.documents
            totals["chunks"] += result.chunks
            totals["collection_version"] = result.collection_version
            if not args.json:
                _progress(i, len(files), path.name)
    if args.json:
        print(json.dumps(totals))
    else:
        print(
            f"\ningested {totals['documents']} documents, {totals['chunks']} chunks "
            f"(collection version {totals['collection_version']})"
        )
    return 0


def _progress(done: int, total: int, label: str) -> None:
    width = 30
    filled = int(width * done / max(total, 1))
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label[:40]:<40}")
    sys.stderr.flush()


BATCH_ENDED = ("completed", "failed", "cancelled", "expired")


@contextlib.contextmanager
def _batch_calls(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """Calls of the Batches service with the client's options (key, TLS, timeout), its errors
    turned into MeshError."""
    import grpc

    from llmesh.client import ClientOptions, to_mesh_error
    from llmesh.v1 import batches_pb2_grpc

    opts = ClientOptions(
        target=args.target,
        api_key=args.api_key,
        ca_file=args.ca_file,
        cert_file=args.cert_file,
        key_file=args.key_file,
        timeout=args.timeout,
    )
    creds, options = opts.credentials(), opts.channel_options()
    channel = grpc.secure_channel(args.target, creds, options) if creds else grpc.insecure_channel(args.target, options)
    stub = batches_pb2_grpc.BatchesStub(channel)

    def call(method: str, request: object) -> object:
        try:
            return getattr(stub, method)(request, timeout=opts.timeout, metadata=opts.metadata())
        except grpc.RpcError as err:
            raise to_mesh_error(err) from None

    with channel:
        yield call


def _batch_line(batch: object) -> str:
    counts = batch.request_counts  # type: ignore[attr-defined]
    return f"{batch.id} {batch.status}: {counts.completed} ok, {counts.failed} failed of {counts.total}"  # type: ignore[attr-defined]


def _batch_watch(call, batch_id: str, tenant: str, every: float) -> object:  # type: ignore[no-untyped-def]
    """Polls the job until it ends, drawing its progress; returns the ended job."""
    from llmesh.v1 import batches_pb2

    while True:
        batch = call("GetBatch", batches_pb2.BatchRequest(batch_id=batch_id, tenant=tenant))
        counts = batch.request_counts
        _progress(counts.completed + counts.failed, counts.total, batch.status)
        if batch.status in BATCH_ENDED:
            sys.stderr.write("\n")
            return batch
        time.sleep(every)


def cmd_batch(args: argparse.Namespace) -> int:
    from llmesh.v1 import batches_pb2

    with _batch_calls(args) as call:
        tenant = args.tenant
        if args.action == "submit":
            path = Path(args.file)
            if not path.is_file():
                print(f"llmesh batch: no such file: {path}", file=sys.stderr)
                return 2
            uploaded = call(
                "CreateFile",
                batches_pb2.CreateFileRequest(
                    filename=path.name, purpose="batch", content=path.read_bytes(), tenant=tenant
                ),
            )
            metadata = dict(pair.split("=", 1) for pair in args.metadata)
            batch = call(
                "CreateBatch",
                batches_pb2.CreateBatchRequest(
                    input_file_id=uploaded.id,  # type: ignore[attr-defined]
                    endpoint=args.endpoint,
                    completion_window=args.completion_window,
                    metadata=metadata,
                    tenant=tenant,
                ),
            )
            if args.wait:
                batch = _batch_watch(call, batch.id, tenant, args.every)  # type: ignore[attr-defined]
        elif args.action == "status":
            if args.wait:
                batch = _batch_watch(call, args.batch_id, tenant, args.every)
            else:
                batch = call("GetBatch", batches_pb2.BatchRequest(batch_id=args.batch_id, tenant=tenant))
                counts = batch.request_counts  # type: ignore[attr-defined]
                if not args.json:
                    _progress(counts.completed + counts.failed, counts.total, batch.status)  # type: ignore[attr-defined]
                    sys.stderr.write("\n")
        elif args.action == "cancel":
            batch = call("CancelBatch", batches_pb2.BatchRequest(batch_id=args.batch_id, tenant=tenant))
        else:  # results
            batch = call("GetBatch", batches_pb2.BatchRequest(batch_id=args.batch_id, tenant=tenant))
            file_id = batch.error_file_id if args.errors else batch.output_file_id  # type: ignore[attr-defined]
            if not file_id:
                what = "error" if args.errors else "output"
                print(f"llmesh batch: {_batch_line(batch)}: no {what} file (yet)", file=sys.stderr)
                return 1
            content = call("GetFileContent", batches_pb2.FileRequest(file_id=file_id, tenant=tenant))
            data = content.content  # type: ignore[attr-defined]
            if args.output:
                Path(args.output).write_bytes(data)
                lines = data.count(b"\n")
                print(f"wrote {lines} lines to {args.output}", file=sys.stderr)
            else:
                sys.stdout.buffer.write(data)
                sys.stdout.flush()
            return 0
        if args.json:
            _print_json(batch)
        else:
            print(_batch_line(batch))
    return 0


def cmd_search(args: argparse.Namespace) -> int:
    with _client(args) as mesh:
        response = mesh.search(args.query, collection=args.collection, tenant=args.tenant, top_k=args.top_k)
    if args.json:
        _print_json(response)
        return 0
    for r in response.results:
        print(f"{r.score:.3f}  {r.document_id}#{r.chunk_index}  {r.text[:100]!r}")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from llmesh import telemetry

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    telemetry.quiet_progress_bars()  # before the model libraries are imported: they read it then
    from llmesh import models
    from llmesh.settings import CliSettings, load_or_exit

    settings = load_or_exit(CliSettings)
    base = settings.runtime.models_path
    try:
        if args.action == "prepare":
            for path in models.prepare_all(base):
                info = models.verify(path)
                print(f"{info.model_id}: {path} (sha256 {info.digest[:16]})")
            return 0
        if args.action == "import":
            return _import_model(args, base)
        if args.action == "list":
            return _list_models(args, base)
    except models.ModelError as exc:
        print(f"llmesh models {args.action}: {exc}", file=sys.stderr)
        return 2
    stored = models.catalog(base)
    if not stored:
        print(f"llmesh models verify: no models under {base}; run `llmesh models prepare`", file=sys.stderr)
        return 1
    failed = 0
    for entry in stored:
        label = f"{entry.name}/{entry.version}{' (current)' if entry.current else ''}"
        try:
            info = models.verify(entry.path)
            print(f"ok  {label}: sha256 {info.digest[:16]}")
        except models.ModelError as exc:
            failed += 1
            print(f"BAD {label}: {exc}", file=sys.stderr)
    return 1 if failed else 0


def _import_model(args: argparse.Namespace, base: Path) -> int:
    from tqdm import tqdm

    from llmesh.model_import import import_model

    bars: list[tqdm] = []

    def progress(total: int):  # type: ignore[no-untyped-def]
        bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"copying and hashing {args.name}", file=sys.stderr)
        bars.append(bar)
        return bar.update

    try:
        imported = import_model(
            args.source,
            base,
            args.name,
            version=args.version,
            kind=args.kind,
            chat_template=Path(args.chat_template) if args.chat_template else None,
            revision=args.revision,
            progress=progress,
        )
    finally:
        for bar in bars:
            bar.close()
    print(
        f"imported {imported.name}/{imported.version} ({imported.kind}, {imported.architecture}, "
        f"{imported.files} files, {_size(imported.bytes)}) at {imported.path}; current -> {imported.version}"
    )
    return 0


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} GB"


def _list_models(args: argparse.Namespace, base: Path) -> int:
    from llmesh import models

    stored = models.catalog(base)
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "name": e.name,
                        "version": e.version,
                        "current": e.current,
                        "kind": e.kind,
                        "model_id": e.model_id,
                        "bytes": e.size,
                        "sha256": e.digest,
                        "path": str(e.path),
                    }
                    for e in stored
                ],
                indent=2,
            )
        )
        return 0
    if not stored:
        print(f"no models under {base}; run `llmesh models prepare` or `llmesh models import`")
        return 0
    rows = [("NAME", "VERSION", "CURRENT", "KIND", "SIZE", "SHA256", "MODEL")]
    rows += [
        (e.name, e.version, "*" if e.current else "", e.kind, _size(e.size), e.digest[:16], e.model_id) for e in stored
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Runs the benchmarks (each in its own process, as `python -m bench.<name>`), then prints
    the docs/benchmarks.md table from bench/results."""
    import subprocess

    failed = [n for n in args.names if subprocess.run([sys.executable, "-m", f"bench.{n}"]).returncode != 0]
    subprocess.run([sys.executable, "-m", "bench.report", *(["--write"] if args.readme else [])], check=False)
    if failed:
        print(f"llmesh bench: failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def cmd_keys(args: argparse.Namespace) -> int:
    """`llmesh keys create|list|revoke`: edits the API keys file the gateway re-reads on change."""
    from pathlib import Path

    from llmesh import keys_file

    path_text = args.file or os.environ.get("LLMESH_API_KEYS_FILE", "")
    if not path_text:
        print("llmesh keys: name the keys file with --file or LLMESH_API_KEYS_FILE", file=sys.stderr)
        return 2
    path = Path(path_text)
    try:
        if args.action == "create":
            models = tuple(m.strip() for m in (args.models or "").split(",") if m.strip())
            record, key = keys_file.create(
                path, args.tenant, models=models, rpm=args.rpm, tpm=args.tpm, tpd=args.tpd, name=args.name
            )
            if args.json:
                print(json.dumps({**record.to_json(), "key": key}))
            else:
                print(key)
                print(f"llmesh: created key {record.id} for tenant {record.tenant} in {path}; the key is shown only "
                      "this once (the file keeps its sha256)", file=sys.stderr)  # fmt: skip
            return 0
        if args.action == "revoke":
            record = keys_file.revoke(path, args.id)
            print(f"llmesh: revoked key {record.id} (tenant {record.tenant}); gateways drop it within seconds",
                  file=sys.stderr)  # fmt: skip
            return 0
        records = keys_file.load(path)
    except keys_file.KeysFileError as exc:
        print(f"llmesh keys: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps([{k: v for k, v in r.to_json().items() if k != "sha256"} for r in records], indent=2))
        return 0
    rows: list[tuple[str, ...]] = [("ID", "TENANT", "MODELS", "RPM", "TPM", "TPD", "NAME", "CREATED")]
    for r in records:
        limits = [str(v) if v else "-" for v in (r.rpm, r.tpm, r.tpd)]
        rows.append((r.id, r.tenant, ",".join(r.models) or "*", *limits, r.name, r.created_at))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmesh", description="LLM serving mesh")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start all five services on their default ports")
    up.add_argument("--quiet", action="store_true", help="do not echo service logs")
    up.add_argument("--start-timeout", type=float, default=300)
    up.set_defaults(func=cmd_up)

    def client_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--target", default=os.environ.get("LLMESH_GATEWAY", "127.0.0.1:50051"))
        p.add_argument("--api-key", default=os.environ.get("LLMESH_API_KEY"))
        p.add_argument("--ca-file")
        p.add_argument("--cert-file")
        p.add_argument("--key-file")
        p.add_argument("--timeout", type=float, default=120)
        p.add_argument("--json", action="store_true", help="print machine-readable JSON")
        p.add_argument("--collection", default="")
        p.add_argument("--tenant", default="")

    ask = sub.add_parser("ask", help="ask the mesh a question")
    ask.add_argument("question")
    client_args(ask)
    ask.add_argument("--stream", action="store_true")
    ask.add_argument("--max-new-tokens", type=int, default=0)
    ask.add_argument("--temperature", type=float, default=0.0)
    ask.add_argument("--top-p", type=float, default=0.0)
    ask.add_argument("--seed", type=int)
    ask.add_argument("--top-k", type=int, default=0)
    ask.add_argument("--no-cache", action="store_true")
    ask.add_argument("--no-retrieval", action="store_true")
    ask.add_argument("--model", default="", help="one of the gateway's models by name (default: its default)")
    ask.set_defaults(func=cmd_ask)

    ingest = sub.add_parser("ingest", help="add text files to a collection")
    ingest.add_argument("files", nargs="+")
    client_args(ingest)
    ingest.add_argument("--chunk-tokens", type=int, default=0)
    ingest.add_argument("--overlap-tokens", type=int, default=0)
    ingest.set_defaults(func=cmd_ingest)

    search = sub.add_parser("search", help="search a collection")
    search.add_argument("query")
    client_args(search)
    search.add_argument("--top-k", type=int, default=0)
    search.set_defaults(func=cmd_search)

    models = sub.add_parser("models", help="prepare, import, list or verify the models")
    models_sub = models.add_subparsers(dest="action", required=True)
    models_sub.add_parser("prepare", help="convert the packaged models (SmolLM2, MiniLM)")
    models_sub.add_parser("verify", help="check every file of every model version against its manifest")
    listing = models_sub.add_parser("list", help="every model, its versions, the current one, sizes and digests")
    listing.add_argument("--json", action="store_true", help="print machine-readable JSON")
    imports = models_sub.add_parser("import", help="import a Hugging Face model directory (or hub id)")
    imports.add_argument("source", help="a local model directory, or a hub id where a hub is reachable")
    imports.add_argument("--name", required=True, help="the model's name in the mesh (LLMESH_MODEL)")
    imports.add_argument("--version", help="the version folder (default: the next vN)")
    imports.add_argument("--kind", choices=("causal-lm", "embedding"), default="causal-lm")
    imports.add_argument("--chat-template", help="a Jinja chat template file, for tokenizers without one")
    imports.add_argument("--revision", help="hub revision (branch, tag or commit) to pin")
    models.set_defaults(func=cmd_models)

    keys = sub.add_parser("keys", help="create, list or revoke gateway API keys (the LLMESH_API_KEYS_FILE)")
    keys_sub = keys.add_subparsers(dest="action", required=True)
    create = keys_sub.add_parser("create", help="a new key for a tenant; prints the key once")
    create.add_argument("--tenant", required=True, help="the tenant it acts for (`*`: any the request names)")
    create.add_argument("--models", default="", help="models it may use, comma-separated (default: all)")
    create.add_argument("--rpm", type=int, default=0, help="requests per minute (0: no limit)")
    create.add_argument("--tpm", type=int, default=0, help="tokens per minute (0: no limit)")
    create.add_argument("--tpd", type=int, default=0, help="tokens per UTC day (0: no limit)")
    create.add_argument("--name", default="", help="what the key is for (shown by `list`)")
    keys_sub.add_parser("list", help="every key: id, tenant, models, limits (never the key)")
    revoke = keys_sub.add_parser("revoke", help="remove a key by id; gateways refuse it within seconds")
    revoke.add_argument("id")
    for p in (keys, *keys_sub.choices.values()):
        p.add_argument("--file", default=argparse.SUPPRESS if p is not keys else "", help="the keys file")
        p.add_argument("--json", action="store_true", default=argparse.SUPPRESS if p is not keys else False)
    keys.set_defaults(func=cmd_keys)

    batch = sub.add_parser("batch", help="submit a batch of requests, follow it, read its results, cancel it")
    batch_sub = batch.add_subparsers(dest="action", required=True)
    submit = batch_sub.add_parser("submit", help="upload a JSONL file of requests and start a batch job")
    submit.add_argument("file", help="JSONL: one {custom_id, method, url, body} per line (OpenAI's batch input)")
    submit.add_argument("--endpoint", default="/v1/chat/completions")
    submit.add_argument("--completion-window", default="24h")
    submit.add_argument("--metadata", action="append", default=[], metavar="KEY=VALUE")
    submit.add_argument("--wait", action="store_true", help="follow the job with a progress bar until it ends")
    status = batch_sub.add_parser("status", help="a job's status and progress")
    status.add_argument("batch_id")
    status.add_argument("--wait", action="store_true", help="follow the job with a progress bar until it ends")
    results = batch_sub.add_parser("results", help="a job's output file (or --errors: its error file)")
    results.add_argument("batch_id")
    results.add_argument("--errors", action="store_true")
    results.add_argument("-o", "--output", help="write to this file instead of standard output")
    cancel = batch_sub.add_parser("cancel", help="stop a job's remaining lines")
    cancel.add_argument("batch_id")
    for p in (submit, status, results, cancel):
        client_args(p)
        p.add_argument("--every", type=float, default=1.0, help=argparse.SUPPRESS)
    batch.set_defaults(func=cmd_batch)

    bench = sub.add_parser("bench", help="run benchmarks (default: all)")
    bench.add_argument(
        "names", nargs="*", default=["batching", "cache", "retrieval", "tracing", "reliability", "backends"]
    )
    bench.add_argument("--readme", action="store_true", help="also rewrite the table in docs/benchmarks.md")
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from llmesh.client import MeshError

    try:
        return int(args.func(args))
    except MeshError as exc:
        detail = "".join(f"\n  {f}: {d}" for f, d in exc.field_violations)
        retry = f" (retry after {exc.retry_after:.1f}s)" if exc.retry_after else ""
        if getattr(args, "json", False):
            print(
                json.dumps(
                    {
                        "error": exc.code.name,
                        "message": exc.message,
                        "retry_after": exc.retry_after,
                        "field_violations": exc.field_violations,
                    }
                )
            )
        print(f"llmesh: {exc.code.name}: {exc.message}{retry}{detail}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
