"""The parameters and gradients of an optimizer, named and grouped by (device, dtype).

Names come from the model (``named_parameters()``, wrappers' prefixes removed), else
``group{g}.param{i}`` (``optimizer{k}.`` before them for the second optimizer on). The grouping is
planned once per set of parameters: each step then only reads ``p.grad``, so the host work per
step does not grow with Python lookups per tensor. Statistics run per group (:mod:`ampdoctor.stats`).
"""

from __future__ import annotations

import numpy as np
import torch

# (device, dtype) -> (names, numels, tensors) of one step's gradients
Groups = dict[tuple[torch.device, torch.dtype], tuple[list[str], np.ndarray, list[torch.Tensor]]]


class ParameterIndex:
    def __init__(self, names: dict[int, str]) -> None:
        self._names = names  # id(parameter) -> name, from the model
        self._optimizer_index: dict[int, int] = {}
        self._cache: dict[tuple, tuple] = {}

    def gradient_groups(self, optimizer: torch.optim.Optimizer, *, check: bool = False) -> Groups:
        """This step's observable gradients of ``optimizer`` per (device, dtype): names, numels,
        tensors. Dense gradients have their parameter's device, dtype and size (torch enforces
        it), so their grouping is planned once per set of parameters and each step only reads
        ``p.grad``: host work per tensor is a few attribute reads, not a Python loop of lookups."""
        dense, others = self._gradient_plan(optimizer, check)
        groups: Groups = {}
        rest = list(others)
        for key, (names, numels, params) in dense.items():
            grads = [p.grad for p in params]
            usable = [g is not None and not g.is_sparse for g in grads]
            if all(usable):
                groups[key] = (names, numels, grads)
                continue
            rest.extend((n, p) for n, p, ok in zip(names, params, usable) if not ok)
            kept = [i for i, ok in enumerate(usable) if ok]
            if kept:
                groups[key] = ([names[i] for i in kept], numels[kept], [grads[i] for i in kept])
        added: dict[tuple, tuple[list, list, list]] = {}
        for name, grad in self._named_grads(rest):
            names, numels, tensors = added.setdefault((grad.device, grad.dtype), ([], [], []))
            names.append(name)
            numels.append(grad.numel())
            tensors.append(grad)
        for key, (names, numels, tensors) in added.items():
            old_names, old_numels, old_tensors = groups.get(key, ([], np.zeros(0, np.int64), []))
            groups[key] = (old_names + names, np.concatenate([old_numels, numels]).astype(np.int64),
                           old_tensors + tensors)
        return groups

    def _gradient_plan(self, optimizer: torch.optim.Optimizer, check: bool):
        """``(dense, others)``: the plain parameters grouped by (device, dtype) as ``(names,
        numels, params)``, and the ``(name, parameter)`` of the rest (DTensor shards, sparse
        parameters, empty ones), built once per set of parameters; checked against the
        parameters when ``check`` (``p.data = ...`` may change a parameter's dtype or size)."""
        named = self.named(optimizer)
        key = ("plan", id(optimizer), len(named))
        cached = self._cache.get(key)
        if cached is not None and cached[0] is named and (not check or _plan_holds(cached[1][0])):
            return cached[1]
        dense: dict[tuple, tuple[list, list, list]] = {}
        others = []
        for name, p in named:
            if type(p) in (torch.Tensor, torch.nn.Parameter) and not p.is_sparse and p.numel():
                names, numels, params = dense.setdefault((p.device, p.dtype), ([], [], []))
                names.append(name)
                numels.append(p.numel())
                params.append(p)
            else:
                others.append((name, p))
        plan = ({k: (names, np.array(numels, np.int64), params) for k, (names, numels, params) in dense.items()}, others)
        self._cache[key] = (named, plan)
        return plan

    def param_groups(self, optimizer: torch.optim.Optimizer) -> list[tuple[list[str], list[int], list]]:
        """``optimizer``'s parameters grouped by (device, dtype) and named, built once per set of
        parameters (the name lookups and grouping are not redone every step)."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        key = (id(optimizer), len(params))
        cached = self._cache.get(key)
        if cached is not None and all(a is b for a, b in zip(cached[0], params)):
            return cached[1]
        groups: dict[tuple, tuple[list, list, list]] = {}
        for name, p in self.named(optimizer):
            if p.is_sparse:
                continue
            local = local_tensor(p)
            names, numels, tensors = groups.setdefault((local.device, local.dtype), ([], [], []))
            names.append(name)
            numels.append(local.numel())
            tensors.append(local)  # the parameter itself (read under no_grad): a later p.data = ... shows
        self._cache[key] = (params, list(groups.values()))
        return self._cache[key][1]

    @staticmethod
    def _named_grads(named_params: list[tuple[str, torch.Tensor]]):
        """``(name, gradient)`` of each parameter with a nonempty gradient: this rank's shard of a
        DTensor's (FSDP2), the stored values of a sparse one."""
        for name, p in named_params:
            grad = p.grad
            if grad is None:
                continue
            if type(grad) is not torch.Tensor:
                grad = local_tensor(grad)  # FSDP2: this rank's shard
            if grad.is_sparse:
                # Observed through the stored values. On the CPU coalesced first, so that
                # duplicates are summed as the optimizer will see them; on an accelerator
                # coalescing syncs (its size depends on the data), so an uncoalesced gradient
                # is observed with its duplicate entries apart.
                if not grad.is_coalesced() and grad.device.type == "cpu":
                    grad = grad.coalesce()
                grad = grad._values()
            if grad.numel():  # FSDP1: a rank may hold no shard of a parameter
                yield name, grad

    def named(self, optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
        """``optimizer``'s parameters with their names, built once per set of parameters."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        key = ("named", id(optimizer), len(params))
        cached = self._cache.get(key)
        if cached is not None and all(a is b for a, (_, b) in zip(params, cached)):
            return cached
        k = self._optimizer_index.setdefault(id(optimizer), len(self._optimizer_index))
        prefix = "" if k == 0 else f"optimizer{k}."
        named = [(self._names.get(id(p)) or f"{prefix}group{g}.param{i}", p)
                 for g, group in enumerate(optimizer.param_groups) for i, p in enumerate(group["params"])]
        self._cache[key] = named
        return named


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of a DTensor (FSDP2 parameters and gradients;
    reductions on the DTensor itself would be collectives), else ``t``."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None and type(t).__name__ == "DTensor" else t


def _plan_holds(dense: dict) -> bool:
    """Whether every planned parameter still has its group's device and dtype and its size."""
    return all(p.device == device and p.dtype == dtype and p.numel() == n
               for (device, dtype), (_, numels, params) in dense.items() for p, n in zip(params, numels.tolist()))
