"""Weighted k-NN classification of frozen features (Wu et al. 2018, as used to monitor MoCo).

Cosine similarity between L2-normalised features; each of the k nearest training samples votes for its
class with weight ``exp(similarity / T)``. Also the raw-pixel baseline: plain L2 k-NN on the images themselves.
"""

from __future__ import annotations

import torch

from moco_retrieval.contracts.knn import KNN_K, KNN_TEMPERATURE

PIXEL_KS = (1, 5, 20)  # the raw-pixel baseline reports its best k of these


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


@torch.no_grad()
def pixel_knn_accuracy(
    train_pixels: torch.Tensor,
    train_labels: torch.Tensor,
    test_pixels: torch.Tensor | None = None,
    test_labels: torch.Tensor | None = None,
    ks: tuple[int, ...] = PIXEL_KS,
    chunk: int = 1024,
) -> dict[int, float]:
    """Top-1 accuracy (0-1) of plain majority-vote k-NN on raw pixels by L2 distance, for each k of ``ks``: the
    baseline a trained encoder must beat (issue 20). Leave-one-out when no test set is given.

    Args:
        train_pixels: [N, ...] any float tensor, flattened per image (e.g. normalised evaluation crops).
        train_labels: [N] int64. test_pixels / test_labels: [M, ...] and [M], or None.

    Returns:
        ``{k: accuracy}``; ties between classes go to the lowest class index.
    """
    xs = train_pixels.flatten(1).float()
    loo = test_pixels is None
    qs, q_labels = (xs, train_labels) if loo else (test_pixels.flatten(1).float(), test_labels)
    num_classes = int(max(train_labels.max(), q_labels.max())) + 1
    top = min(max(ks), len(xs) - 1 if loo else len(xs))
    squared = (xs * xs).sum(1)
    nearest = []
    for start in range(0, len(qs), chunk):
        q = qs[start : start + chunk]
        dist = squared[None, :] - 2 * q @ xs.T  # the query's own |q|^2 does not change its ranking
        if loo:
            rows = torch.arange(len(q))
            dist[rows, rows + start] = float("inf")
        nearest.append(dist.topk(top, dim=1, largest=False).indices)
    neighbour_labels = train_labels[torch.cat(nearest)]  # [M, top], nearest first
    accuracy = {}
    for k in ks:
        votes = torch.zeros(len(qs), num_classes).scatter_add_(
            1, neighbour_labels[:, : min(k, top)], torch.ones(len(qs), min(k, top))
        )
        accuracy[k] = (votes.argmax(1) == q_labels).float().mean().item()
    return accuracy
