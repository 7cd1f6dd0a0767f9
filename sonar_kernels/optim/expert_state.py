"""The AdamW state of a tensor updated in the backward: created, converted, saved and loaded.

torch.optim.AdamW's layout (``step``, ``exp_avg``, ``exp_avg_sq``), with what the kernels read: ``step`` a
0-dim float32 tensor on the tensor's device, the moments on that device in ``moments_dtype`` (or a dtype the
kernels take). A checkpoint holds ``step`` on the CPU, as torch.optim.AdamW keeps it outside its fused and
capturable modes, so that it loads into torch.optim.AdamW and back (docs/usage.md, "Checkpoints and resume").
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor, Shard

from sonar_kernels import ops
from sonar_kernels.ops.common import inf_norm, whole
from sonar_kernels.optim.param_groups import check_group_options
from sonar_kernels.rules.master_weights import REMAINDER, STOCHASTIC, split
from sonar_kernels.rules.moments_8bit import dequantize, quantize, scales_shape

__all__ = [
    "EIGHT_BIT",
    "check_converted",
    "check_loadable",
    "check_master_weights",
    "expert_state",
    "load_expert_state",
    "load_fp32_masters",
    "moment_tensors",
    "uses_8bit",
    "with_cpu_steps",
]

MOMENTS = ("exp_avg", "exp_avg_sq")
# ``moments_dtype`` of 8-bit moments (docs/design.md, "8-bit moments"): the state holds, for each moment,
# its codes ("exp_avg_codes": int8, "exp_avg_sq_codes": uint8, the tensor's shape) and fp32 block scales
# ("exp_avg_scales", "exp_avg_sq_scales").
EIGHT_BIT = "8bit"
CODES = {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8}


def uses_8bit(p: torch.Tensor, moments_dtype) -> bool:
    """Whether ``p``'s moments are 8-bit with ``moments_dtype``: "8bit" and a weight matrix ([E, rows,
    columns]); a bias ([E, n]) keeps exact moments in its own dtype (a few kilobytes).

    Raises:
        ValueError: a weight matrix whose last dimension is not a multiple of the block (32), that is
            not contiguous, or that is sharded (a DTensor: FSDP2) along its last dimension.
    """
    if moments_dtype != EIGHT_BIT or p.dim() != 3:
        return False
    scales_shape(tuple(p.shape))
    if isinstance(p, DTensor):
        last = [q for q in p.placements if isinstance(q, Shard) and q.dim % p.dim() == p.dim() - 1]
        if last:
            raise ValueError(
                f"8-bit moments need a sharded expert tensor of shape {tuple(p.shape)} split along a "
                f"dimension other than its last (placements {p.placements}): their blocks lie along the last "
                "dimension; FSDP2's default shards dimension 0"
            )
    if not _local(p).is_contiguous():
        raise ValueError(f"8-bit moments need a contiguous expert tensor, got strides {_local(p).stride()}")
    return True


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (FSDP2's shard); any other tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def _like(p: torch.Tensor, local: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``local``, this rank's part of a state tensor of global ``shape``, laid out as ``p``: a DTensor
    with ``p``'s mesh and placements when ``p`` is one (8-bit state is sharded like its parameter: only
    dimensions before the last are split, so a rank's codes and scales are those of its own shard), else
    ``local``."""
    if not isinstance(p, DTensor):
        return local
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        local, p.device_mesh, p.placements, run_check=False, shape=torch.Size(shape), stride=stride
    )


def _local_values(p: torch.Tensor, value: torch.Tensor, name: str) -> torch.Tensor:
    """The part of a moment ``value`` (``p``'s shape) that this rank's shard of ``p`` holds, as fp32."""
    if isinstance(p, DTensor) and (not isinstance(value, DTensor) or value.placements != p.placements):
        raise ValueError(
            f"{name} of a sharded parameter must be a DTensor sharded as the parameter "
            f"({p.placements}), got {type(value).__name__}"
            + (f" with placements {value.placements}" if isinstance(value, DTensor) else "")
        )
    local = _local(value)
    return local.to(device=_local(p).device, dtype=torch.float32).contiguous()


def check_master_weights(master_weights) -> str | None:
    """``master_weights`` when the optimizers implement it: None, "remainder" (docs/design.md, "bf16 master
    weights": the bf16 expert tensor and an int16 ``state[p]["remainder"]`` are the fp32 master) or
    "stochastic" (the bf16 expert tensor updated in fp32 and rounded back stochastically with the stream of
    ``state[p]["seed"]``), with any ``moments_dtype`` (fp32, bf16, "8bit").

    Raises:
        ValueError: another value.
    """
    if master_weights is None:
        return None
    if master_weights not in (REMAINDER, STOCHASTIC):
        raise ValueError(f'master_weights must be None, "remainder" or "stochastic", got {master_weights!r}')
    return master_weights


def check_converted(owner: str, p: torch.Tensor, master_weights: str | None) -> None:
    """Refuse, before its state is converted, an expert tensor converted to a dtype its update does not take
    (``model.double()`` with the optimizer kept; docs/usage.md, "Casting the model after building the
    optimizer").

    Raises:
        TypeError: ``p``'s dtype is not float32, bfloat16 or float16, or not bfloat16 with ``master_weights``.
    """
    if master_weights is not None and p.dtype != torch.bfloat16:
        kept = f'master_weights="{master_weights}" keeps bf16 expert tensors'
    elif p.dtype not in ops.SUPPORTED_DTYPES:
        kept = "expert tensors must be float32, bfloat16 or float16"
    else:
        return
    raise TypeError(
        f"{owner}: {kept}; the tensor of shape {tuple(p.shape)} was converted to {p.dtype} (its optimizer state "
        "was not changed: convert the model back, or build the optimizer over the converted model)"
    )


def moment_tensors(state: dict) -> list[torch.Tensor]:
    """The tensors of ``state`` that an update writes besides ``step``: the moments, or their codes and
    scales."""
    if "exp_avg_codes" in state:
        moments = [state[f"{key}_{part}"] for key in MOMENTS for part in ("codes", "scales")]
    else:
        moments = [state[key] for key in MOMENTS]
    return moments + [state[key] for key in ("remainder", "seed") if key in state]


def _quantized(p: torch.Tensor, values: dict | None) -> dict:
    """The 8-bit fields of ``p``'s state: ``values`` (moment -> a tensor of ``p``'s shape, any float dtype)
    quantized, or zeros."""
    state, local = {}, _local(p)
    for key in MOMENTS:
        value = None if values is None else values.get(key)
        if value is None:
            codes = torch.zeros(local.shape, dtype=CODES[key], device=local.device)
            scales = torch.zeros(scales_shape(tuple(local.shape)), dtype=torch.float32, device=local.device)
        else:
            codes, scales = quantize(_local_values(p, value, key), key)
        state[f"{key}_codes"] = _like(p, codes, tuple(p.shape))
        state[f"{key}_scales"] = _like(p, scales, scales_shape(tuple(p.shape)))
    return state


def _remainder(p: torch.Tensor, saved) -> torch.Tensor:
    """``p``'s int16 remainder: ``saved`` when it is one of ``p``'s shape, else zeros (the master is the bf16
    weight itself: what a checkpoint of bf16 weights alone, or torch.optim.AdamW's state, gives)."""
    if isinstance(saved, torch.Tensor) and saved.dtype == torch.int16 and saved.shape == p.shape:
        return torch.empty_like(p, dtype=torch.int16).copy_(saved)  # p's strides, as the kernels read it
    return torch.zeros_like(p, dtype=torch.int16, memory_format=torch.preserve_format)


def expert_state(
    p: torch.Tensor,
    state: dict,
    moments_dtype: torch.dtype | None,
    follows: torch.dtype | None = None,
    master: str | None = None,
    seed: int = 0,
) -> dict:
    """:func:`_expert_state`, plus, with bf16 master weights, ``p``'s int16 ``remainder`` (``master``
    "remainder": kept from ``state``, else zeros: the bf16 weight is the master) or the 0-dim int64 ``seed``
    of its stochastic rounding (``master`` "stochastic": kept from ``state``, else ``seed``)."""
    converted = _expert_state(p, state, moments_dtype, follows)
    if master == REMAINDER:
        converted["remainder"] = _remainder(p, state.get("remainder"))
    elif master == STOCHASTIC:
        converted["seed"] = _seed(p, state.get("seed"), seed)
    return converted


def _seed(p: torch.Tensor, saved, default: int) -> torch.Tensor:
    """``p``'s stream seed as a 0-dim int64 tensor on its device: ``saved`` when it is one, else ``default``."""
    if isinstance(saved, torch.Tensor) and saved.dim() == 0 and not saved.is_floating_point():
        return saved.to(device=p.device, dtype=torch.int64, copy=True)
    return torch.tensor(default, dtype=torch.int64, device=p.device)


def _expert_state(
    p: torch.Tensor, state: dict, moments_dtype: torch.dtype | None, follows: torch.dtype | None = None
) -> dict:
    """The state of ``p`` for its in-backward update: ``state`` (torch.optim.AdamW's keys: from dense steps
    taken before ``p`` was known as an expert tensor, or its own before a conversion of ``p``) converted
    (``step`` a 0-dim float32 tensor on ``p``'s device, the moments on that device in ``moments_dtype``,
    else their own dtype, else, for a dtype the kernels do not take or the dtype ``follows`` (the
    parameter's before a conversion), ``p``'s), or new zeros when it has none. With 8-bit moments
    (:func:`uses_8bit`) the moments are quantized (docs/design.md, "8-bit moments"), its own codes and scales
    kept."""
    if uses_8bit(p, moments_dtype):
        if (
            "exp_avg_codes" in state
        ):  # its own, before a conversion of p: codes and scales do not follow p's dtype
            return {key: value.to(p.device, copy=True) for key, value in state.items()}
        if all(isinstance(state.get(key), torch.Tensor) for key in MOMENTS):  # torch.optim.AdamW's: quantized
            step, values = state.get("step", 0.0), {key: state[key] for key in MOMENTS}
        else:
            step, values = 0.0, None
        step = torch.as_tensor(step, dtype=torch.float32).to(p.device).reshape(()).clone()
        return {"step": step} | _quantized(p, values)
    if moments_dtype == EIGHT_BIT:
        moments_dtype = None  # a bias: exact moments
    moments = moments_dtype or p.dtype
    if not all(isinstance(state.get(key), torch.Tensor) for key in MOMENTS):
        return {
            "step": torch.zeros((), dtype=torch.float32, device=p.device),
            "exp_avg": torch.zeros_like(p, dtype=moments, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(p, dtype=moments, memory_format=torch.preserve_format),
        }
    step = state.get("step", 0.0)
    converted = {"step": torch.as_tensor(step, dtype=torch.float32).to(p.device).reshape(()).clone()}
    for key in MOMENTS:
        value = state[key]
        kept = value.dtype in ops.SUPPORTED_DTYPES and value.dtype != follows
        dtype = moments_dtype or (value.dtype if kept else p.dtype)
        converted[key] = torch.empty_like(p, dtype=dtype).copy_(value)
    return converted


def _pairs(saved_groups: list[dict], param_groups: list[dict]) -> list[tuple[int, torch.Tensor]]:
    ids = [i for group in saved_groups for i in group["params"]]
    params = [p for group in param_groups for p in group["params"]]
    if len(ids) != len(params):
        raise ValueError(f"the state_dict holds {len(ids)} parameters, this optimizer {len(params)}")
    return list(zip(ids, params, strict=True))


def with_cpu_steps(saved: dict, param_groups: list[dict], managed: Callable[[torch.Tensor], bool]) -> dict:
    """``saved`` (torch.optim.Optimizer.state_dict's result) with the ``step`` of each tensor ``managed``
    names as a CPU copy (the live one stays on the device). Reading it syncs with the device.

    8-bit moments are saved as torch.optim.AdamW's ``exp_avg`` and ``exp_avg_sq`` (fp32, dequantized: a
    torch.optim.AdamW loads them) and their codes (``exp_avg_codes``, ``exp_avg_sq_codes``), from which
    :func:`load_expert_state` restores the state exactly (a block's scale is its largest dequantized
    magnitude, the top code's value times 1)."""
    for param_id, p in _pairs(saved["param_groups"], param_groups):
        state = saved["state"].get(param_id)
        if managed(p) and state is not None and isinstance(state.get("step"), torch.Tensor):
            if "exp_avg_codes" in state:
                master = {key: state[key] for key in ("remainder", "seed") if key in state}
                state = (
                    {"step": state["step"]}
                    | {
                        name: value
                        for key in MOMENTS
                        for name, value in (
                            (key, _dequantized(p, state, key)),
                            (f"{key}_codes", state[f"{key}_codes"]),
                        )
                    }
                    | master
                )
            saved["state"][param_id] = {**state, "step": state["step"].to("cpu", copy=True)}
    return saved


def _dequantized(p: torch.Tensor, state: dict, key: str) -> torch.Tensor:
    """The fp32 values of moment ``key`` of ``p``'s 8-bit ``state``, laid out as ``p``."""
    values = dequantize(_local(state[f"{key}_codes"]), _local(state[f"{key}_scales"]), key)
    return _like(p, values, tuple(p.shape))


def check_loadable(
    owner: str, state_dict: dict, param_groups: list[dict], managed: Callable[[torch.Tensor], bool]
) -> list[tuple[int, torch.Tensor]]:
    """Check, before anything is loaded, what the in-backward update needs of ``state_dict``: a group that
    holds managed tensors only with the options and hyperparameter ranges the update implements (any other
    group loads as into torch.optim.AdamW); as many groups and parameters as ``param_groups``; each managed
    tensor's moments tensors of its shape, or no state; every parameter's state tensors (all but the 0-dim
    ones, ``step``) sharded as the parameter is: a DTensor of its placements for a DTensor (FSDP2, EP) and
    a plain tensor for a plain one. torch.optim.Optimizer.load_state_dict would take a full tensor for a
    shard, and the step would fail after the load replaced the whole state. Returns the (saved id, tensor)
    pairs.

    Raises:
        ValueError: what does not hold, naming the option, the parameter and the key.
    """
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(param_groups):
        raise ValueError("loaded state dict has a different number of parameter groups")  # torch's words
    for group, own in zip(saved_groups, param_groups, strict=True):
        if any(managed(p) for p in own["params"]):
            check_group_options(f"{owner}.load_state_dict", group, True)
            ops.check_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"])
    pairs = _pairs(saved_groups, param_groups)
    for param_id, p in pairs:
        saved = state_dict["state"].get(param_id, {})
        _check_placements(param_id, p, saved)
        if not managed(p):
            continue
        for key in MOMENTS:
            value = saved.get(key)
            if saved and not isinstance(value, torch.Tensor):
                raise ValueError(f"the state of parameter {param_id} has no {key} tensor")
            if isinstance(value, torch.Tensor) and value.shape != p.shape:
                raise ValueError(
                    f"{key} of parameter {param_id} has shape {tuple(value.shape)}, the parameter {tuple(p.shape)}"
                )
    return pairs


def _check_placements(param_id, p: torch.Tensor, saved: dict) -> None:
    """A saved state of ``p`` whose tensors are sharded as ``p`` is (see :func:`check_loadable`)."""
    for key, value in saved.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            continue
        if isinstance(p, DTensor) != isinstance(value, DTensor) or (
            isinstance(p, DTensor) and value.placements != p.placements
        ):
            shown = f"DTensor with placements {value.placements}" if isinstance(value, DTensor) else "tensor"
            wanted = (
                f"a DTensor with placements {p.placements}" if isinstance(p, DTensor) else "a plain tensor"
            )
            raise ValueError(
                f"{key} of parameter {param_id} is a {shown}, the parameter's state must be {wanted}: a state "
                "dict saved under another sharding loads through torch.distributed.checkpoint.state_dict's "
                "set_optimizer_state_dict (docs/distributed.md)"
            )


def _load_8bit(p: torch.Tensor, saved: dict) -> dict:
    """The 8-bit fields of ``p``'s state from its saved state: the saved codes with the scales their
    dequantized moments give (exact), or the saved moments quantized (a torch.optim.AdamW state; zeros for
    none)."""
    state = {}
    for key in MOMENTS:
        value, codes = saved.get(key), saved.get(f"{key}_codes")
        if not isinstance(value, torch.Tensor):  # no saved state: zeros
            state |= {name: t for name, t in _quantized(p, None).items() if name.startswith(f"{key}_")}
            continue
        value = _local_values(p, value, key)
        if isinstance(codes, torch.Tensor) and codes.dtype == CODES[key] and codes.shape == p.shape:
            scales = value.reshape(*scales_shape(tuple(value.shape)), -1).abs().amax(dim=-1)
            codes = _local(codes).to(value.device, copy=True).contiguous()
        else:
            codes, scales = quantize(value, key)
        state[f"{key}_codes"] = _like(p, codes, tuple(p.shape))
        state[f"{key}_scales"] = _like(p, scales, scales_shape(tuple(p.shape)))
    return state


def load_expert_state(
    p: torch.Tensor,
    state: dict,
    saved: dict,
    moments_dtype: torch.dtype | None,
    master: str | None = None,
    seed: int = 0,
) -> None:
    """Rewrite ``state`` (``p``'s, after torch.optim.Optimizer.load_state_dict) from ``saved`` (its saved
    state, possibly empty) as the kernels read it: the moments in the dtype they were saved with when the
    kernels take it (torch casts them to the parameter's dtype), else ``p``'s, or ``moments_dtype`` when
    given; fresh zero moments and ``step`` 0 for a parameter saved without state; ``step`` a float32
    tensor on ``p``'s device; no other key. 8-bit moments (:func:`uses_8bit`): see :func:`with_cpu_steps`."""
    eight_bit = uses_8bit(p, moments_dtype)
    if moments_dtype == EIGHT_BIT:
        moments_dtype = None  # a bias: exact moments
    for key in () if eight_bit else MOMENTS:
        value = saved.get(key)
        if isinstance(value, torch.Tensor):
            kept = value.dtype if value.dtype in ops.SUPPORTED_DTYPES else p.dtype
            state[key] = torch.empty_like(p, dtype=moments_dtype or kept).copy_(value)
        else:
            state[key] = torch.zeros_like(p, dtype=moments_dtype or p.dtype)
    step = saved.get("step")
    state["step"] = (  # a copy: never the saved tensor (a live optimizer's state_dict holds its own)
        torch.as_tensor(0.0 if step is None else step, dtype=torch.float32).to(p.device).reshape(()).clone()
    )
    kept = ("step", *MOMENTS)
    if eight_bit:
        state |= _load_8bit(p, saved)
        kept = ("step", *(f"{key}_{part}" for key in MOMENTS for part in ("codes", "scales")))
    if master == REMAINDER:  # the saved remainder, else zeros (a checkpoint of bf16 weights alone)
        state["remainder"] = _remainder(p, saved.get("remainder"))
        kept = (*kept, "remainder")
    elif master == STOCHASTIC:  # the saved seed, else ``seed`` (the one this optimizer gives p)
        state["seed"] = _seed(p, saved.get("seed"), seed)
        kept = (*kept, "seed")
    for key in list(state):
        if key not in kept:
            del state[key]


def load_fp32_masters(
    owner: str, states: dict, managed: Callable[[torch.Tensor], bool], master, masters
) -> None:
    """The body of ``load_fp32_masters`` (optim/in_backward.py): every (tensor, fp32 master) pair of
    ``masters`` (a mapping or pairs) checked, then each bf16 tensor and its ``states[p]["remainder"]`` set to
    the master's split (``master`` "remainder"), or the tensor to the master rounded to nearest
    ("stochastic"). A sharded (DTensor) tensor takes a master sharded as it (each rank writes its shard).

    Raises:
        ValueError: ``master`` None; a tensor ``managed`` refuses; a master of another shape or placements,
            or not finite.
        TypeError: a master that is not a float32 tensor.
    """
    if master is None:
        raise ValueError(f"{owner}.load_fp32_masters: the optimizer was built with master_weights=None")
    pairs = list(masters.items() if hasattr(masters, "items") else masters)
    for p, value in pairs:
        if not managed(p):
            raise ValueError(
                f"{owner}.load_fp32_masters: a tensor of shape {tuple(p.shape)} is not an expert tensor of this "
                "optimizer"
            )
        if not isinstance(value, torch.Tensor) or value.dtype != torch.float32:
            kind = getattr(value, "dtype", type(value).__name__)
            raise TypeError(f"{owner}.load_fp32_masters: a master must be a float32 tensor, got {kind}")
        if value.shape != p.shape:
            raise ValueError(
                f"{owner}.load_fp32_masters: a master of shape {tuple(value.shape)} for a tensor of shape "
                f"{tuple(p.shape)}"
            )
        if isinstance(p, DTensor) != isinstance(value, DTensor) or (
            isinstance(p, DTensor) and value.placements != p.placements
        ):
            raise ValueError(
                f"{owner}.load_fp32_masters: the master of a sharded tensor must be a DTensor of its placements "
                f"({getattr(p, 'placements', None)}), and that of a plain tensor a plain tensor"
            )
        if not bool(whole(inf_norm(value)) < float("inf")):  # NaN or inf (a DTensor: over its mesh)
            raise ValueError(f"{owner}.load_fp32_masters: the master of shape {tuple(p.shape)} is not finite")
    with torch.no_grad():
        for p, value in pairs:
            value = _local(value).to(_local(p).device).contiguous()
            if master == REMAINDER:
                weight, remainder = split(value)
                _local(p).copy_(weight)
                _local(states[p]["remainder"]).copy_(remainder)
            else:
                _local(p).copy_(value)
