"""DataParallel's four steps (scatter, replicate, parallel_apply, gather) anywhere.

With CUDA and a module on a GPU, `data_parallel` calls torch's own. Otherwise
`device_ids` name simulated devices: every tensor stays on the CPU, and each
step does what torch's does across GPUs. The batch is chunked, the module is
copied once per device (gradients flow back into the original), the replicas
run in threads, and their outputs are joined on the output device.
"""

from __future__ import annotations

import operator
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch._utils import ExceptionWrapper

__all__ = [
    "DEFAULT_DEVICES",
    "data_parallel",
    "gather",
    "parallel_apply",
    "replicate",
    "scatter",
    "scatter_kwargs",
    "simulated_devices",
    "uses_cuda",
]

DEFAULT_DEVICES = 2  # simulated devices when device_ids is None



def simulated_devices(device_ids: Sequence[int] | None = None) -> list[int]:
    """Checked simulated device numbers; None gives DEFAULT_DEVICES devices 0, 1, ..."""
    if device_ids is None:
        return list(range(DEFAULT_DEVICES))
    ids = []
    for d in device_ids:
        try:
            d = operator.index(d)  # ints only: "cuda:1" or torch.device need a GPU
        except TypeError:
            raise ValueError(f"device_ids: {d!r} is not a device number; simulated "
                             "devices are numbered 0, 1, ...") from None
        if d < 0:
            raise ValueError(f"device_ids: {d} is negative; devices are numbered "
                             "from 0")
        if d in ids:
            raise ValueError(f"device_ids: device {d} appears twice; each device "
                             "holds one replica")
        ids.append(d)
    if not ids:
        raise ValueError("device_ids is empty: name at least one device")
    return ids


def _cuda_devices(device_ids) -> list[int]:
    """Checked CUDA device indices (torch's own would fail less clearly)."""
    count = torch.cuda.device_count()
    devices = [torch.device("cuda", d) if isinstance(d, int) else torch.device(d)
               for d in (range(count) if device_ids is None else device_ids)]
    ids = [torch.cuda.current_device() if d.index is None else d.index for d in devices]
    for d, i in zip(devices, ids, strict=True):
        if d.type != "cuda" or not 0 <= i < count:
            raise ValueError(f"device_ids: {d} is not one of this machine's {count} "
                             f"CUDA device(s)")
    if not ids or len(set(ids)) < len(ids):
        raise ValueError(f"device_ids must name distinct devices, got {ids}")
    return ids


def uses_cuda(module: nn.Module, device_ids: Sequence | None = None) -> bool:
    """Whether `data_parallel` runs torch's own: CUDA is here and the work is on it.

    It is when the module is on a GPU, or `device_ids` name CUDA devices.
    """
    if not torch.cuda.is_available():
        return False
    named = [torch.device(d) for d in device_ids or [] if not isinstance(d, int)]
    first = next(iter([*module.parameters(), *module.buffers()]), None)
    return (any(d.type == "cuda" for d in named)
            or (first is not None and first.device.type == "cuda"))


def _is_namedtuple(obj) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def _zip(parts):
    # zip stops at the shortest: the fewest chunks of any tensor decide the count.
    return zip(*parts, strict=False)


def _chunk(x: torch.Tensor, n: int, dim: int) -> tuple[torch.Tensor, ...]:
    if x.dim() == 0:
        raise ValueError(f"dim={dim}: a 0-dimensional tensor (a scalar) cannot be "
                         "split; give it a batch dimension")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim} does not exist in an input of shape "
                         f"{tuple(x.shape)}: use -{x.dim()}..{x.dim() - 1}")
    # Tensor.chunk, as torch's comm.scatter: chunks of ceil(size / n) samples, so an
    # uneven batch can give fewer than n chunks (5 on 4 devices: 2, 2, 1). The clone
    # is the copy to each device; it keeps autograd, so gradients flow back to x.
    return tuple(c.clone(memory_format=torch.contiguous_format)
                 for c in x.chunk(n, dim))


def _scatter(obj, n: int, dim: int):
    """torch's scatter_map: tensors chunked, containers recursed, the rest shared."""
    if isinstance(obj, torch.Tensor):
        return _chunk(obj, n, dim)
    if _is_namedtuple(obj):
        return [type(obj)(*a) for a in _zip(_scatter(o, n, dim) for o in obj)]
    if isinstance(obj, tuple) and obj:
        return list(_zip(_scatter(o, n, dim) for o in obj))
    if isinstance(obj, list) and obj:
        return [list(a) for a in _zip(_scatter(o, n, dim) for o in obj)]
    if isinstance(obj, dict) and obj:
        return [type(obj)(a) for a in _zip(_scatter(kv, n, dim) for kv in obj.items())]
    return [obj for _ in range(n)]  # non-tensors: one shared reference per device


def scatter(inputs: Any, device_ids: Sequence[int] | None = None, dim: int = 0) -> Any:
    """Split the tensors in `inputs` along `dim`, one chunk per device, as torch does.

    A tensor gives a tuple of chunks; a tuple, list or dict gives a list with one
    such container per device. Other objects are shared, not copied.
    """
    return _scatter(inputs, len(simulated_devices(device_ids)), dim)


def scatter_kwargs(inputs: tuple, kwargs: dict | None,
                   device_ids: Sequence[int] | None = None,
                   dim: int = 0) -> tuple[tuple, tuple]:
    """Scatter positional and keyword inputs: (args per device, kwargs per device)."""
    n = len(simulated_devices(device_ids))
    args = _scatter(tuple(inputs), n, dim) if inputs else []
    kw = _scatter(kwargs, n, dim) if kwargs else []
    # A side without tensors to split gets empty entries, one per replica.
    args += [() for _ in range(len(kw) - len(args))]
    kw += [{} for _ in range(len(args) - len(kw))]
    return tuple(args), tuple(kw)


def _copy_for(t: torch.Tensor, first: bool, detach: bool) -> torch.Tensor:
    # The first device already holds the module, so its replica shares the storage,
    # as torch's broadcast leaves the source device's tensors in place: in-place
    # updates there (BatchNorm's running mean) reach the original. The others get
    # copies. view_as and clone keep autograd, so each replica's gradient flows back
    # into the original's .grad, where autograd sums them (torch's ReduceAddCoalesced).
    if detach or not t.requires_grad:
        return t.detach() if first else t.detach().clone()
    return t.view_as(t) if first else t.clone()


def replicate(module: nn.Module, device_ids: Sequence[int] | None = None,
              detach: bool = False) -> list[nn.Module]:
    """One replica of `module` per device; their gradients all sum into `module`."""
    modules = list(module.modules())
    index = {m: i for i, m in enumerate(modules)}
    tensors = [*module.parameters(), *module.buffers()]  # a shared tensor once
    replicas = []
    for j in range(len(simulated_devices(device_ids))):
        copies = {t: _copy_for(t, j == 0, detach) for t in tensors}
        # torch's own shallow copy: attributes and hooks shared, no parameters.
        clones = [m._replicate_for_data_parallel() for m in modules]
        for m, r in zip(modules, clones, strict=True):
            for key, child in m._modules.items():
                r._modules[key] = None if child is None else clones[index[child]]
            for key, p in m._parameters.items():
                if p is None:
                    r._parameters[key] = None
                else:  # a plain, non-leaf tensor attribute, as in torch's replicas
                    setattr(r, key, copies[p])
            for key, b in m._buffers.items():
                if b is not None:
                    r._buffers[key] = copies[b]
        replicas.append(clones[0])
    return replicas


def parallel_apply(replicas: Sequence[nn.Module], inputs: Sequence[Any],
                   kwargs_tup: Sequence[dict] | None = None,
                   devices: Sequence[int] | None = None) -> list[Any]:
    """Run replica i on inputs[i] in its own thread, as torch does; outputs in order.

    An exception in a replica is raised again here, naming the replica and device.
    """
    n = len(replicas)
    kwargs_tup = [{} for _ in range(n)] if kwargs_tup is None else list(kwargs_tup)
    devices = list(range(n)) if devices is None else simulated_devices(devices)
    for name, seq in (("inputs", inputs), ("kwargs_tup", kwargs_tup),
                      ("devices", devices)):
        if len(seq) != n:
            raise ValueError(f"{name} has {len(seq)} entries for {n} replicas")
    # Grad mode and autocast are per thread: carry the caller's into each worker.
    grad_enabled = torch.is_grad_enabled()
    autocast = torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")
    results: list[Any] = [None] * n

    def work(i: int) -> None:
        torch.set_grad_enabled(grad_enabled)
        try:
            with torch.autocast("cpu", enabled=autocast[0], dtype=autocast[1]):
                args = inputs[i]
                args = args if isinstance(args, (list, tuple)) else (args,)
                results[i] = replicas[i](*args, **kwargs_tup[i])
        except Exception:
            results[i] = ExceptionWrapper(
                where=f"in replica {i} on simulated device {devices[i]}")

    if n > 1:
        threads = [threading.Thread(target=work, args=(i,), name=f"replica {i}")
                   for i in range(n)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    elif n == 1:
        work(0)
    for result in results:
        if isinstance(result, ExceptionWrapper):
            result.reraise()  # the first failed replica, as in torch
    return results


def _check_output_device(output_device) -> None:
    if output_device in ("cpu", torch.device("cpu")) or (
            isinstance(output_device, int) and output_device >= -1):
        return
    raise ValueError(f"output_device: {output_device!r} is not a simulated device "
                     "(0, 1, ...) or the CPU (-1)")


def _cat(tensors: list[torch.Tensor], dim: int) -> torch.Tensor:
    if dim == 0 and all(t.dim() == 0 for t in tensors):
        warnings.warn("Was asked to gather along dimension 0, but all input tensors "
                      "were scalars; will instead unsqueeze and return a vector.",
                      stacklevel=3)  # torch's Gather says the same
        return torch.stack(tensors)
    rank = tensors[0].dim()
    if not -rank <= dim < rank:
        raise ValueError(f"dim={dim} does not exist in outputs of shape "
                         f"{tuple(tensors[0].shape)}: use -{rank}..{rank - 1}")
    return torch.cat(tensors, dim)


def gather(outputs: Sequence[Any], output_device: int | str = 0, dim: int = 0) -> Any:
    """Join the replicas' outputs along `dim` on `output_device`, as torch does.

    Tensors are concatenated; tuples, lists, named tuples and dicts are gathered
    element by element; None stays None.
    """
    _check_output_device(output_device)
    outputs = list(outputs)
    if not outputs:
        raise ValueError("outputs is empty: nothing to gather")

    def gather_map(outs):
        out = outs[0]
        if isinstance(out, torch.Tensor):
            return _cat(outs, dim)
        if out is None:
            return None
        if isinstance(out, dict):
            if not all(len(out) == len(d) for d in outs):
                raise ValueError("All dicts must have the same number of keys")
            return type(out)((k, gather_map([d[k] for d in outs])) for k in out)
        if _is_namedtuple(out):
            return type(out)._make(map(gather_map, zip(*outs, strict=True)))
        if isinstance(out, (list, tuple)):
            return type(out)(map(gather_map, zip(*outs, strict=True)))
        raise TypeError(f"cannot gather outputs of type {type(out).__name__}: return "
                        "tensors, or tuples, lists or dicts of them")

    return gather_map(outputs)


def data_parallel(module: nn.Module, inputs: Any, device_ids: Sequence | None = None,
                  output_device: int | str | None = None, dim: int = 0,
                  module_kwargs: dict | None = None) -> Any:
    """`module(*inputs)` split over devices along `dim`, like torch's data_parallel.

    With CUDA and a module on a GPU, torch's own runs on the CUDA `device_ids`;
    otherwise `device_ids` name simulated devices (default: 2) on the CPU.
    """
    if uses_cuda(module, device_ids):
        ids = _cuda_devices(device_ids)
        return torch.nn.parallel.data_parallel(module, inputs, ids, output_device, dim,
                                               module_kwargs)
    # The simulation follows torch's data_parallel line by line.
    if not isinstance(inputs, tuple):
        inputs = (inputs,) if inputs is not None else ()
    device_ids = simulated_devices(device_ids)
    output_device = device_ids[0] if output_device is None else output_device
    _check_output_device(output_device)
    inputs, module_kwargs = scatter_kwargs(inputs, module_kwargs, device_ids, dim)
    if not inputs and not module_kwargs:
        inputs, module_kwargs = ((),), ({},)
    if len(device_ids) == 1:
        return module(*inputs[0], **module_kwargs[0])
    used = device_ids[: len(inputs)]  # fewer chunks than devices: fewer replicas
    replicas = replicate(module, used)
    outputs = parallel_apply(replicas, inputs, module_kwargs, used)
    return gather(outputs, output_device, dim)
