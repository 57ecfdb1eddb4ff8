"""Retrieval benchmark: ingest throughput through the running service against raw
sentence-transformers encoding of the same chunks, and search latency at 10,000 chunks.

    python -m bench.retrieval [--chunks 10000] [--queries 200]

The tokenizer and retrieval services run as their own processes (llmesh.supervisor.Mesh, as in
production; embedded Qdrant in a temporary folder); this process loads the same MiniLM for the
raw baseline. Writes bench/results/retrieval.json with ingest_chunks_s and raw_embed_chunks_s
(chunks per second), their ratio, and search latency percentiles over gRPC (plus the query
embedding time alone, so the Qdrant share is visible).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from bench.common import machine, percentile, print_table, write_result
from llmesh.supervisor import Mesh
from llmesh.testing import real_models_dir
from llmesh.v1 import common_pb2, retrieval_pb2, retrieval_pb2_grpc, tokenizer_pb2, tokenizer_pb2_grpc

RESULT = Path(__file__).resolve().parent / "results" / "retrieval.json"
CHUNK_TOKENS = 48
OVERLAP_TOKENS = 8
DOCS_PER_REQUEST = 64
SENTENCES_PER_DOC = 18
ROUNDS = 10
# Longest wait for the background HNSW build before the search phase.
INDEX_WAIT_S = 300.0

_TOPICS = {
    "billing": ("invoice", "refund", "payment", "subscription", "credit card", "receipt", "discount", "plan"),
    "security": ("password", "token", "encryption", "firewall", "audit log", "certificate", "login", "vault"),
    "travel": ("flight", "hotel", "visa", "passport", "luggage", "airport", "train", "itinerary"),
    "health": ("vaccine", "symptom", "doctor", "prescription", "allergy", "fever", "clinic", "diet"),
    "kitchen": ("oven", "recipe", "flour", "pasta", "sauce", "knife", "spices", "dough"),
    "cloud": ("cluster", "container", "replica", "load balancer", "database", "queue", "region", "backup"),
    "garden": ("tomato", "soil", "compost", "seedling", "hose", "pruning", "mulch", "greenhouse"),
    "finance": ("mortgage", "interest rate", "pension", "dividend", "tax return", "loan", "budget", "savings"),
}
_VERBS = (
    "requires",
    "updates",
    "replaces",
    "protects",
    "delays",
    "improves",
    "reduces",
    "tracks",
    "explains",
    "covers",
    "blocks",
    "schedules",
    "renews",
    "checks",
    "stores",
    "limits",
)
_ADJ = (
    "new",
    "expired",
    "monthly",
    "annual",
    "shared",
    "private",
    "urgent",
    "optional",
    "default",
    "temporary",
    "regional",
    "manual",
    "automatic",
    "large",
    "small",
    "weekly",
)
_TAILS = (
    "before the end of the month",
    "for every team member",
    "when the account is created",
    "after the first warning",
    "during the weekend",
    "in the northern region",
    "without extra cost",
    "unless the manager approves it",
    "once a week",
    "at least two days in advance",
)


def make_corpus(n_docs: int, seed: int = 7) -> list[common_pb2.Document]:
    rng = random.Random(seed)
    topics = list(_TOPICS)
    docs = []
    for i in range(n_docs):
        topic = topics[i % len(topics)]
        words = _TOPICS[topic]
        sentences = []
        for _ in range(SENTENCES_PER_DOC):
            a, b = rng.sample(words, 2)
            sentences.append(
                f"The {rng.choice(_ADJ)} {a} {rng.choice(_VERBS)} the {rng.choice(_ADJ)} {b} {rng.choice(_TAILS)}."
            )
        docs.append(common_pb2.Document(id=f"doc-{i:05d}", text=" ".join(sentences), metadata={"topic": topic}))
    return docs


def make_queries(n: int, seed: int = 11) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = _TOPICS[rng.choice(list(_TOPICS))]
        a, b = rng.sample(words, 2)
        out.append(f"Which {a} {rng.choice(_VERBS)} the {b} {rng.choice(_TAILS)}?")
    return out


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


async def _run(retrieval: str, tokenizer: str, target_chunks: int, n_queries: int) -> dict[str, Any]:
    from llmesh.embeddings import Embedder

    embedder = Embedder.load(real_models_dir(), "minilm")
    model = embedder.model
    async with (
        grpc.aio.insecure_channel(retrieval) as channel,
        grpc.aio.insecure_channel(tokenizer) as tok_channel,
    ):
        stub = retrieval_pb2_grpc.RetrievalStub(channel)
        tok_stub = tokenizer_pb2_grpc.TokenizerStub(tok_channel)

        async def chunk(doc: common_pb2.Document) -> list[str]:
            request = tokenizer_pb2.ChunkRequest(
                text=doc.text, chunk_tokens=CHUNK_TOKENS, overlap_tokens=OVERLAP_TOKENS
            )
            return [c.text for c in (await tok_stub.Chunk(request)).chunks]

        # Corpus sized from a few documents' chunk counts.
        counts = [len(await chunk(d)) for d in make_corpus(8)]
        corpus = make_corpus(int(target_chunks / statistics.mean(counts)) + 1)

        # Ingest through the service, and encode the same chunks offline with
        # sentence-transformers here, alternating part by part so both see the same machine load.
        chunks = raw_chunks = 0
        ingest_s = raw_s = 0.0
        per_round = max(DOCS_PER_REQUEST, len(corpus) // ROUNDS)
        for start in range(0, len(corpus), per_round):
            part = corpus[start : start + per_round]
            t0 = time.perf_counter()
            for i in range(0, len(part), DOCS_PER_REQUEST):
                request = retrieval_pb2.UpsertRequest(
                    collection="bench",
                    tenant="bench",
                    documents=part[i : i + DOCS_PER_REQUEST],
                    chunk_tokens=CHUNK_TOKENS,
                    overlap_tokens=OVERLAP_TOKENS,
                )
                async for progress in stub.Upsert(request, timeout=600):
                    if progress.done:
                        chunks += progress.chunks_done
            ingest_s += time.perf_counter() - t0
            texts = [t for doc in part for t in await chunk(doc)]
            t0 = time.perf_counter()
            model.encode(
                texts,
                batch_size=embedder.batch_size,
                normalize_embeddings=True,
                convert_to_tensor=True,
                show_progress_bar=False,
            )
            raw_s += time.perf_counter() - t0
            raw_chunks += len(texts)
        # Search is measured at steady state: once the store's background HNSW build (a child
        # process taking a core for tens of seconds after a large ingest) has finished.
        info_request = retrieval_pb2.CollectionInfoRequest(collection="bench", tenant="bench")
        t0 = time.perf_counter()
        info = await stub.GetCollectionInfo(info_request)
        while info.indexing and time.perf_counter() - t0 < INDEX_WAIT_S:
            await asyncio.sleep(0.5)
            info = await stub.GetCollectionInfo(info_request)
        index_wait_s = time.perf_counter() - t0

        # Search latency over gRPC.
        queries = make_queries(n_queries)

        def search(q: str, **kw: Any) -> Any:
            return stub.Search(retrieval_pb2.RetrievalSearchRequest(query=q, collection="bench", tenant="bench", **kw))

        for q in queries[:10]:  # warm-up
            await search(q)
        e2e = []
        for q in queries:
            t0 = time.perf_counter()
            await search(q)
            e2e.append(time.perf_counter() - t0)
        filtered = []
        for q in queries[: n_queries // 2]:
            t0 = time.perf_counter()
            await search(q, filter={"topic": "cloud"})
            filtered.append(time.perf_counter() - t0)
        embed_t = []
        vectors = []
        for q in queries[:100]:
            t0 = time.perf_counter()
            vectors.append(embedder.encode([q])[0])
            embed_t.append(time.perf_counter() - t0)
    embedder.close()

    ingest_rate = chunks / ingest_s
    raw_rate = raw_chunks / raw_s
    return {
        "chunks": chunks,
        "points": info.points,
        "documents": len(corpus),
        "chunk_tokens": CHUNK_TOKENS,
        "overlap_tokens": OVERLAP_TOKENS,
        "ingest_seconds": round(ingest_s, 2),
        "ingest_chunks_s": round(ingest_rate, 1),
        "raw_embed_seconds": round(raw_s, 2),
        "raw_embed_chunks_s": round(raw_rate, 1),
        "ingest_vs_raw": round(ingest_rate / raw_rate, 3),
        "target_ingest_vs_raw": 0.8,
        "index_wait_seconds": round(index_wait_s, 1),
        "indexed_points": info.indexed_points,
        "search_queries": len(e2e),
        "search_p50_ms": _ms(percentile(e2e, 0.5)),
        "search_p95_ms": _ms(percentile(e2e, 0.95)),
        "search_filtered_p50_ms": _ms(percentile(filtered, 0.5)),
        "query_embed_p50_ms": _ms(percentile(embed_t, 0.5)),
        "embedding_dtype": embedder.dtype,
        "_query_vectors": vectors,
        "target_search_p50_ms": 20.0,
        "qdrant": "embedded Qdrant Edge (qdrant-edge-py 0.9.0)",
        "services": "tokenizer and retrieval as separate processes (llmesh.supervisor.Mesh)",
    }


def qdrant_p50_ms(path: Path, vectors: Sequence[Any]) -> float:
    """p50 of the embedded-Qdrant query alone (top 4 with payloads) on the benchmark collection."""
    from llmesh.edge_store import EdgeClient
    from services.retrieval.core import physical_name

    client = EdgeClient(path, background_builds=False)
    try:
        name = physical_name("bench", "bench")
        times = []
        for vector in vectors:
            t0 = time.perf_counter()
            client.query_points(name, query=vector.tolist(), limit=4, with_payload=True)
            times.append(time.perf_counter() - t0)
    finally:
        client.close()
    return _ms(percentile(times, 0.5))


SCALE_SIZES = (10_000, 100_000)
SCALE_TOPICS = tuple(_TOPICS)


def _scale_collection(points: int) -> str:
    return f"scale{points // 1000}k"


def _scale_payload(i: int) -> dict[str, Any]:
    """What the service stores per chunk (text recycled from the corpus generator's words)."""
    topic = SCALE_TOPICS[i % len(SCALE_TOPICS)]
    a, b = _TOPICS[topic][i % 8], _TOPICS[topic][(i + 3) % 8]
    return {
        "document_id": f"doc-{i // 8:06d}",
        "chunk_index": i % 8,
        "text": f"The {_ADJ[i % 16]} {a} {_VERBS[i % 16]} the {_ADJ[(i + 5) % 16]} {b} {_TAILS[i % 10]}.",
        "metadata": {"topic": topic},
        "tenant": "bench",
        "ingest": "scale",
    }


async def _scale_search(retrieval: str, queries: list[str], rounds: int) -> dict[str, Any]:
    """Search p50/p99 over gRPC on each collection size, interleaved query by query so both sizes
    see the same machine load (query embedding included: real MiniLM on real question text)."""
    from bench.scale import ms_percentiles

    times: dict[str, list[float]] = {}
    async with grpc.aio.insecure_channel(retrieval) as channel:
        stub = retrieval_pb2_grpc.RetrievalStub(channel)

        async def search(size: int, q: str, **kw: Any) -> float:
            request = retrieval_pb2.RetrievalSearchRequest(
                query=q, collection=_scale_collection(size), tenant="bench", **kw
            )
            t0 = time.perf_counter()
            reply = await stub.Search(request)
            elapsed = time.perf_counter() - t0
            assert len(reply.results) == 4, len(reply.results)
            return elapsed

        for q in queries[:10]:  # warm-up
            for size in SCALE_SIZES:
                await search(size, q)
        for _ in range(rounds):
            for q in queries:
                for size in SCALE_SIZES:
                    times.setdefault(f"search_{size // 1000}k", []).append(await search(size, q))
                    times.setdefault(f"filtered_{size // 1000}k", []).append(
                        await search(size, q, filter={"topic": "cloud"})
                    )
    return {name: ms_percentiles(values) for name, values in times.items()}


def scale_run(n_queries: int) -> dict[str, Any]:
    """Stored random vectors at 10k and 100k chunks: store search p50/p99 through llmesh.edge_store,
    then the retrieval service's Search over gRPC on both, in one run."""
    from qdrant_client import models as qm

    from bench.scale import fill, others_running, time_searches, unit_vectors
    from llmesh.edge_store import EdgeClient
    from services.retrieval.core import INDEXED_FIELDS, chunk_point_id, physical_name

    result: dict[str, Any] = {"others_running_at_start": others_running()}
    indexes = [(f, qm.PayloadSchemaType.KEYWORD) for f in (*INDEXED_FIELDS, "metadata.topic")]
    probe = unit_vectors(300, 384, seed=99)
    topic = qm.Filter(must=[qm.FieldCondition(key="metadata.topic", match=qm.MatchValue(value="cloud"))])
    with tempfile.TemporaryDirectory(prefix="llmesh-bench-retrieval-scale-") as tmp:
        client = EdgeClient(Path(tmp) / "qdrant-edge-retrieval", background_builds=False)
        try:
            for size in SCALE_SIZES:
                physical = physical_name("bench", _scale_collection(size))
                key = f"{size // 1000}k"
                result[f"fill_{key}"] = fill(
                    client,
                    physical,
                    size,
                    384,
                    _scale_payload,
                    lambda i, p=physical: chunk_point_id(p, f"doc-{i // 8:06d}", i % 8),
                    indexes,
                )
                result[f"store_search_{key}"] = time_searches(client, physical, probe, None)
                result[f"store_filtered_{key}"] = time_searches(client, physical, probe, topic)
        finally:
            client.close()
        env = {
            "LLMESH_MODELS_DIR": str(real_models_dir()),
            "LLMESH_DATA_DIR": tmp,
            "QDRANT_URL": "",
            "LLMESH_LOG_LEVEL": "WARNING",
        }
        with Mesh(env=env, services=("tokenizer", "retrieval")) as mesh:
            result.update(asyncio.run(_scale_search(mesh.target("retrieval"), make_queries(n_queries), rounds=1)))
    lo, hi = (f"{size // 1000}k" for size in (SCALE_SIZES[0], SCALE_SIZES[-1]))
    s_hi, s_lo = result[f"search_{hi}"]["p50_ms"], result[f"search_{lo}"]["p50_ms"]
    result[f"search_p50_{hi}_minus_{lo}_ms"] = round(s_hi - s_lo, 2)
    result["passes"] = {
        f"store_search_p50_ms@{hi}<=2": result[f"store_search_{hi}"]["p50_ms"] <= 2,
        f"store_filtered_p50_ms@{hi}<=5": result[f"store_filtered_{hi}"]["p50_ms"] <= 5,
        f"search_p50@{hi}<=search_p50@{lo}+5ms": s_hi <= s_lo + 5,
    }
    result["qdrant"] = "embedded Qdrant Edge (qdrant-edge-py 0.9.0), HNSW built by the background build"
    result["machine"] = machine()
    return result


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=10_000)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--out", type=Path, default=RESULT)
    parser.add_argument(
        "--scale", action="store_true", help="the scale run (stored vectors, 10k vs 100k) -> retrieval_scale.json"
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # SIGTERM (a timeout) unwinds normally, so the service processes are stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.scale:
        scale = scale_run(args.queries)
        print_table({k: v for k, v in scale.items() if k not in ("passes", "machine")}, "bench.retrieval --scale")
        print_table(scale["passes"], "targets")
        print(f"wrote {write_result('retrieval_scale', scale)}")
        return
    with tempfile.TemporaryDirectory(prefix="llmesh-bench-retrieval-") as tmp:
        env = {
            "LLMESH_MODELS_DIR": str(real_models_dir()),
            "LLMESH_DATA_DIR": tmp,
            "QDRANT_URL": "",
            "LLMESH_LOG_LEVEL": "WARNING",
        }
        with Mesh(env=env, services=("tokenizer", "retrieval")) as mesh:
            result = asyncio.run(_run(mesh.target("retrieval"), mesh.target("tokenizer"), args.chunks, args.queries))
        # The service has stopped and released its store: time the Qdrant part of a search alone.
        store = Path(tmp) / "qdrant-edge-retrieval"
        result["search_qdrant_p50_ms"] = qdrant_p50_ms(store, result.pop("_query_vectors"))
    result["passes"] = {
        "ingest_chunks_s>=0.8*raw_embed_chunks_s": result["ingest_vs_raw"] >= 0.8,
        "search_p50_ms<=20": result["search_p50_ms"] <= 20,
    }
    result["machine"] = machine()
    print_table({k: v for k, v in result.items() if k not in ("passes", "machine")}, "bench.retrieval")
    print_table(result["passes"], "targets")
    if args.out == RESULT:
        path = write_result("retrieval", result)
    else:
        path = args.out
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
