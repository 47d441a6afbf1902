"""LARS: SGD with momentum whose step is rescaled per layer by a trust ratio (You et al. 2017; MoCo v3).

For each parameter the update ``d = grad + weight_decay * p`` is multiplied by
``trust_coefficient * ||p|| / ||d||`` (1 when either norm is 0), accumulated with momentum, and applied with
the learning rate. A parameter group with ``lars_exclude=True`` (biases and normalisation weights, as in
MoCo v3 and BYOL) gets neither weight decay nor the trust ratio: it is plain SGD with momentum.
"""

from __future__ import annotations

import torch


class LARS(torch.optim.Optimizer):
    """Layer-wise adaptive rate scaling.

    Args:
        params: parameters or parameter groups; a group may set ``lars_exclude`` (default False).
        lr: learning rate (the training loop sets it every step).
        weight_decay: L2 coefficient added to the gradient before the trust ratio.
        momentum: heavy-ball momentum coefficient.
        trust_coefficient: eta in ``eta * ||p|| / ||d||``.
    """

    def __init__(
        self,
        params,
        lr: float = 0.0,
        weight_decay: float = 0.0,
        momentum: float = 0.9,
        trust_coefficient: float = 0.001,
    ):
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, trust_coefficient=trust_coefficient, lars_exclude=False
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            # multi-tensor (foreach) kernels: one launch per operation for the whole group, not one per parameter
            updates = [p.grad for p in params]
            if not group["lars_exclude"]:
                updates = torch._foreach_add(updates, params, alpha=group["weight_decay"])
                param_norms = torch.stack(torch._foreach_norm(params))
                update_norms = torch.stack(torch._foreach_norm(updates))
                trust = torch.where(
                    (param_norms > 0) & (update_norms > 0),
                    group["trust_coefficient"] * param_norms / update_norms,
                    torch.ones_like(param_norms),
                )
                torch._foreach_mul_(updates, list(trust.unbind()))
            mus = []
            for p in params:
                state = self.state[p]
                if "mu" not in state:
                    state["mu"] = torch.zeros_like(p)
                mus.append(state["mu"])
            torch._foreach_mul_(mus, group["momentum"])
            torch._foreach_add_(mus, updates)
            torch._foreach_add_(params, mus, alpha=-group["lr"])
        return loss
