"""Dtype facts by torch name: element size, safetensors code, and which dtypes --dtype casts."""

from __future__ import annotations

# name -> (bytes per element, safetensors dtype code)
DTYPES: dict[str, tuple[int, str]] = {
    "float64": (8, "F64"),
    "float32": (4, "F32"),
    "float16": (2, "F16"),
    "bfloat16": (2, "BF16"),
    "float8_e4m3fn": (1, "F8_E4M3"),
    "float8_e5m2": (1, "F8_E5M2"),
    "float8_e8m0fnu": (1, "F8_E8M0"),
    "int64": (8, "I64"),
    "int32": (4, "I32"),
    "int16": (2, "I16"),
    "int8": (1, "I8"),
    "uint64": (8, "U64"),
    "uint32": (4, "U32"),
    "uint16": (2, "U16"),
    "uint8": (1, "U8"),
    "bool": (1, "BOOL"),
    "complex64": (8, "C64"),
}

# The dtypes --dtype converts between; everything else is copied as it is.
CASTABLE = frozenset({"float64", "float32", "float16", "bfloat16"})

# --dtype spellings accepted on the command line and in the API, exactly these (the help lists them).
TARGET_ALIASES = {
    "keep": None,
    "bf16": "bfloat16",
    "fp16": "float16",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "float32": "float32",
}


def itemsize(dtype: str) -> int:
    return DTYPES[dtype][0]


def safetensors_code(dtype: str) -> str:
    return DTYPES[dtype][1]


def target_dtype(source: str, wanted: str | None) -> str:
    """The dtype a tensor is written in: `wanted` for floating tensors, the source dtype otherwise."""
    if wanted is None or source not in CASTABLE:
        return source
    return wanted


def torch_dtype(name: str):
    import torch

    return getattr(torch, name)
