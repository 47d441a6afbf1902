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
    train_chunk: int = 16384,
) -> dict[int, float]:
    """Top-1 accuracy (0-1) of plain majority-vote k-NN on raw pixels by L2 distance, for each k of ``ks``: the
    baseline a trained encoder must beat (issue 20). Leave-one-out when no test set is given.

    Queries go ``chunk`` at a time against ``train_chunk`` training images at a time, each converted to float32
    only then, so uint8 pixels of a large folder are never held as floats (60,000 images at 32 px: 184 MB as
    uint8, 737 MB as float32).

    Args:
        train_pixels: [N, ...] uint8 or float tensor, flattened per image (pixels or normalised crops).
        train_labels: [N] int64. test_pixels / test_labels: [M, ...] and [M], or None.

    Returns:
        ``{k: accuracy}``; ties between classes go to the lowest class index.
    """
    xs = train_pixels.flatten(1)
    loo = test_pixels is None
    qs, q_labels = (xs, train_labels) if loo else (test_pixels.flatten(1), test_labels)
    num_classes = int(max(train_labels.max(), q_labels.max())) + 1
    top = min(max(ks), len(xs) - 1 if loo else len(xs))
    squared = torch.cat(
        [(x * x).sum(1) for x in (xs[i : i + train_chunk].float() for i in range(0, len(xs), train_chunk))]
    )
    nearest = []
    for start in range(0, len(qs), chunk):
        q = qs[start : start + chunk].float()
        best = torch.full((len(q), 0), float("inf")), torch.zeros((len(q), 0), dtype=torch.int64)
        for t0 in range(0, len(xs), train_chunk):
            dist = (
                squared[None, t0 : t0 + train_chunk] - 2 * q @ xs[t0 : t0 + train_chunk].float().T
            )  # |q|^2 ranks nothing
            if loo:
                rows = torch.arange(len(q))
                own = rows + start - t0
                inside = (own >= 0) & (own < dist.shape[1])
                dist[rows[inside], own[inside]] = float("inf")
            near = dist.topk(min(top, dist.shape[1]), dim=1, largest=False)
            merged = torch.cat([best[0], near.values], 1), torch.cat([best[1], near.indices + t0], 1)
            order = merged[0].topk(min(top, merged[0].shape[1]), dim=1, largest=False).indices
            best = merged[0].gather(1, order), merged[1].gather(1, order)
        nearest.append(best[1])
    neighbour_labels = train_labels[torch.cat(nearest)]  # [M, top], nearest first
    accuracy = {}
    for k in ks:
        votes = torch.zeros(len(qs), num_classes).scatter_add_(
            1, neighbour_labels[:, : min(k, top)], torch.ones(len(qs), min(k, top))
        )
        accuracy[k] = (votes.argmax(1) == q_labels).float().mean().item()
    return accuracy
