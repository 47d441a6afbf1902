"""MoCo v2/v3 training: data, augmentations, backbones, objectives, the distributed loop, checkpoints, evaluation.

Importing the package is free: torch is only imported by the submodules that need it (``config``,
``recipe_table``, ``imagefolder`` and ``demo_data`` are torch-free, so ``moco --help`` and the demo's image
generator load without it). The other stages never import this package: they meet it through the encoder file.
"""
