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
                convert_to_numpy=True,
                show_progress_bar=False,
            )
            raw_s += time.perf_counter() - t0
            raw_chunks += len(texts)
        info = await stub.GetCollectionInfo(retrieval_pb2.CollectionInfoRequest(collection="bench", tenant="bench"))

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
        "search_queries": len(e2e),
        "search_p50_ms": _ms(percentile(e2e, 0.5)),
        "search_p95_ms": _ms(percentile(e2e, 0.95)),
        "search_filtered_p50_ms": _ms(percentile(filtered, 0.5)),
        "query_embed_p50_ms": _ms(percentile(embed_t, 0.5)),
        "_query_vectors": vectors,
        "target_search_p50_ms": 20.0,
        "qdrant": "embedded local mode",
        "services": "tokenizer and retrieval as separate processes (llmesh.supervisor.Mesh)",
    }


def qdrant_p50_ms(path: Path, vectors: Sequence[Any]) -> float:
    """p50 of the embedded-Qdrant query alone (top 4 with payloads) on the benchmark collection."""
    from qdrant_client import QdrantClient

    from services.retrieval.core import physical_name

    client = QdrantClient(path=str(path))
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


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=10_000)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # SIGTERM (a timeout) unwinds normally, so the service processes are stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
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
        result["search_qdrant_p50_ms"] = qdrant_p50_ms(Path(tmp) / "qdrant-retrieval", result.pop("_query_vectors"))
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
