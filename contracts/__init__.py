"""The contracts the stages share, each written once: errors (:mod:`contracts.errors`), image files and their
decoding (:mod:`contracts.images`), the encoder file format (:mod:`contracts.encoder_format`), atomic writes
(:mod:`contracts.atomic`), the k-NN defaults (:mod:`contracts.knn`) and the launcher's environment
(:mod:`contracts.launch`).

Torch-free and import-light (standard library, numpy, Pillow): ``trainer`` imports it, and ``indexer``,
``serve`` and ``app`` import it without pulling in torch. It imports nothing else from the project.
"""
