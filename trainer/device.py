"""Where training runs: the torch device of this process (its GPU under torchrun, else the CPU)."""
from __future__ import annotations

import torch

from contracts.errors import ConfigError


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """``auto`` -> this process's GPU when CUDA is usable, else the CPU. Raises ConfigError for an absent GPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {name} requested but no CUDA GPU is usable here; use --device cpu")
        index = int(name.split(":")[1]) if ":" in name else local_rank
        if index >= torch.cuda.device_count():
            raise ConfigError(f"--device cuda:{index} does not exist ({torch.cuda.device_count()} GPUs visible)")
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")
