"""Assign a checkpoint's tensors to a model built with meta parameters, checking every name and shape.

The model defines what must be present; the checkpoint must provide exactly that (a tied checkpoint may also
carry a redundant ``lm_head.weight``, and old checkpoints a ``rotary_emb.inv_freq`` buffer, both ignored).
Every problem raises :class:`ModelLoadError` naming the checkpoint and the tensors, before the model is
touched, so a refused load leaves nothing half-assigned.

A :class:`~pagedgen.ops.matmul.qweight.QuantizedWeight` (a weight kept in its stored format) replaces its
parameter with a plain attribute of the same name: modules pass it to
:func:`pagedgen.ops.matmul.linear.linear` unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from pagedgen.errors import ModelLoadError
from pagedgen.ops.matmul.qweight import QuantizedWeight

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_EMBEDDING = "model.embed_tokens.weight"
_SHOWN = 5  # names listed in an error before "..."


def load_weights(
    model: nn.Module,
    tensors: Mapping[str, torch.Tensor | QuantizedWeight],
    source: str,
    device: torch.device,
) -> None:
    """Check ``tensors`` against ``model``'s parameters, then assign them (cast to each parameter's dtype;
    a :class:`QuantizedWeight` is assigned as it is).

    Mutates ``model`` only after every check passed. Raises :class:`ModelLoadError` for missing or
    unexpected tensors, an embedding whose row count differs from the config's vocab size, or any other
    shape mismatch.
    """
    expected = dict(model.named_parameters())
    _check_names(expected, tensors, source)
    _check_shapes(expected, tensors, source)
    quantized = {name for name in expected if isinstance(tensors[name], QuantizedWeight)}
    state = {
        name: tensors[name].to(device=device, dtype=param.dtype, copy=False)
        for name, param in expected.items()
        if name not in quantized
    }
    model.load_state_dict(state, strict=False, assign=True)
    for param in model.parameters():
        param.requires_grad_(False)
    for name in quantized:
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        delattr(module, attr)  # the meta parameter
        setattr(module, attr, tensors[name])


def _check_names(
    expected: Mapping[str, nn.Parameter], tensors: Mapping[str, torch.Tensor | QuantizedWeight], source: str
) -> None:
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ModelLoadError(f"{source}: checkpoint is missing {len(missing)} tensor(s): {_names(missing)}")
    ignorable = {"lm_head.weight"} if "lm_head.weight" not in expected else set()
    unexpected = sorted(
        name
        for name in set(tensors) - set(expected)
        if name not in ignorable and not name.endswith(_IGNORED_SUFFIXES)
    )
    if unexpected:
        raise ModelLoadError(
            f"{source}: checkpoint has {len(unexpected)} tensor(s) the config does not describe: "
            f"{_names(unexpected)} (does config.json match the weights?)"
        )


def _check_shapes(
    expected: Mapping[str, nn.Parameter], tensors: Mapping[str, torch.Tensor | QuantizedWeight], source: str
) -> None:
    embedding = tensors[_EMBEDDING] if _EMBEDDING in expected else None
    if embedding is not None and embedding.shape[0] != expected[_EMBEDDING].shape[0]:
        raise ModelLoadError(
            f"{source}: vocab mismatch: the token embedding has {embedding.shape[0]} rows but the config's "
            f"vocab_size is {expected[_EMBEDDING].shape[0]}"
        )
    for name, param in expected.items():
        got = tuple(tensors[name].shape)
        if got != tuple(param.shape):
            raise ModelLoadError(
                f"{source}: tensor {name!r} has shape {got}, the config implies {tuple(param.shape)}"
            )
        if not isinstance(tensors[name], QuantizedWeight) and not tensors[name].is_floating_point():
            raise ModelLoadError(f"{source}: tensor {name!r} has non-float dtype {tensors[name].dtype}")


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown + (f", ... ({len(names) - _SHOWN} more)" if len(names) > _SHOWN else "")
