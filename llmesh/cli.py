"""`llmesh` command line: run the mesh, ask it, feed it documents, prepare models."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from google.protobuf.json_format import MessageToDict


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
    from llmesh.settings import DEFAULT_PORTS
    from llmesh.supervisor import Mesh as Processes

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    procs = Processes(ports=DEFAULT_PORTS, echo_logs=not args.quiet)
    stop = {"now": False}

    def on_signal(signum: int, frame: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    started = time.perf_counter()
    try:
        procs.start(timeout=args.start_timeout)
    except RuntimeError as exc:
        print(f"llmesh up: {exc}", file=sys.stderr)
        return 1
    print(
        f"llmesh: mesh ready in {time.perf_counter() - started:.1f}s; gateway on "
        f"{procs.target('gateway')} (Ctrl-C stops)",
        file=sys.stderr,
        flush=True,
    )
    try:
        while not stop["now"]:
            for name, sp in list(procs.procs.items()):
                if sp.proc.poll() is not None:
                    print(f"llmesh up: {name} exited with {sp.proc.returncode}; stopping", file=sys.stderr)
                    stop["now"] = True
            time.sleep(0.5)
    finally:
        print("llmesh: stopping (draining in-flight calls)", file=sys.stderr, flush=True)
        procs.stop()
    return 0


def _ask_options(args: argparse.Namespace) -> dict[str, object]:
    options: dict[str, object] = {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "collection": args.collection,
        "tenant": args.tenant,
    }
    if args.seed is not None:
        options["seed"] = args.seed
    if args.no_cache:
        options["use_cache"] = False
    if args.no_retrieval:
        options["use_retrieval"] = False
    return options


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
                print()
            return 0
        response = mesh.ask(args.question, **_ask_options(args))
        if args.json:
            _print_json(response)
        else:
            print(response.text)
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
    from llmesh import models
    from llmesh.settings import load_or_exit

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    settings = load_or_exit("cli")
    base = settings.models_path
    if args.action == "prepare":
        for path in models.prepare_all(base):
            info = models.verify(path)
            print(f"{info.model_id}: {path} (sha256 {info.digest[:16]})")
        return 0
    failed = 0
    for name in (models.SMOLLM2, models.MINILM):
        try:
            info = models.verify(models.resolve(base, name))
            print(f"ok  {name}: version {info.version}, sha256 {info.digest[:16]}")
        except models.ModelError as exc:
            failed += 1
            print(f"BAD {name}: {exc}", file=sys.stderr)
    return 1 if failed else 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Runs the benchmarks (each in its own process, as `python -m bench.<name>`), then prints
    the README table from bench/results."""
    import subprocess

    failed = [n for n in args.names if subprocess.run([sys.executable, "-m", f"bench.{n}"]).returncode != 0]
    subprocess.run([sys.executable, "-m", "bench.report", *(["--readme"] if args.readme else [])], check=False)
    if failed:
        print(f"llmesh bench: failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


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

    models = sub.add_parser("models", help="prepare or verify the models")
    models.add_argument("action", choices=("prepare", "verify"))
    models.set_defaults(func=cmd_models)

    bench = sub.add_parser("bench", help="run benchmarks (default: all)")
    bench.add_argument(
        "names", nargs="*", default=["batching", "cache", "retrieval", "tracing", "reliability", "backends"]
    )
    bench.add_argument("--readme", action="store_true", help="also rewrite the README benchmark table")
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
