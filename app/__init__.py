"""The ``moco`` command line and the Gradio app: the user-facing layer over trainer, indexer and serve."""
