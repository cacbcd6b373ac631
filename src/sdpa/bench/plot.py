"""The results as a figure (matplotlib)."""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

from .. import __version__ as _sdpa_version
from .machine import lookup
from .peers import ordered

__all__ = ["plot_results"]


def plot_results(
    rows: Sequence[Dict[str, Any]], path: str, references: Optional[Dict[str, Any]] = None
) -> None:
    """Two panels: prefill GFLOP/s against sequence length, and against thread count."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
        from matplotlib.lines import Line2D  # noqa: PLC0415
    except ImportError as exc:
        raise RuntimeError(f"plotting needs matplotlib (pip install matplotlib): {exc}") from None

    prefill = [r for r in rows if not r["decode"]]
    thread_counts = sorted({r["threads"] for r in rows})
    tmax = thread_counts[-1] if thread_counts else 1
    markers = {"sdpa": "o", "numpy": "s", "torch": "^", "ort": "v", "ort-mha": "<", "openvino": "D"}
    styles: Dict[str, Any] = {
        "sdpa": "-",
        "numpy": ":",
        "torch": "--",
        "ort": "-.",
        "ort-mha": (0, (3, 1, 1, 1, 1, 1)),
        "openvino": (0, (5, 2)),
    }
    gemm_entries = (references or {}).get("gemm", {}).get("results", [])
    gemm_dtype = (references or {}).get("gemm", {}).get("dtype")
    gemm_label = f"{gemm_dtype} gemm (NumPy)" if gemm_dtype else "gemm (NumPy)"

    def gflops(row: Dict[str, Any], impl: str) -> Optional[float]:
        r = row["impls"].get(impl)
        return r["gflops"] if r and r["status"] == "ok" else None

    # the implementations measured somewhere (NumPy is skipped in 16 bits)
    impls = [i for i in ordered({i for r in rows for i in r["impls"]}) if any(gflops(r, i) is not None for r in rows)]

    fig, (ax_len, ax_thr) = plt.subplots(1, 2, figsize=(13, 5.2))

    at_tmax = [r for r in prefill if r["threads"] == tmax]
    for impl in impls:
        pts = sorted((r["L"], g) for r in at_tmax if (g := gflops(r, impl)) is not None)
        if pts:
            ax_len.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                linestyle="none",
                marker=markers.get(impl, "x"),
                markersize=7,
                alpha=0.8,
                label=impl,
            )
    for r in at_tmax:
        g = gflops(r, "sdpa")
        if g is not None:
            ax_len.annotate(r["shape"], (r["L"], g), textcoords="offset points", xytext=(6, 3), fontsize=7)
    ref = lookup(gemm_entries, tmax, "gflops")
    if ref is not None:
        ax_len.axhline(ref, color="0.5", linestyle="--", linewidth=1, label=gemm_label)
    ax_len.set_xscale("log", base=2)
    lengths = sorted({r["L"] for r in at_tmax})
    if lengths:
        ax_len.set_xticks(lengths)
        ax_len.set_xticklabels([str(n) for n in lengths])
        ax_len.minorticks_off()
    ax_len.margins(x=0.15)
    ax_len.set_xlabel("sequence length L")
    ax_len.set_ylabel("GFLOP/s")
    ax_len.set_title(f"prefill shapes, {tmax} thread{'s' if tmax != 1 else ''}")
    ax_len.set_ylim(0, max(ax_len.get_ylim()[1], (ref or 0.0) * 1.08))
    ax_len.grid(True, alpha=0.3)
    ax_len.legend(fontsize=8)

    names = list(dict.fromkeys(r["shape"] for r in prefill))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, name in enumerate(names):
        color = colors[i % len(colors)]
        for impl in impls:
            pts = sorted(
                (r["threads"], g)
                for r in prefill
                if r["shape"] == name and (g := gflops(r, impl)) is not None
            )
            if pts:
                ax_thr.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    color=color,
                    linestyle=styles.get(impl, "-"),
                    marker=markers.get(impl, "x"),
                    markersize=4,
                )
    ref_pts = [(e["threads"], e["gflops"]) for e in gemm_entries if e["threads"] is not None]
    if ref_pts:
        ax_thr.plot([p[0] for p in ref_pts], [p[1] for p in ref_pts], color="0.4", linewidth=2, alpha=0.6)
    handles = [Line2D([], [], color=colors[i % len(colors)], label=n) for i, n in enumerate(names)]
    handles += [
        Line2D([], [], color="k", linestyle=styles.get(i, "-"), marker=markers.get(i, "x"), markersize=4, label=i)
        for i in impls
    ]
    if ref_pts:
        handles.append(Line2D([], [], color="0.4", linewidth=2, alpha=0.6, label=gemm_label))
    ax_thr.set_xticks(thread_counts)
    ax_thr.set_xlabel("threads")
    ax_thr.set_ylabel("GFLOP/s")
    ax_thr.set_title("prefill shapes against thread count")
    ax_thr.set_ylim(bottom=0)
    ax_thr.grid(True, alpha=0.3)
    ax_thr.legend(handles=handles, fontsize=7, ncol=2)

    fig.suptitle(f"sdpa {_sdpa_version}: attention throughput ({_dtypes(rows)})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _dtypes(rows: Sequence[Dict[str, Any]]) -> str:
    """``bfloat16``, or ``float32 query, bfloat16 k/v`` for a 16-bit cache; empty without rows."""
    if not rows:
        return ""
    dtype, kv_dtype = rows[0]["dtype"], rows[0].get("kv_dtype")
    return dtype if kv_dtype in (None, dtype) else f"{dtype} query, {kv_dtype} k/v"

