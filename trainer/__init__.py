"""MoCo v2/v3 training: data, augmentations, backbones, objectives, the distributed loop, checkpoints, evaluation.

Importing the package is free: torch is only imported by the submodules that need it, so the torch-free
modules here (``errors``, ``imagefolder``, ``demo_data``) can be used by the indexer and the server.
"""
