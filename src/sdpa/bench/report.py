"""The results as text: the tables printed to stdout, and the JSON file."""

from __future__ import annotations

import json
import sys
from typing import Any, Dict, List, Optional, Sequence

from .peers import AGREEMENT_TOLERANCE, check_dtype, ordered
from .shapes import MiB

__all__ = [
    "format_table",
    "describe_kernels",
    "suite_notes",
    "gemm_label",
    "format_references",
    "describe_skips",
    "format_latency_table",
    "describe_latency_skips",
    "format_generate",
    "format_cache_table",
    "cache_notes",
    "write_json",
]


def _fmt_rate(x: Optional[float]) -> str:
    """A rate with three significant figures or so; empty for None."""
    if x is None:
        return ""
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


#: What a GFLOP/s cell says for an implementation that was not timed, by its status.
_STATUS_CELLS = {"skipped": "-", "absent": "absent", "unsupported": "unsup", "mismatch": "WRONG", "error": "err"}


def _fmt_impl(row: Dict[str, Any], impl: str, key: str = "gflops") -> str:
    """One implementation's figure in a row; for one not timed, its status (:data:`_STATUS_CELLS`)."""
    r = row["impls"].get(impl)
    if r is None:
        return "-"
    if r["status"] != "ok":
        return _STATUS_CELLS.get(r["status"], r["status"])
    return _fmt_rate(r.get(key))


def _fmt_ratio(x: Optional[float]) -> str:
    """``1.23x``, or ``-`` for None."""
    return "-" if x is None else f"{x:.2f}x"


def _fmt_err(x: Optional[float]) -> str:
    """An error with two significant figures, ``3.8e-3``; ``-`` for None."""
    if x is None:
        return "-"
    if x != x:  # NaN
        return "nan"
    if x == 0:
        return "0"
    mantissa, _, exponent = f"{x:.1e}".partition("e")
    return f"{mantissa}e{int(exponent)}"


def _fmt_err_ratio(x: Optional[float]) -> str:
    """A ratio of errors: ``0.82x``, or ``3.5e-5x`` when it is below 0.1 (a float32 query
    against a 16-bit cache, compared with torch's cast query)."""
    if x is not None and x != x:
        return "nan"
    if x is None or x >= 0.095:  # what would round to 0.10x and above
        return _fmt_ratio(x)
    return f"{_fmt_err(x)}x"


def gemm_label(dtype: str = "float32") -> str:
    """The gemm reference's name in the table: ``sgemm``, ``dgemm``, or ``f32 gemm`` for a
    16-bit run (the reference is then float32, the dtype sdpa computes 16-bit inputs in)."""
    return {"float32": "sgemm", "float64": "dgemm"}.get(dtype, "f32 gemm")


def format_table(rows: Sequence[Dict[str, Any]], dtype: str = "float32") -> str:
    """The results as a plain-text table, one line per (shape, threads).

    One GFLOP/s column per implementation in the rows.  The ``masked/unmasked`` column
    (sdpa's speed with the mask over its speed without) appears when a row has a mask,
    the error columns (max absolute error against the float64 reference, and the ratio
    sdpa's over torch's) when the rows carry errors.
    """
    errors = any(row.get("error_rows") for row in rows)
    masks = any(row.get("mask") for row in rows)
    present = {impl for row in rows for impl in row["impls"]}
    impls = ordered(present) or ["sdpa", "numpy", "torch"]
    header = ["shape", "threads"] + [f"{impl} GFLOP/s" for impl in impls]
    header += ["sdpa/torch", f"% {gemm_label(dtype)}", "sdpa GB/s", "% bw"]
    if masks:
        header += ["masked/unmasked"]
    if errors:
        header += ["sdpa err", "torch err", "err sdpa/torch"]
    lines: List[List[str]] = []
    for row in rows:
        ratio = row.get("sdpa_over_torch")
        pct = row.get("sdpa_pct_gemm")
        decode = row.get("decode")
        pct_bw = row.get("sdpa_pct_bandwidth") if decode else None
        cells = [row["shape"], str(row["threads"])]
        cells += [_fmt_impl(row, impl) for impl in impls]
        cells += [
            _fmt_ratio(ratio),
            "" if pct is None else f"{pct:.1f}%",
            _fmt_impl(row, "sdpa", "gbps") if decode else "",
            "" if pct_bw is None else f"{pct_bw:.0f}%",
        ]
        if masks:
            cells.append(_fmt_ratio(row.get("sdpa_mask_speed")) if row.get("mask") else "")
        if errors:
            cells += [
                _fmt_err(row.get("sdpa_err")),
                _fmt_err(row.get("torch_err")),
                _fmt_err_ratio(row.get("sdpa_err_over_torch")),
            ]
        lines.append(cells)
    return _render(header, lines)


def _render(header: Sequence[str], lines: Sequence[Sequence[str]]) -> str:
    """Columns as wide as their widest cell: the first left-aligned, the others right."""
    widths = [
        max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(header)
    ]

    def render(cells: Sequence[str]) -> str:
        out = [cells[0].ljust(widths[0])]
        out += [c.rjust(w) for c, w in zip(cells[1:], widths[1:])]
        return "  ".join(out).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([render(header), rule] + [render(line) for line in lines])


def format_references(references: Dict[str, Any]) -> str:
    """The machine references as one line each (empty when none were measured)."""
    lines = []
    gemm = references.get("gemm", {})
    if gemm.get("results"):
        parts = [
            f"{e['gflops']:.1f} GFLOP/s ({e['threads'] if e['threads'] is not None else 'default'} thr)"
            for e in gemm["results"]
        ]
        how = (
            "BLAS threads set with threadpoolctl"
            if gemm["threads_controlled"]
            else "default BLAS threads: threadpoolctl not installed"
        )
        lines.append(f"{gemm['dtype']} gemm {gemm['n']}^3: " + ", ".join(parts) + f"  [{how}]")
    bw = references.get("bandwidth", {})
    if bw.get("results"):
        parts = [f"{e['gbps']:.1f} GB/s ({e['threads']} thr)" for e in bw["results"]]
        lines.append(f"read bandwidth, np.add.reduce over {bw['bytes'] // MiB} MiB: " + ", ".join(parts))
    return "\n".join(lines)


def describe_skips(rows: Sequence[Dict[str, Any]]) -> List[str]:
    """One note per implementation not measured, saying why, and per note on how one was
    run (torch on a cache of another dtype, a layout or mask form a peer needs); naming
    the shapes unless it is all of them."""
    shapes: Dict[str, Dict[str, None]] = {}  # note -> the shapes it applies to, in order
    for row in rows:
        for impl, r in row["impls"].items():
            if r["status"] != "ok":
                note = f"{impl} {r['status']} ({r['reason']})"
            elif r.get("note"):
                note = f"{impl}: {r['note']}"
            else:
                continue
            shapes.setdefault(note, {})[row["shape"]] = None
    every = list(dict.fromkeys(row["shape"] for row in rows))
    return [
        note if len(every) > 1 and list(names) == every else f"{', '.join(names)}: {note}"
        for note, names in shapes.items()
    ]


def describe_kernels(rows: Sequence[Dict[str, Any]]) -> str:
    """Which kernel each implementation ran, "fused" or "unfused", in one line: the
    shapes named where an implementation ran both.  Empty when no row says."""
    kernels: Dict[str, Dict[str, Dict[str, None]]] = {}  # impl -> kernel -> shapes, in order
    for row in rows:
        for impl, r in row["impls"].items():
            if r.get("kernel"):
                kernels.setdefault(impl, {}).setdefault(r["kernel"], {})[row["shape"]] = None
    parts = []
    for impl in ordered(kernels):
        by_kernel = kernels[impl]
        if len(by_kernel) == 1:
            parts.append(f"{impl} {next(iter(by_kernel))}")
        else:
            parts.append(f"{impl} " + ", ".join(f"{k} ({', '.join(names)})" for k, names in by_kernel.items()))
    return "kernels: " + "; ".join(parts) if parts else ""


def suite_notes(rows: Sequence[Dict[str, Any]], error_rows: int = 0) -> List[str]:
    """The notes printed under the suite's table: what the err, masked/unmasked and
    agreement figures are, the kernels, and why any implementation was not measured."""
    notes: List[str] = []
    if error_rows and rows:
        notes.append(
            f"err: max |output - float64 reference| over up to {error_rows} query rows per shape "
            "(first, last, random), on the same rounded inputs"
        )
    if any(row.get("mask") for row in rows):
        notes.append(
            "masked/unmasked: sdpa's speed with the mask over its speed without it, same shape and "
            "inputs (unmasked time / masked time); GFLOP/s of a masked shape count the pairs it keeps"
        )
    checked = any(r.get("agreement") for row in rows for r in row["impls"].values())
    if checked:
        dtype = check_dtype(*{d for row in rows for d in (row.get("dtype"), row.get("kv_dtype")) if d})
        rtol, atol = AGREEMENT_TOLERANCE.get(dtype, AGREEMENT_TOLERANCE["float32"])
        notes.append(
            "every other output is checked against sdpa's once per shape (np.allclose, "
            f"rtol={rtol:.2g}, atol={atol:.2g} in {dtype}); WRONG: it disagreed, and was not timed"
        )
    kernels = describe_kernels(rows)
    if kernels:
        notes.append(kernels)
    return notes + describe_skips(rows)


#: The latency table's implementation columns, in order, with their headers.
_LATENCY_COLUMNS = (("sdpa", "sdpa µs"), ("sdpa.torch", "sdpa.torch µs"), ("torch", "torch µs"), ("ort", "ORT µs"))


def format_latency_table(rows: Sequence[Dict[str, Any]]) -> str:
    """The latency results as a plain-text table, one line per (shape, threads).

    Figures are microseconds per call (``absent``: the package is not installed,
    ``err``: the call raised, ``-``: not run); ratios are of times, so below 1.00x
    the first takes less time.
    """
    header = ["shape", "threads"] + [title for _, title in _LATENCY_COLUMNS]
    header += ["sdpa/torch", "sdpa.torch/torch", "sdpa/ORT"]
    lines: List[List[str]] = []
    for row in rows:
        cells = [row["shape"], str(row["threads"])]
        for impl, _ in _LATENCY_COLUMNS:
            r = row["impls"].get(impl)
            if r is None:
                cells.append("-")
            elif r["status"] == "ok":
                cells.append(_fmt_rate(r["median_s"] * 1e6))
            else:
                cells.append("err" if r["status"] == "error" else r["status"])
        cells += [
            _fmt_ratio(row.get("sdpa_over_torch")),
            _fmt_ratio(row.get("sdpa_torch_over_torch")),
            _fmt_ratio(row.get("sdpa_over_ort")),
        ]
        lines.append(cells)
    return _render(header, lines)


def describe_latency_skips(rows: Sequence[Dict[str, Any]]) -> List[str]:
    """One note per implementation that did not run, naming the shapes unless it is all of them."""
    shapes: Dict[str, Dict[str, None]] = {}  # note -> the shapes it applies to, in order
    for row in rows:
        for impl, r in row["impls"].items():
            if r["status"] != "ok":
                note = f"{impl} {r['status']} ({r['reason']})"
                shapes.setdefault(note, {})[row["shape"]] = None
    every = list(dict.fromkeys(row["shape"] for row in rows))
    return [
        note if list(names) == every else f"{', '.join(names)}: {note}" for note, names in shapes.items()
    ]


def format_generate(result: Dict[str, Any]) -> str:
    """The ``generate()`` measurement of :func:`~sdpa.bench.generate.measure_generate` as text."""
    threads = result["threads"]
    title = f"generate() of a tiny random-weight Llama, {threads} thread{'s' if threads != 1 else ''}:"
    if result["status"] != "ok":
        return f"{title} {result['status']} ({result['reason']})"
    model = result["model"]
    runs = len(result["torch"]["times_s"])
    lines = [
        f"{title} {model['num_hidden_layers']} layers, hidden {model['hidden_size']}, "
        f"{model['num_attention_heads']}/{model['num_key_value_heads']} heads; "
        f"{result['prompt_tokens']}-token prompt, {result['new_tokens']} new tokens, greedy; "
        f"median of {runs} run{'s' if runs != 1 else ''}",
        f"  torch's attention     {result['torch']['median_s']:.4f} s",
        f"  sdpa.torch.patch()    {result['sdpa']['median_s']:.4f} s  "
        f"sdpa/torch {_fmt_ratio(result['sdpa_over_torch'])}, "
        + ("same tokens" if result["same_tokens"] else "DIFFERENT TOKENS"),
    ]
    return "\n".join(lines)


def format_cache_table(rows: Sequence[Dict[str, Any]]) -> str:
    """The cache mode's results as a plain-text table, one line per (shape, threads,
    cache dtype).

    ``MiB``: the bytes a step reads (keys and values as stored, their scales
    included); ``ms``: the median time of a step; ``GB/s`` and ``% bw`` (decode
    shapes): those bytes over the time, and that as a percentage of the read-bandwidth
    reference; ``vs <first>``: the first cache dtype's time over this one's (above 1x:
    faster); ``err`` (when measured): max |output - float64 reference|.  A cache not
    measured shows its status in the ``ms`` column (``absent``, ``unsup``).
    """
    errors = any(row.get("error_rows") for row in rows)
    baseline = rows[0]["baseline"] if rows else "float32"
    header = ["shape", "threads", "cache", "MiB", "ms", "GB/s", "% bw", f"vs {baseline}"]
    if errors:
        header.append("err")
    lines: List[List[str]] = []
    for row in rows:
        for spec, r in row["caches"].items():
            cells = [row["shape"], str(row["threads"]), spec]
            if r["status"] != "ok":
                cells += ["", _STATUS_CELLS.get(r["status"], r["status"]), "", "", ""]
                if errors:
                    cells.append("")
                lines.append(cells)
                continue
            pct = r.get("pct_bandwidth")
            cells += [
                _fmt_rate(r["bytes"] / MiB),
                _fmt_rate(r["median_s"] * 1e3),
                _fmt_rate(r.get("gbps")),
                "" if pct is None else f"{pct:.0f}%",
                _fmt_ratio(r.get("speedup")),
            ]
            if errors:
                cells.append(_fmt_err(r.get("max_abs_err")))
            lines.append(cells)
    return _render(header, lines)


def cache_notes(rows: Sequence[Dict[str, Any]], error_rows: int = 0) -> List[str]:
    """The notes printed under the cache mode's table: how it was timed, what the bytes
    and the errors count, and why any cache was not measured."""
    if not rows:
        return []
    rounds = max((r.get("rounds", 0) for row in rows for r in row["caches"].values()), default=0)
    baseline = rows[0]["baseline"]
    notes = [
        f"ms: median of {rounds} round{'s' if rounds != 1 else ''} alternating between the caches, "
        "each a loop of back-to-back KVCache.attend calls with a float32 query; "
        f"vs {baseline}: the {baseline} cache's time over this one's (above 1x: faster)",
        "MiB, GB/s: the keys and values as the cache stores them (int8 and float8: one byte "
        "each, int4: half a byte, and their float32 scales), read once per step; +iqk: the "
        "same cache with integer_qk=True",
    ]
    if error_rows and any(row.get("error_rows") for row in rows):
        notes.append(
            f"err: max |output - float64 attention over the float32 keys and values| over up to "
            f"{error_rows} query rows per shape: storing them in the cache's dtype included"
        )
    shapes: Dict[str, Dict[str, None]] = {}  # note -> the shapes it applies to, in order
    for row in rows:
        for spec, r in row["caches"].items():
            if r["status"] != "ok":
                shapes.setdefault(f"{spec} {r['status']} ({r['reason']})", {})[row["shape"]] = None
    every = list(dict.fromkeys(row["shape"] for row in rows))
    notes += [
        note if list(names) == every else f"{', '.join(names)}: {note}" for note, names in shapes.items()
    ]
    return notes


def write_json(path: str, payload: Dict[str, Any]) -> None:
    """Write ``payload`` to ``path`` as indented JSON, and say so on stderr."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=1, default=str)
        f.write("\n")
    print(f"wrote {path}", file=sys.stderr)
