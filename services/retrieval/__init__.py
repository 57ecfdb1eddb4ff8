"""Retrieval service: token-aware chunking, MiniLM embeddings and Qdrant search for RAG."""
