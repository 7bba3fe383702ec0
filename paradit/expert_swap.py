"""Two experts on a card that holds one: the idle one waits in host memory, swapped in place (modules are kept)."""

from __future__ import annotations

import time

import torch
from torch import nn

from paradit.device_memory import unmap_free


def _slots(model: nn.Module) -> list[tuple[nn.Module, str, bool]]:
    """(module, name, is_parameter) of every tensor ``model`` holds, each once."""
    slots = {}
    for module in model.modules():
        for table, is_parameter in ((module._parameters, True), (module._buffers, False)):
            for name, tensor in table.items():
                if tensor is not None:
                    slots.setdefault(id(tensor), (module, name, is_parameter))
    return list(slots.values())


class ExpertSwap:
    """Experts that take turns on ``device``, which never holds two (so add the idle ones first)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pin = device.type == "cuda"  # page-locked memory needs an accelerator; on the CPU a copy is a copy
        self.slots: dict[str, list[tuple[nn.Module, str, bool]]] = {}
        self.host: dict[str, list[torch.Tensor]] = {}
        self.active: str | None = None
        self.switch_seconds = 0.0  # host time spent switching (the copies included)

    def add(self, name: str, model: nn.Module, resident: bool) -> None:
        self.slots[name] = _slots(model)
        tensors = [getattr(module, leaf).detach() for module, leaf, _ in self.slots[name]]
        hosts = [torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pin) for t in tensors]
        self.host[name] = [host.copy_(t) for host, t in zip(hosts, tensors)]
        if resident:
            self.active = name
        else:
            self._place(name, on_device=False)

    def _place(self, name: str, on_device: bool) -> None:
        for (module, leaf, is_parameter), host in zip(self.slots[name], self.host[name]):
            tensor = host.to(self.device, non_blocking=True) if on_device else host
            if is_parameter:
                module._parameters[leaf].data = tensor
            else:
                module._buffers[leaf] = tensor

    def bytes_per_expert(self) -> dict[str, int]:
        return {name: sum(t.nbytes for t in host) for name, host in self.host.items()}

    def activate(self, name: str) -> None:
        if name == self.active:
            return
        start = time.perf_counter()
        self._place(self.active, on_device=False)
        unmap_free(self.device)  # the leaving expert's blocks, so that the arriving one is mapped afresh
        self._place(name, on_device=True)
        if self.device.type == "cuda":  # the copies are queued before the next kernels; waited on only to time them
            torch.cuda.synchronize(self.device)
        self.switch_seconds += time.perf_counter() - start
        self.active = name
