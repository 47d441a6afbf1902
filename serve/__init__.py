"""The serving stage: a search engine over a published index directory (embed a query with the index's own
encoder, search FAISS, read LMDB metadata, vote k-NN labels), request micro-batching, hot swap to a newly
published generation, and the FastAPI JSON API. Imports :mod:`indexer`, never torch, never :mod:`app`.
"""
