"""The indexing stage: the embedding runtime (ONNX Runtime + the preprocessing an encoder declares), folder
scanning, FAISS index building, the LMDB metadata store and the index-directory format. Never imports torch.
"""
