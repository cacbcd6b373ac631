"""The optional packages (torch, onnxruntime, openvino), imported on first use;
why one cannot be used is kept for the report."""
from __future__ import annotations

import importlib
from typing import Any, Optional, Tuple

# --------------------------------------------------------------------------- the optional packages

_torch_module: Any = None
_torch_error: Optional[str] = None
_ort_module: Any = None
_ort_error: Optional[str] = None
_openvino_module: Any = None
_openvino_error: Optional[str] = None


def _import_error(name: str, exc: ImportError) -> str:
    """Why an optional package cannot be used: not installed, or failing to import."""
    missing = getattr(exc, "name", None) == name
    return f"{name} is not installed" if missing else f"{name} cannot be imported ({exc})"


def _try_import(name: str) -> Tuple[Any, Optional[str]]:
    """(the module, None), or (None, why it cannot be used)."""
    try:
        return importlib.import_module(name), None
    except ImportError as exc:
        return None, _import_error(name, exc)


def _load_torch() -> Any:
    """``torch`` when it can be imported, else None (the reason is kept for the report)."""
    global _torch_module, _torch_error
    if _torch_module is None and _torch_error is None:
        _torch_module, _torch_error = _try_import("torch")
    return _torch_module


def _load_onnxruntime() -> Any:
    """``onnxruntime`` when it can be imported, else None (the reason is kept for the report)."""
    global _ort_module, _ort_error
    if _ort_module is None and _ort_error is None:
        _ort_module, _ort_error = _try_import("onnxruntime")
    return _ort_module


def _load_openvino() -> Any:
    """``openvino`` when it can be imported, else None (the reason is kept for the report)."""
    global _openvino_module, _openvino_error
    if _openvino_module is None and _openvino_error is None:
        _openvino_module, _openvino_error = _try_import("openvino")
    return _openvino_module
