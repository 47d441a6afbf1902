"""The MoCo objective in one readable module: encoders, momentum update, queue, shuffle-BN and InfoNCE.

:class:`MoCo` holds what v2 and v3 share (a query encoder, a momentum key encoder that is its EMA copy, the
momentum update); subclasses add their projector and their loss in :meth:`MoCo.forward`. Shapes: ``N`` is
the per-process batch, ``C`` the projection dim, ``K`` the queue length.

References: He et al., "Momentum Contrast for Unsupervised Visual Representation Learning" (MoCo);
Chen et al., "Improved Baselines with Momentum Contrastive Learning" (MoCo v2); Chen, Xie and He, "An
Empirical Study of Training Self-Supervised Vision Transformers" (MoCo v3).
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn.functional as F
from torch import nn

from moco_retrieval.trainer import dist


class Encoder(nn.Module):
    """Backbone followed by a projection head: ``[N, 3, H, W] -> [N, C]``."""

    def __init__(self, backbone: nn.Module, head: nn.Module):
        super().__init__()
        self.backbone = backbone
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


def info_nce_logits(
    q: torch.Tensor, k: torch.Tensor, queue: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """MoCo's InfoNCE logits: the positive key first, then the queue's negatives.

    Args:
        q: queries, [N, C], L2-normalised.
        k: positive keys, [N, C], L2-normalised.
        queue: negative keys, [C, K], L2-normalised columns.
        temperature: softmax temperature T.

    Returns:
        ``(logits, labels)``: logits [N, 1+K] (= similarities / T), labels [N] all zero (the positive's index).
    """
    l_pos = torch.einsum("nc,nc->n", q, k).unsqueeze(-1)  # positive logits: Nx1
    l_neg = torch.einsum("nc,ck->nk", q, queue)  # negative logits: NxK
    logits = torch.cat([l_pos, l_neg], dim=1) / temperature  # Nx(1+K)
    labels = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
    return logits, labels


@torch.no_grad()
def batch_shuffle(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Shuffle a batch across all processes (shuffle-BN); in one process, a permutation of the batch.

    Args:
        x: [N, ...] this process's batch.

    Returns:
        ``(x_shuffled, idx_unshuffle)``: [N, ...] images now belonging to random samples of the global batch,
        and the [world*N] index that :func:`batch_unshuffle` uses to put the outputs back.
    """
    x_all = dist.gather_no_grad(x)
    perm = torch.randperm(x_all.shape[0], device=x.device)
    dist.broadcast(perm, src=0)  # every process must agree on the permutation
    idx_unshuffle = torch.argsort(perm)
    this_rank = perm.view(dist.world_size(), -1)[dist.rank()]
    return x_all[this_rank], idx_unshuffle


@torch.no_grad()
def batch_unshuffle(x: torch.Tensor, idx_unshuffle: torch.Tensor) -> torch.Tensor:
    """Undo :func:`batch_shuffle` on the encoder outputs: [N, ...] -> [N, ...] in the original order."""
    x_all = dist.gather_no_grad(x)
    this_rank = idx_unshuffle.view(dist.world_size(), -1)[dist.rank()]
    return x_all[this_rank]


@contextlib.contextmanager
def running_statistics_frozen(module: nn.Module):
    """Inside, ``module``'s BatchNorm layers normalise with their batch's statistics as in training but leave
    their running statistics (what export and evaluation use) unchanged."""
    norms = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    saved = [m.momentum for m in norms]
    for m in norms:
        m.momentum = 0.0  # running = (1 - 0) * running + 0 * batch
    try:
        yield
    finally:
        for m, momentum in zip(norms, saved):
            m.momentum = momentum


def momentum_update_(key_params: list[torch.Tensor], query_params: list[torch.Tensor], m: float) -> None:
    """In place, for each pair: ``key = m * key + (1 - m) * query``."""
    torch._foreach_mul_(key_params, m)
    torch._foreach_add_(key_params, query_params, alpha=1.0 - m)


class MoCo(nn.Module):
    """What every MoCo version shares: a query encoder and its momentum (EMA) copy, the key encoder.

    Subclasses build the projector (:meth:`build_projector`) and define the loss (:meth:`forward`).
    """

    def __init__(self, backbone: nn.Module, feature_dim: int, dim: int, mlp_hidden: int, temperature: float):
        super().__init__()
        self.temperature = temperature
        self.feature_dim = feature_dim
        self.encoder_q = Encoder(backbone, self.build_projector(feature_dim, mlp_hidden or feature_dim, dim))
        self.encoder_k = copy.deepcopy(self.encoder_q)
        for p in self.encoder_k.parameters():
            p.requires_grad = False  # the key encoder follows the query encoder by EMA only

    @property
    def backbone(self) -> nn.Module:
        """The representation to export and evaluate: the query encoder's backbone."""
        return self.encoder_q.backbone

    def build_projector(self, in_dim: int, hidden_dim: int, out_dim: int) -> nn.Module:
        raise NotImplementedError

    def compile_encoders(self) -> None:
        """``torch.compile`` both encoders in place (``--compile``), with static shapes: the queries, the keys
        (no grad) and multi-crop's small crops each get a graph of their own. Left to decide, torch.compile
        made the third shape it met symbolic, and Inductor failed on it (MoCo v2 ResNet-18, 32 px, batch 32,
        ``--small-crops 2``: ``InductorError ... cannot determine truth value of Relational``)."""
        self.encoder_q.compile(dynamic=False)
        self.encoder_k.compile(dynamic=False)

    @torch.no_grad()
    def momentum_update(self, m: float) -> None:
        """Key encoder parameters <- m * key + (1 - m) * query."""
        momentum_update_(list(self.encoder_k.parameters()), list(self.encoder_q.parameters()), m)

    def forward(self, x1: torch.Tensor, x2: torch.Tensor, m: float, small: torch.Tensor | None = None) -> torch.Tensor:
        """Return the loss for two views ``x1``, ``x2`` ([N, 3, H, W]) with key-encoder momentum ``m`` (and
        multi-crop's ``small`` crops, [S*N, 3, h, w], where the variant takes them)."""
        raise NotImplementedError


class MoCoV2(MoCo):
    """MoCo v2: 2-layer MLP projector, a queue of K negative keys, shuffle-BN, InfoNCE with temperature.

    ``symmetric`` makes each view a query against the other's key as well (the symmetrised loss of the MoCo
    CIFAR demo and of MoCo v3): twice the encoder work per step for twice the queries per image."""

    def __init__(
        self,
        backbone: nn.Module,
        feature_dim: int,
        dim: int = 128,
        mlp_hidden: int = 0,
        temperature: float = 0.2,
        queue_size: int = 65536,
        symmetric: bool = False,
    ):
        super().__init__(backbone, feature_dim, dim, mlp_hidden, temperature)
        self.symmetric = symmetric
        self.register_buffer("queue", F.normalize(torch.randn(dim, queue_size), dim=0))  # CxK
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))

    def build_projector(self, in_dim: int, hidden_dim: int, out_dim: int) -> nn.Module:
        return nn.Sequential(nn.Linear(in_dim, hidden_dim), nn.ReLU(inplace=True), nn.Linear(hidden_dim, out_dim))

    @torch.no_grad()
    def dequeue_and_enqueue(self, keys: torch.Tensor) -> None:
        """Replace the oldest queue entries with ``keys`` ([N, C]) gathered from every process."""
        keys = dist.gather_no_grad(keys)
        batch_size = keys.shape[0]
        queue_size = self.queue.shape[1]
        if queue_size % batch_size:  # TrainConfig validates this; keep the invariant explicit here
            raise ValueError(f"queue size {queue_size} must be a multiple of the global batch {batch_size}")
        ptr = int(self.queue_ptr)
        self.queue[:, ptr : ptr + batch_size] = keys.T.to(self.queue.dtype)
        self.queue_ptr[0] = (ptr + batch_size) % queue_size  # wraps to 0 when the queue is full

    @torch.no_grad()
    def keys(self, x: torch.Tensor) -> torch.Tensor:
        """The key encoder's normalised projections of ``x`` ([N, 3, H, W] -> [N, C]) under shuffle-BN: BN
        statistics must not reveal the positive."""
        x, idx_unshuffle = batch_shuffle(x)
        return batch_unshuffle(F.normalize(self.encoder_k(x), dim=1), idx_unshuffle)

    def forward(self, x1: torch.Tensor, x2: torch.Tensor, m: float, small: torch.Tensor | None = None) -> torch.Tensor:
        """InfoNCE loss of queries from ``x1`` against the positive keys from ``x2`` and the queue.

        Symmetric, the loss is the mean of that and of ``x2``'s queries against ``x1``'s keys. With multi-crop,
        ``small`` ([S*N, 3, h, w], crop ``s`` of image ``n`` at row ``s * N + n``) adds S more queries per
        image against ``x2``'s key, and the loss is the mean over all 1 + S queries. Only ``x2``'s keys enter
        the queue, and only full-size views move BN's running statistics (what the export keeps)."""
        q = F.normalize(self.encoder_q(x1), dim=1)  # queries: NxC
        with torch.no_grad():
            self.momentum_update(m)  # update the key encoder before computing keys
            k = self.keys(x2)  # keys: NxC

        queue, positives = self.queue.clone().detach().to(q.dtype), k.to(q.dtype)
        logits, labels = info_nce_logits(q, positives, queue, self.temperature)
        loss = F.cross_entropy(logits.float(), labels)
        if self.symmetric:
            q2 = F.normalize(self.encoder_q(x2), dim=1)  # the second view's queries: NxC
            logits, labels = info_nce_logits(q2, self.keys(x1).to(q2.dtype), queue, self.temperature)
            loss = (loss + F.cross_entropy(logits.float(), labels)) / 2
        if small is not None:
            n_small = small.shape[0] // q.shape[0]
            with running_statistics_frozen(self.encoder_q):
                q_small = F.normalize(self.encoder_q(small), dim=1)  # the small crops' queries: (S*N)xC
            logits, labels = info_nce_logits(q_small, positives.repeat(n_small, 1), queue, self.temperature)
            loss = (loss + n_small * F.cross_entropy(logits.float(), labels)) / (1 + n_small)
        self.dequeue_and_enqueue(k)
        return loss


def build_mlp(num_layers: int, in_dim: int, hidden_dim: int, out_dim: int, last_bn: bool) -> nn.Sequential:
    """MoCo v3's MLP: Linear (no bias) layers with BN + ReLU between them, and optionally a last BN without
    affine parameters (SimCLR's design). ``[N, in_dim] -> [N, out_dim]``."""
    layers: list[nn.Module] = []
    for i in range(num_layers):
        d_in = in_dim if i == 0 else hidden_dim
        d_out = out_dim if i == num_layers - 1 else hidden_dim
        layers.append(nn.Linear(d_in, d_out, bias=False))
        if i < num_layers - 1:
            layers += [nn.BatchNorm1d(d_out), nn.ReLU(inplace=True)]
        elif last_bn:
            layers.append(nn.BatchNorm1d(d_out, affine=False))
    return nn.Sequential(*layers)


def contrastive_loss(q: torch.Tensor, k: torch.Tensor, temperature: float) -> torch.Tensor:
    """MoCo v3's loss of one direction: each query against every key of the global batch, scaled by 2T.

    The positive of query ``n`` on this process is key ``n`` of this process's slice of the gathered keys; the
    other ``world*N - 1`` keys are its negatives. No gradient flows through the gathered keys.

    Args:
        q: queries, [N, C] (normalised here).
        k: keys from the other view, [N, C] (normalised here), this process's batch.
        temperature: softmax temperature T.

    Returns:
        Scalar: ``2T * cross_entropy(q k_all^T / T, positives)``.
    """
    q = F.normalize(q.float(), dim=1)
    k = F.normalize(k.float(), dim=1)
    k_all = dist.gather_no_grad(k)  # keys of the whole batch: (world*N)xC
    logits = torch.einsum("nc,mc->nm", q, k_all) / temperature  # Nx(world*N)
    n = q.shape[0]
    labels = torch.arange(n, dtype=torch.long, device=q.device) + n * dist.rank()
    return F.cross_entropy(logits, labels) * (2 * temperature)


class MoCoV3(MoCo):
    """MoCo v3: projector with BN, a predictor on the query branch, symmetric in-batch loss, no queue.

    Args:
        backbone, feature_dim: the backbone and its output width D.
        dim: projection (and prediction) output width C (256 in the paper).
        mlp_hidden: hidden width of projector and predictor (4096); 0 = ``feature_dim``.
        temperature: 1.0 for ResNets, 0.2 for ViTs in the paper.
        projector_layers: 2 for ResNets, 3 for ViTs.
        predictor_last_bn: the reference code ends the ViT predictor with an affine-free BN, not the ResNet's.
    """

    def __init__(
        self,
        backbone: nn.Module,
        feature_dim: int,
        dim: int = 256,
        mlp_hidden: int = 4096,
        temperature: float = 1.0,
        projector_layers: int = 2,
        predictor_last_bn: bool = False,
    ):
        self.projector_layers = projector_layers  # read by build_projector inside MoCo.__init__
        super().__init__(backbone, feature_dim, dim, mlp_hidden, temperature)
        self.predictor = build_mlp(2, dim, mlp_hidden or feature_dim, dim, last_bn=predictor_last_bn)

    def build_projector(self, in_dim: int, hidden_dim: int, out_dim: int) -> nn.Module:
        return build_mlp(self.projector_layers, in_dim, hidden_dim, out_dim, last_bn=True)

    def forward(self, x1: torch.Tensor, x2: torch.Tensor, m: float, small: torch.Tensor | None = None) -> torch.Tensor:
        """Symmetric loss: queries of each view against the keys of the other view (2T-scaled, summed). No
        multi-crop (``TrainConfig`` refuses small crops for v3)."""
        if small is not None:
            raise ValueError("MoCo v3 takes no small crops")
        q1 = self.predictor(self.encoder_q(x1))  # queries: NxC
        q2 = self.predictor(self.encoder_q(x2))

        with torch.no_grad():
            self.momentum_update(m)  # update the key encoder before computing keys
            k1 = self.encoder_k(x1)  # keys: NxC (no shuffle-BN: v3 compares in-batch keys only)
            k2 = self.encoder_k(x2)

        return contrastive_loss(q1, k2, self.temperature) + contrastive_loss(q2, k1, self.temperature)
