"""KVCache's constructor parameters, derived from the one list of config fields.

``include/vkv/config.h`` lists every field once (``VKV_CACHE_CONFIG_FIELDS``: name, type,
default, meaning) and the binding hands that list to Python as
``vkv._C.CacheConfig.fields()``. KVCache's keyword options, their defaults, their type
checks and messages (the binding's), the Args section of its docstring and its
``__signature__`` come from it here; ``scripts/generate_stubs.py`` makes the stub and the
table in docs/api.md from the same list. Written here is only what Python does
differently: the positional order, and the parameters that take Python values (``dtype``,
``device``, ``memory_budget=None``, ``eager_tokens=None``).
"""

from __future__ import annotations

import inspect
import textwrap
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Tuple, Union

import numpy as np
import torch

from . import _build_info, _C

REQUIRED = inspect.Parameter.empty


class Field(NamedTuple):
    """One CacheConfig field, as ``vkv._C.CacheConfig.fields()`` describes it."""

    name: str
    type: str  # its Python type's name: 'int', 'bool' or 'str'
    default: Any
    meaning: str


class Parameter(NamedTuple):
    """One parameter of ``vkv.KVCache()``: the config field it sets, and how."""

    name: str
    field: str
    annotation: Any
    default: Any  # REQUIRED where the caller must pass it
    doc: str
    to_field: Callable[[Any], Any]  # the caller's value -> the field's value (checked by the binding)


FIELDS: Tuple[Field, ...] = tuple(Field(*field) for field in _C.CacheConfig.fields())

# The first arguments, in this order; every other field is a keyword-only option.
_REQUIRED = ("num_layers", "num_kv_heads", "head_dim", "dtype", "max_batch_size", "max_context_len")
_POSITIONAL = _REQUIRED + ("device", "layout")

_PYTHON_TYPES = {"int": int, "bool": bool, "str": str}


def _unchanged(value: Any) -> Any:
    return value


# -- the parameters that take Python values ------------------------------------------


def _dtype_bytes(dtype: Any) -> int:
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype = {dtype!r} must be a torch.dtype")
    return dtype.itemsize


def resolve_device(device: Union[str, torch.device, None]) -> torch.device:
    """'cuda' -> cuda:<current>, 'auto'/None -> cuda if vkv and torch see a GPU, else cpu."""
    if device is None or device == "auto":
        device = "cuda" if _C.cuda_available() and torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device = {device!r} is not a device: expected 'cuda', 'cuda:N', 'cpu' or 'auto'") from error
    if device.type == "cuda":
        if not _build_info.cuda_backend:
            raise ValueError(f"device = '{device}' needs CUDA, but vkv was built without its CUDA backend: "
                             f"{_build_info.cuda_why_not}; reinstall vkv with CUDA_HOME set to a CUDA toolkit, "
                             "or use device='cpu'")
        if not _C.cuda_available():
            raise ValueError(f"device = '{device}' needs a CUDA device, and none is visible; use device='cpu'")
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.device("cuda", index)
    if device.type != "cpu":
        raise ValueError(f"device = '{device}' is not supported: expected 'cuda', 'cuda:N', 'cpu' or 'auto'")
    return device


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


UINT64_MAX = (1 << 64) - 1


def expect_int(name: str, value: Any, low: int = 0, high: int = UINT64_MAX) -> int:
    """``value`` as an int in [low, high]: every public integer argument of the cache and the
    shared budget goes through here, so that a bool, a float, a negative value or one of
    2**64 and more raises ValueError naming the parameter and the value (not pybind's
    "incompatible function arguments")."""
    if not _is_int(value):
        raise ValueError(f"{name} = {value!r} must be an int")
    if value < low:
        raise ValueError(f"{name} = {value} must be >= {low}")
    if value > high:
        limit = "2**64 - 1" if high == UINT64_MAX else str(high)
        raise ValueError(f"{name} = {value} must be <= {limit}")
    return int(value)


def _memory_budget(memory_budget: Optional[int]) -> Any:
    if memory_budget is None:
        return 0  # the core's "enough for every slot"
    if _is_int(memory_budget) and memory_budget < 1:
        raise ValueError(f"memory_budget = {memory_budget} must be >= 1 (or None: enough for every slot)")
    return memory_budget


def _eager_tokens(eager_tokens: Optional[int]) -> Any:
    return _C.ADAPTIVE if eager_tokens is None else eager_tokens


def _python_parameter(field: Field) -> Optional[Parameter]:
    """The parameter for a field whose Python value differs from the core's, else None."""
    if field.name == "dtype_bytes":
        return Parameter("dtype", field.name, torch.dtype, REQUIRED,
                         f"element type, a torch.dtype; {field.meaning}", _dtype_bytes)
    if field.name == "device":
        return Parameter(field.name, field.name, Union[str, torch.device, None], field.default,
                         "'auto' (cuda if vkv and torch see a GPU, else cpu), 'cpu' (the host backend), "
                         "'cuda' (the current CUDA device), 'cuda:N', or a torch.device",
                         lambda device: str(resolve_device(device)))
    if field.name == "memory_budget":
        return Parameter(field.name, field.name, Optional[int], None,
                         "most physical memory in bytes; None = enough for every slot, at most 90% of the "
                         "free device memory", _memory_budget)
    if field.name == "eager_tokens":
        return Parameter(field.name, field.name, Optional[int], None,
                         "tokens kept mapped in the slot alloc_reqid() hands out next, for the next prefill; "
                         "None follows recent prompt lengths, 0 turns it off", _eager_tokens)
    return None


def _parameters() -> Tuple[Parameter, ...]:
    by_name: Dict[str, Parameter] = {}
    for field in FIELDS:
        parameter = _python_parameter(field) or Parameter(
            field.name, field.name, _PYTHON_TYPES[field.type], field.default, field.meaning, _unchanged
        )
        if parameter.name in _REQUIRED:
            parameter = parameter._replace(default=REQUIRED)
        by_name[parameter.name] = parameter
    first = [by_name.pop(name) for name in _POSITIONAL]
    return tuple(first) + tuple(by_name.values())


PARAMETERS: Tuple[Parameter, ...] = _parameters()
NAMES: Tuple[str, ...] = tuple(parameter.name for parameter in PARAMETERS)


def signature(return_annotation: Any = inspect.Signature.empty) -> inspect.Signature:
    """``vkv.KVCache``'s call: the positional arguments, then every other field as a keyword."""
    parameters = [
        inspect.Parameter(
            parameter.name,
            inspect.Parameter.POSITIONAL_OR_KEYWORD if parameter.name in _POSITIONAL else inspect.Parameter.KEYWORD_ONLY,
            default=parameter.default,
            annotation=parameter.annotation,
        )
        for parameter in PARAMETERS
    ]
    return inspect.Signature(parameters, return_annotation=return_annotation)


SIGNATURE = signature()


def bind(args: Tuple[Any, ...], kwargs: Mapping[str, Any]) -> Dict[str, Any]:
    """The caller's arguments by name, defaults filled in.

    Raises:
        ValueError: an unknown keyword (the message lists the valid ones).
        TypeError: a required argument is missing, or too many positional ones.
    """
    unknown = [name for name in kwargs if name not in NAMES]
    if unknown:
        raise ValueError(
            f"vkv.KVCache() got an unknown keyword argument {', '.join(map(repr, unknown))}: "
            f"the keywords are {', '.join(NAMES)}"
        )
    try:
        bound = SIGNATURE.bind(*args, **kwargs)
    except TypeError as error:
        raise TypeError(f"vkv.KVCache(): {error}") from None
    bound.apply_defaults()
    return dict(bound.arguments)


def to_config(arguments: Mapping[str, Any]) -> "_C.CacheConfig":
    """The core's config for bound arguments. ValueError names the caller's parameter and value."""
    config = _C.CacheConfig()
    for parameter in PARAMETERS:
        setattr(config, parameter.field, parameter.to_field(arguments[parameter.name]))
    return config


def callers_words(arguments: Mapping[str, Any]) -> Dict[str, str]:
    """What the core says about a config, in the words of the caller who passed ``arguments``:
    the field and value of a parameter that takes a Python value under another name
    (``dtype_bytes = 16``: ``dtype = torch.complex128``), and the host backend, which
    Python calls the cpu device."""
    words = {"backend 'host'": "device 'cpu'"}
    for parameter in PARAMETERS:
        if parameter.name != parameter.field:
            value = arguments[parameter.name]
            words[f"{parameter.field} = {parameter.to_field(value)}"] = f"{parameter.name} = {value}"
    return words


def docstring_args(indent: int = 12, width: int = 100) -> str:
    """Google-style 'Args:' entries, one per parameter, in signature order."""
    keep_together = "\u00a0=\u00a0"  # no line break inside "0 = all"
    lines: List[str] = []
    for parameter in PARAMETERS:
        lines += textwrap.wrap(
            f"{parameter.name}: {parameter.doc}.".replace(" = ", keep_together),
            width=width,
            initial_indent=" " * indent,
            subsequent_indent=" " * (indent + 4),
            break_on_hyphens=False,
        )
    return "\n".join(lines).replace(keep_together, " = ").lstrip()
