"""Weighted k-NN classification of frozen features (Wu et al. 2018, as used to monitor MoCo).

Cosine similarity between L2-normalised features; each of the k nearest training samples votes for its
class with weight ``exp(similarity / T)``.
"""

from __future__ import annotations

import torch

from moco_retrieval.contracts.knn import KNN_K, KNN_TEMPERATURE


@torch.no_grad()
def knn_predict(
    train_features: torch.Tensor,
    train_labels: torch.Tensor,
    query_features: torch.Tensor,
    num_classes: int,
    k: int = KNN_K,
    temperature: float = KNN_TEMPERATURE,
    exclude_self: bool = False,
    chunk: int = 1024,
) -> torch.Tensor:
    """Class scores of each query by a weighted vote of its k nearest training samples.

    Args:
        train_features: [N, D] L2-normalised.
        train_labels: [N] int64 in [0, num_classes).
        query_features: [M, D] L2-normalised.
        k: neighbours (clipped to the available samples).
        temperature: vote weight ``exp(sim / temperature)``.
        exclude_self: leave-one-out; requires the queries to be the training samples (M == N, same order).
        chunk: queries per block, bounding memory to [chunk, N].

    Returns:
        [M, num_classes] vote totals (higher is more likely).
    """
    n = train_features.shape[0]
    k = min(k, n - 1 if exclude_self else n)
    scores = []
    for start in range(0, query_features.shape[0], chunk):
        sims = query_features[start : start + chunk] @ train_features.T  # chunk x N
        if exclude_self:
            rows = torch.arange(sims.shape[0])
            sims[rows, rows + start] = -float("inf")
        top_sims, top_idx = sims.topk(k, dim=1)  # chunk x k
        weights = (top_sims / temperature).exp()
        votes = torch.zeros(sims.shape[0], num_classes)
        votes.scatter_add_(1, train_labels[top_idx], weights)
        scores.append(votes)
    return torch.cat(scores)


def knn_accuracy(
    train_features: torch.Tensor,
    train_labels: torch.Tensor,
    test_features: torch.Tensor | None = None,
    test_labels: torch.Tensor | None = None,
    k: int = KNN_K,
    temperature: float = KNN_TEMPERATURE,
) -> float:
    """Top-1 accuracy (0-1) of weighted k-NN; leave-one-out on the training set when no test set is given."""
    num_classes = int(train_labels.max()) + 1
    if test_features is None:
        scores = knn_predict(train_features, train_labels, train_features, num_classes, k, temperature, True)
        test_labels = train_labels
    else:
        num_classes = max(num_classes, int(test_labels.max()) + 1)
        scores = knn_predict(train_features, train_labels, test_features, num_classes, k, temperature)
    return (scores.argmax(1) == test_labels).float().mean().item()
