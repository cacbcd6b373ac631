"""The optional packages (torch, onnxruntime, openvino), imported on first use;
why one cannot be used is kept for the report."""
from __future__ import annotations

from typing import Any, Optional

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


def _load_torch() -> Any:
    """``torch`` when it can be imported, else None (the reason is kept for the report)."""
    global _torch_module, _torch_error
    if _torch_module is None and _torch_error is None:
        try:
            import torch  # noqa: PLC0415 - optional, heavy

            _torch_module = torch
        except ImportError as exc:
            _torch_error = _import_error("torch", exc)
    return _torch_module


def _load_onnxruntime() -> Any:
    """``onnxruntime`` when it can be imported, else None (the reason is kept for the report)."""
    global _ort_module, _ort_error
    if _ort_module is None and _ort_error is None:
        try:
            import onnxruntime  # noqa: PLC0415 - optional

            _ort_module = onnxruntime
        except ImportError as exc:
            _ort_error = _import_error("onnxruntime", exc)
    return _ort_module


def _load_openvino() -> Any:
    """``openvino`` when it can be imported, else None (the reason is kept for the report)."""
    global _openvino_module, _openvino_error
    if _openvino_module is None and _openvino_error is None:
        try:
            import openvino  # noqa: PLC0415 - optional, heavy

            _openvino_module = openvino
        except ImportError as exc:
            _openvino_error = _import_error("openvino", exc)
    return _openvino_module
