"""The command line: ``python -m sdpa.bench`` (the throughput suite, ``--latency`` or
``--cache-dtypes``)."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from .. import _core
from .cache import CACHE_DTYPES, iter_cache, parse_cache_dtypes
from .errors import ERROR_ROWS
from .generate import measure_generate
from .latency import LATENCY_THREADS, iter_latency
from .machine import lookup, machine_info, measure_references, package_version, reference_steps
from .paged import PAGED_CASES, case_available, format_paged_table, iter_paged
from .peers import (
    AGREEMENT_TOLERANCE,
    IMPLEMENTATIONS,
    KERNELS,
    LATENCY_IMPLEMENTATIONS,
    NUMPY_MAX_SCORE_BYTES,
    is_implementation,
    kernel_set_of,
)
from .plan import PLAN_CASES, format_plan_table, iter_plan
from .plot import plot_results
from .profile import format_profile_table, iter_profile, profile_notes
from .report import (
    cache_notes,
    describe_latency_skips,
    format_cache_table,
    format_generate,
    format_latency_table,
    format_references,
    format_table,
    suite_notes,
    write_json,
)
from .roofline import ROOFLINE_DTYPES, format_roofline_table, iter_roofline, limits_text, measure_limits
from .serving import SERVING_CASES, case_count as serving_case_count, format_serving_table, iter_serving
from .shapes import (
    CACHE_SHAPES,
    DTYPES,
    HALF_DTYPES,
    LATENCY_SHAPES,
    QUICK_SHAPES,
    SHAPES,
    Shape,
    attention_flops,
    make_mask,
    parse_shape,
    split_shapes,
)
from .sparse import (
    SPARSE_CASES,
    case_available as sparse_case_available,
    format_sparse_table,
    iter_sparse,
    sparse_limits,
)
from .suite import iter_suite, suite_dtypes
from .threads import default_threads, threads_text
from .timing import Progress
from .training import BACKWARD_CASES, backward_case_available, format_backward_table, iter_backward

__all__ = ["main"]


#: --min-time and --repeat unless given; with --latency --quick, the second pair.
_TIMING = (0.5, 5)
_QUICK_LATENCY_TIMING = (0.05, 3)


def _int_list(text: str) -> List[int]:
    """``--threads``: comma-separated counts, each >= 1, duplicates dropped."""
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"thread counts must be >= 1, got {text!r}")
    return list(dict.fromkeys(values))


def _build_parser() -> argparse.ArgumentParser:
    """The options of ``python -m sdpa.bench``."""
    p = argparse.ArgumentParser(
        prog="python -m sdpa.bench",
        description="Time sdpa against NumPy, PyTorch, ONNX Runtime and OpenVINO attention on this machine.",
        epilog="Columns are explained in benchmarks/README.md.",
    )
    p.add_argument(
        "--latency",
        action="store_true",
        help="microseconds per call on small shapes: sdpa, sdpa.torch, torch and ONNX Runtime, "
        "then generate() of a tiny Llama with and without sdpa.torch.patch()",
    )
    p.add_argument(
        "--cache-dtypes",
        nargs="?",
        const=",".join(CACHE_DTYPES),
        metavar="LIST",
        help="instead of the suite, a decoding step of a float32 query over a KVCache of each "
        f"dtype in LIST (default: {','.join(CACHE_DTYPES)}; NAME:G for one scale per G features, "
        "+iqk for integer_qk, +ipv for integer_pv): time, GB/s of the bytes read (scales included) and "
        "speed against the first; on "
        + " and ".join(s.name for s in CACHE_SHAPES)
        + " unless --shapes (--quick: the second)",
    )
    p.add_argument(
        "--roofline",
        action="store_true",
        help="instead of the suite, the decode steps of --cache-dtypes (default: "
        + ",".join(ROOFLINE_DTYPES)
        + ") against the machine's read bandwidth, float32 FMA and int8 dot-product peaks, measured by C "
        "probes at the same thread count: bytes and operations a step, the roofline time "
        "max(bytes / bandwidth, operations / peak) and the fraction of it achieved",
    )
    p.add_argument(
        "--paged",
        action="store_true",
        help="instead of the suite, paged_attention over block-table caches against the contiguous "
        "call and torch: decoding (blocks of 16 and 128, float32 and bfloat16), chunked prefill, "
        "shared prefixes read once, and MLA's latent cache (--quick: shorter sequences)",
    )
    p.add_argument(
        "--sparse",
        action="store_true",
        help="instead of the suite, top-k sparse attention and its indexer: sparse decoding (float32, "
        "bfloat16, MLA) and prefill against dense calls over as many keys, and index_topk against its "
        "roofline measured in the same run (--quick: S / 16; --cases picks some of "
        + ",".join(n for n, _ in SPARSE_CASES) + ")",
    )
    p.add_argument(
        "--backward",
        action="store_true",
        help="instead of the suite, training: attention_backward against the forward and torch's CPU flash "
        "backward (float32, bfloat16), a forward + backward step through sdpa.torch against torch's, and "
        "the forward with dropout against without (--quick: B 1, S 512; --cases picks some of "
        + ",".join(n for n, _ in BACKWARD_CASES) + ")",
    )
    p.add_argument(
        "--serving",
        action="store_true",
        help="instead of the suite, ragged serving calls in one call against the ways they are done "
        "otherwise: packed sequences (vs a call per sequence, and as a share of a dense call's rate), a "
        "mixed batch of chunked prefills and decodes (vs separate calls; its chunks vs contiguous calls), "
        "shared prefixes (vs copied ids), and paged decoding on every kernel set (vs the contiguous call)",
    )
    p.add_argument(
        "--plan",
        action="store_true",
        help="instead of timing, the balance of the serving calls' work lists as planned for 16, 64 and "
        "128 threads (or --threads) and simulated with the planner's cost model",
    )
    p.add_argument(
        "--cases",
        help="with --serving, --plan, --sparse or --backward: comma-separated case names (a prefix such as "
        "decode-avx512 selects the cases it starts)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="instead of the suite, sdpa's tiled path phase by phase: ns per score per core of "
        "packing, Q K^T, masks, softmax, P V and the epilogue, per shape (--impls: sdpa and sdpa@SET)",
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--shapes",
        help="comma-separated shape names (see --list) or NAME:B,Hq,Hkv,L,S,E[,causal][,MASK] specs "
        "(MASK: dense-bool, dense-float or padding)",
    )
    which.add_argument(
        "--quick",
        action="store_true",
        help="a few small shapes only (smoke runs); with --latency, short timing "
        f"(--min-time {_QUICK_LATENCY_TIMING[0]} --repeat {_QUICK_LATENCY_TIMING[1]})",
    )
    p.add_argument("--list", action="store_true", help="list the shapes and exit")
    p.add_argument(
        "--threads",
        type=_int_list,
        help="comma-separated thread counts (default: 1,N for N CPUs; with --latency: "
        + ",".join(map(str, LATENCY_THREADS))
        + ")",
    )
    p.add_argument(
        "--impls",
        help=f"implementations to run (default: {','.join(IMPLEMENTATIONS)}, those not installed "
        f"reported absent; with --latency: {','.join(LATENCY_IMPLEMENTATIONS)}); sdpa@SET runs sdpa "
        "with the kernel set SET forced, beside sdpa on this CPU's own choice (e.g. "
        "--impls sdpa,sdpa@avx512_bf16,torch on an AMX CPU)",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="dtype of q, k and v (default: float32); bfloat16 needs ml_dtypes. sdpa and torch "
        "run in it; the NumPy version is skipped in 16 bits. --latency: float32 or float64",
    )
    p.add_argument(
        "--kv-dtype",
        choices=DTYPES,
        help=f"dtype of k and v (default: --dtype): {' or '.join(HALF_DTYPES)} with --dtype float32 "
        "times a float32 query against a 16-bit cache (torch runs with the query cast to it)",
    )
    p.add_argument(
        "--error-rows",
        type=int,
        default=ERROR_ROWS,
        help="query rows per shape compared with the float64 reference for the err columns "
        f"(default: {ERROR_ROWS}; 0 leaves the errors out)",
    )
    p.add_argument(
        "--min-time",
        type=float,
        help=f"seconds of timed runs per measurement (default: {_TIMING[0]})",
    )
    p.add_argument("--repeat", type=int, help=f"at least this many timed runs (default: {_TIMING[1]})")
    p.add_argument(
        "--generate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --latency: time generate() of a tiny Llama too, when transformers is installed "
        "(default: on)",
    )
    p.add_argument("--gemm-size", type=int, default=2048, help="n of the n x n reference matmul; 0 skips it")
    p.add_argument(
        "--bandwidth-mib", type=int, default=512, help="size of the bandwidth reference array; 0 skips it"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="write machine facts and every measurement as JSON")
    p.add_argument(
        "--plot", metavar="FILE.png", help="draw GFLOP/s against length and threads (needs matplotlib)"
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the benchmark as the command line asks; the exit status (2: bad options, 130: interrupted)."""
    args = _build_parser().parse_args(argv)

    if args.list:
        extra = [q for q in QUICK_SHAPES if q not in SHAPES] + LATENCY_SHAPES
        for s in SHAPES + extra:
            tag = " (--quick)" if s in QUICK_SHAPES else " (--latency)" if s in LATENCY_SHAPES else ""
            flops = attention_flops(s, make_mask(s, np.dtype(np.float32), args.seed))  # masked: the kept pairs
            print(f"{s.name:16s} {s.describe():46s} {flops / 1e9:10.2f} GFLOP{tag}")
        return 0

    cache_mode = args.cache_dtypes is not None
    if args.plan:
        return _run_plan(args)
    if args.roofline:
        if args.latency or args.profile or args.impls or args.plot or args.paged or args.serving or \
                args.dtype != "float32" or args.kv_dtype is not None:
            print("error: --roofline is a mode of its own: no --latency, --profile, --paged, --serving, "
                  "--impls, --plot, --dtype or --kv-dtype (--cache-dtypes lists its caches)", file=sys.stderr)
            return 2
        args.min_time = _TIMING[0] if args.min_time is None else args.min_time
        args.repeat = _TIMING[1] if args.repeat is None else args.repeat
        try:
            specs = parse_cache_dtypes(args.cache_dtypes or ",".join(ROOFLINE_DTYPES))
            shapes = (CACHE_SHAPES[1:] if args.quick else
                      [parse_shape(x) for x in split_shapes(args.shapes)] if args.shapes else list(CACHE_SHAPES))
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return _run_roofline(args, shapes, specs)
    if args.backward:
        if args.latency or cache_mode or args.profile or args.impls or args.plot or args.shapes or args.paged \
                or args.serving or args.sparse:
            print("error: --backward is a mode of its own: no --latency, --cache-dtypes, --profile, --paged, "
                  "--serving, --sparse, --impls, --shapes or --plot", file=sys.stderr)
            return 2
        args.min_time = _TIMING[0] if args.min_time is None else args.min_time
        args.repeat = _TIMING[1] if args.repeat is None else args.repeat
        return _run_backward(args)
    if args.sparse:
        if args.latency or cache_mode or args.profile or args.impls or args.plot or args.shapes or args.paged \
                or args.serving:
            print("error: --sparse is a mode of its own: no --latency, --cache-dtypes, --profile, --paged, "
                  "--serving, --impls, --shapes or --plot", file=sys.stderr)
            return 2
        args.min_time = _TIMING[0] if args.min_time is None else args.min_time
        args.repeat = _TIMING[1] if args.repeat is None else args.repeat
        return _run_sparse(args)
    if args.serving:
        if args.latency or cache_mode or args.profile or args.impls or args.plot or args.shapes or args.paged:
            print("error: --serving is a mode of its own: no --latency, --cache-dtypes, --profile, --paged, "
                  "--impls, --shapes or --plot", file=sys.stderr)
            return 2
        args.min_time = _TIMING[0] if args.min_time is None else args.min_time
        args.repeat = _TIMING[1] if args.repeat is None else args.repeat
        return _run_serving(args)
    if args.paged:
        if args.latency or cache_mode or args.profile or args.impls or args.plot or args.shapes:
            print("error: --paged is a mode of its own: no --latency, --cache-dtypes, --profile, --impls, "
                  "--shapes or --plot", file=sys.stderr)
            return 2
        args.min_time = _TIMING[0] if args.min_time is None else args.min_time
        args.repeat = _TIMING[1] if args.repeat is None else args.repeat
        return _run_paged(args)
    known = LATENCY_IMPLEMENTATIONS if args.latency else IMPLEMENTATIONS
    min_time, repeat = _QUICK_LATENCY_TIMING if args.latency and args.quick else _TIMING
    args.min_time = min_time if args.min_time is None else args.min_time
    args.repeat = repeat if args.repeat is None else args.repeat
    try:
        if args.profile and (args.latency or cache_mode or args.plot):
            raise ValueError("--profile is a mode of its own: no --latency, --cache-dtypes or --plot")
        asked = [i.strip() for i in (args.impls or "").split(",") if i.strip()]
        if args.profile and any(not (i == "sdpa" or kernel_set_of(i) in _core.ISAS) for i in asked):
            raise ValueError("--profile times sdpa: --impls takes sdpa and sdpa@SET only")
        if cache_mode:
            if args.latency:
                raise ValueError("--cache-dtypes and --latency are separate modes: choose one")
            if args.impls or args.plot or args.dtype != "float32" or args.kv_dtype is not None:
                raise ValueError(
                    "--cache-dtypes times sdpa alone, with a float32 query: no --impls, --plot, "
                    "--dtype or --kv-dtype (the cache dtypes are its list)"
                )
            cache_specs = parse_cache_dtypes(args.cache_dtypes)
        if args.quick and cache_mode:
            shapes = CACHE_SHAPES[1:]
        elif args.quick and not args.latency:
            shapes = list(QUICK_SHAPES)
        elif args.shapes:
            shapes = [parse_shape(s) for s in split_shapes(args.shapes)]
        else:
            shapes = list(CACHE_SHAPES if cache_mode else LATENCY_SHAPES if args.latency else SHAPES)
        default_impls = "sdpa" if args.profile else ",".join(known)
        impls = [i.strip() for i in (args.impls or default_impls).split(",") if i.strip()]
        bad = [i for i in impls if not (i in known or (not args.latency and is_implementation(i)))]
        if bad or not impls:
            sets_hint = "" if args.latency else ", or sdpa@SET for a kernel set SET"
            raise ValueError(f"--impls: choose from {', '.join(known)}{sets_hint}")
        if args.repeat < 1 or args.min_time < 0:
            raise ValueError("--repeat must be >= 1 and --min-time >= 0")
        if args.latency and args.plot:
            raise ValueError("--plot draws the throughput suite, not --latency")
        if args.latency and (args.dtype not in ("float32", "float64") or args.kv_dtype not in (None, args.dtype)):
            raise ValueError("--latency runs float32 or float64, one dtype for q, k and v")
        if args.error_rows < 0:
            raise ValueError("--error-rows must be >= 0")
        if not args.latency and not cache_mode:
            args.kv_dtype = suite_dtypes(args.dtype, args.kv_dtype)[1].name
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    if args.latency:
        return _run_latency(args, shapes, impls)
    if args.profile:
        return _run_profile(args, shapes, impls)
    if cache_mode:
        return _run_cache(args, shapes, cache_specs)

    if args.plot:
        try:
            import matplotlib  # noqa: F401, PLC0415
        except ImportError:
            print("error: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
            return 2

    threads = args.threads or default_threads()
    if "OPENBLAS_CORETYPE" in os.environ and "numpy" in impls:
        print(
            "note: OPENBLAS_CORETYPE is set; NumPy's matmul (the numpy column and the gemm "
            "reference) may run a slower kernel than this CPU allows",
            file=sys.stderr,
        )

    show = sys.stderr.isatty() if args.progress is None else args.progress
    steps = reference_steps(threads, args.gemm_size, args.bandwidth_mib) + len(shapes) * len(threads) * len(
        impls
    )
    progress = Progress(steps, enabled=show)

    info = machine_info()
    info["onnxruntime"] = package_version("onnxruntime")
    info["openvino"] = package_version("openvino")
    rows: List[Dict[str, Any]] = []
    references: Dict[str, Any] = {}
    interrupted = False
    try:
        references = measure_references(
            threads,
            "float64" if args.dtype == "float64" else "float32",  # 16 bits: sdpa computes in float32
            gemm_n=args.gemm_size,
            bandwidth_mib=args.bandwidth_mib,
            min_time=args.min_time,
            repeat=args.repeat,
            progress=progress,
        )
        for row in iter_suite(
            shapes,
            threads,
            impls,
            args.dtype,
            kv_dtype=args.kv_dtype,
            min_time=args.min_time,
            repeat=args.repeat,
            references=references,
            error_rows=args.error_rows,
            seed=args.seed,
            progress=progress,
        ):
            rows.append(row)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        progress.close()

    versions = ""
    if "ort" in impls or "ort-mha" in impls:
        versions += f", onnxruntime {info['onnxruntime'] or 'not installed'}"
    if "openvino" in impls:
        versions += f", openvino {info['openvino'] or 'not installed'}"
    _print_header(info, _dtype_text(args.dtype, args.kv_dtype), versions)
    ref_text = format_references(references)
    if ref_text:
        print(ref_text)
    print()
    print(format_table(rows, args.dtype))
    for note in suite_notes(rows, args.error_rows):
        print(f"  {note}")
    if interrupted:
        print("(interrupted: partial results)")

    if args.json:
        payload = {
            "machine": info,
            "settings": {
                "shapes": [asdict(s) for s in shapes],
                "threads": threads,
                "impls": impls,
                "dtype": args.dtype,
                "kv_dtype": args.kv_dtype,
                "gemm_dtype": references.get("gemm", {}).get("dtype"),
                "error_rows": args.error_rows,
                "min_time": args.min_time,
                "repeat": args.repeat,
                "seed": args.seed,
                "numpy_max_score_bytes": NUMPY_MAX_SCORE_BYTES,
                "agreement_tolerance": {k: {"rtol": r, "atol": a} for k, (r, a) in AGREEMENT_TOLERANCE.items()},
                "kernels": dict(KERNELS),
                "complete": not interrupted,
            },
            "references": references,
            "results": rows,
        }
        write_json(args.json, payload)
    if args.plot:
        plot_results(rows, args.plot, references)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 130 if interrupted else 0


def _run_profile(args: argparse.Namespace, shapes: List[Shape], impls: List[str]) -> int:
    """``--profile``: the phase table, and JSON with --json."""
    threads = args.threads or default_threads()
    show = sys.stderr.isatty() if args.progress is None else args.progress
    progress = Progress(len(shapes) * len(threads) * len(impls), enabled=show)
    rows: List[Dict[str, Any]] = []
    interrupted = False
    try:
        for row in iter_profile(shapes, threads, impls, args.dtype, kv_dtype=args.kv_dtype,
                                repeat=args.repeat, seed=args.seed, progress=progress):
            rows.append(row)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        progress.close()
    info = machine_info()
    _print_header(info, _dtype_text(args.dtype, args.kv_dtype))
    print()
    print(format_profile_table(rows))
    for note in profile_notes():
        print(f"  {note}")
    if interrupted:
        print("(interrupted: partial results)")
    if args.json:
        write_json(args.json, {
            "machine": info,
            "settings": {"mode": "profile", "shapes": [asdict(s) for s in shapes], "threads": threads,
                         "impls": impls, "dtype": args.dtype, "kv_dtype": args.kv_dtype,
                         "repeat": args.repeat, "seed": args.seed, "complete": not interrupted},
            "results": rows,
        })
    return 130 if interrupted else 0


def _dtype_text(dtype: str, kv_dtype: Optional[str]) -> str:
    """The dtypes as the header line gives them, saying where the gemm reference differs."""
    if kv_dtype not in (None, dtype):
        return f"{dtype} query, {kv_dtype} k and v (sdpa computes in float32)"
    if dtype in HALF_DTYPES:
        return f"{dtype} (sdpa computes in float32; the gemm reference is float32)"
    return dtype


def _print_header(info: Dict[str, Any], dtype: str, extra: str = "") -> None:
    """The two lines above every table: sdpa's build, and the machine and versions."""
    cfg = info["sdpa_config"]
    print(
        f"sdpa {info['sdpa']} ({', '.join(f'{k}={v}' for k, v in cfg.items() if k != 'version')})"
        if isinstance(cfg, dict)
        else f"sdpa {info['sdpa']}"
    )
    blas = next((b for b in info["threadpools"] if b.get("user_api") == "blas"), None)
    blas_text = (
        f", BLAS {blas.get('internal_api')} {blas.get('version')} ({blas.get('architecture')})"
        if blas
        else ""
    )
    print(
        f"{info['cpu_model'] or info['machine']}, {info['cpu_count']} CPUs, numpy {info['numpy']}"
        f"{blas_text}, torch {info['torch'] or 'not installed'}{extra}, {dtype}"
    )


def _mode_cases(
    args: argparse.Namespace, known: Sequence[Any], available: Any, mode: str
) -> Optional[List[str]]:
    """The cases of a mode that run: those available, of ``--cases`` when
    given; None (after the error) for a name the mode does not have."""
    cases = [n for n, _ in known if available(n)]
    if args.cases:
        asked = _cases_asked(args)
        unknown = [c for c in asked if c not in dict(known)]
        if unknown:
            print(f"error: --cases: unknown {mode} case(s) {', '.join(unknown)}", file=sys.stderr)
            return None
        cases = [c for c in cases if c in asked]
    return cases


def _run_backward(args: argparse.Namespace) -> int:
    """``--backward``: the training table; the exit status."""
    threads = args.threads or default_threads()
    show = sys.stderr.isatty() if args.progress is None else args.progress
    cases = _mode_cases(args, BACKWARD_CASES, backward_case_available, "backward")
    if cases is None:
        return 2
    progress = Progress(len(cases) * len(threads), enabled=show)
    info = machine_info()
    rows: List[Dict[str, Any]] = []
    interrupted = False
    try:
        for row in iter_backward(threads, min_time=args.min_time, repeat=args.repeat, seed=args.seed,
                                 quick=args.quick, cases=cases, progress=progress):
            rows.append(row)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        progress.close()
    _print_header(info, "training: backward and dropout")
    print(format_backward_table(rows))
    print("  GFLOP/s: the causal products computed (backward 2.5x, a step 3.5x the forward's)")
    absent = [n for n, _ in BACKWARD_CASES if not backward_case_available(n)]
    if absent:
        print(f"  not run: {', '.join(absent)} (they need torch, or ml_dtypes for bfloat16)")
    if interrupted:
        print("(interrupted: partial results)")
    if args.json:
        payload = {"machine": info, "settings": {"mode": "backward", "threads": threads, "quick": args.quick,
                                                 "min_time": args.min_time, "repeat": args.repeat, "cases": cases},
                   "results": rows}
        write_json(args.json, payload)
    return 130 if interrupted else 0


def _run_sparse(args: argparse.Namespace) -> int:
    """``--sparse``: the machine's limits, then the sparse table; the exit status."""
    threads = args.threads or default_threads()
    show = sys.stderr.isatty() if args.progress is None else args.progress
    cases = _mode_cases(args, SPARSE_CASES, sparse_case_available, "sparse")
    if cases is None:
        return 2
    progress = Progress(len(threads) + len(cases) * len(threads), enabled=show)
    info = machine_info()
    rows: List[Dict[str, Any]] = []
    limits: Dict[int, Any] = {}
    interrupted = False
    try:
        limits = sparse_limits(threads, args.bandwidth_mib, progress)
        for row in iter_sparse(threads, min_time=args.min_time, repeat=args.repeat, seed=args.seed,
                               quick=args.quick, cases=cases, progress=progress, limits=limits):
            rows.append(row)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        progress.close()
    _print_header(info, "sparse attention")
    for line in limits_text(limits):
        print(line)
    print()
    print(format_sparse_table(rows))
    print("  against dense: dense time / sparse time (1.3x the dense time is 0.77x); the indexer: its roofline")
    print("  max(bytes / read bandwidth, 2 Hi Ei S / FMA peak) and that over the measured time")
    absent = [n for n, _ in SPARSE_CASES if not sparse_case_available(n)]
    if absent:
        print(f"  not run: {', '.join(absent)} (they need ml_dtypes: pip install ml_dtypes)")
    if interrupted:
        print("(interrupted: partial results)")
    if args.json:
        payload = {"machine": info, "settings": {"mode": "sparse", "threads": threads, "quick": args.quick,
                                                 "min_time": args.min_time, "repeat": args.repeat, "cases": cases},
                   "limits": limits, "results": rows}
        write_json(args.json, payload)
    return 130 if interrupted else 0


def _run_paged(args: argparse.Namespace) -> int:
    """``--paged``: the read-bandwidth reference, then the paged table; the exit status."""
    threads = args.threads or default_threads()
    show = sys.stderr.isatty() if args.progress is None else args.progress
    cases = [name for name, _ in PAGED_CASES if case_available(name)]
    progress = Progress(reference_steps(threads, 0, args.bandwidth_mib) + len(cases) * len(threads), enabled=show)
    info = machine_info()
    rows: List[Dict[str, Any]] = []
    references: Dict[str, Any] = {}
    interrupted = False
    try:
        references = measure_references(threads, "float32", gemm_n=0, bandwidth_mib=args.bandwidth_mib,
                                        min_time=args.min_time, repeat=args.repeat, progress=progress)
        for row in iter_paged(threads, min_time=args.min_time, repeat=args.repeat, seed=args.seed,
                              quick=args.quick, progress=progress):
            rows.append(row)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        progress.close()
    _print_header(info, "paged caches")
    ref_text = format_references(references)
    if ref_text:
        print(ref_text)
    print()
    bandwidth = {n: lookup(references.get("bandwidth", {}).get("results", []), n, "gbps") for n in threads}
    print(format_paged_table(rows, {n: b for n, b in bandwidth.items() if b}))
    print("  against: the other's time / paged time (above 1: paged is faster)")
    absent = [name for name, _ in PAGED_CASES if not case_available(name)]
    if absent:
        print(f"  not run: {', '.join(absent)} (bfloat16 needs ml_dtypes: pip install ml_dtypes)")
    if interrupted:
        print("(interrupted: partial results)")
    if args.json:
        payload = {"machine": info, "settings": {"mode": "paged", "threads": threads, "quick": args.quick,
                                                 "min_time": args.min_time, "repeat": args.repeat},
                   "references": references, "results": rows}
        write_json(args.json, payload)
    return 130 if interrupted else 0


def _cases_asked(args: argparse.Namespace) -> List[str]:
    return [c.strip() for c in (args.cases or "").split(",") if c.strip()]


def _run_plan(args: argparse.Namespace) -> int:
    """``--plan``: the balance table of the serving calls' plans; the exit status."""
    threads = args.threads or [16, 64, 128]
    try:
        rows = list(iter_plan(threads, _cases_asked(args)))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"sdpa {_core.version()}: the serving calls' work lists as planned for {', '.join(map(str, threads))} "
          "threads, each thread taking the next task of the list as it comes free (the planner's cost model)")
    print()
    print(format_plan_table(rows))
    print("  balance: the ideal time (the costs' sum over the threads) over the simulated makespan; "
          "largest task / ideal above 1 caps it")
    print("  vs separate calls: the same work as one call per sequence (varlen) or a decode call and one per chunk "
          "(mixed), simulated call after call, over the one call's makespan")
    shown = {r["case"] for r in rows}
    for name, what in PLAN_CASES:
        if name in shown:
            print(f"  {name}: {what}")
    if args.json:
        write_json(args.json, {"machine": machine_info(), "settings": {"mode": "plan", "threads": threads},
                               "results": rows})
    return 0


def _run_serving(args: argparse.Namespace) -> int:
    """``--serving``: the serving table; the exit status."""
    threads = args.threads or default_threads()
    show = sys.stderr.isatty() if args.progress is None else args.progress
    progress = Progress(serving_case_count(args.quick) * len(threads), enabled=show)
    info = machine_info()
    rows: List[Dict[str, Any]] = []
    interrupted = False
    try:
        for row in iter_serving(threads, min_time=args.min_time, repeat=args.repeat, seed=args.seed,
                                quick=args.quick, progress=progress, cases=_cases_asked(args)):
            rows.append(row)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        progress.close()
    _print_header(info, "serving calls")
    print()
    print(format_serving_table(rows))
    print("  against: the other way's time / sdpa's (above 1: sdpa's one call is faster); of dense: GFLOP/s over "
          "the dense call's in the same run")
    for name, what in SERVING_CASES:
        print(f"  {name}: {what}")
    print("  decode-SET-DTYPE-bsN: paged decoding (B 8, Hq32/8, E128) on kernel set SET vs the contiguous call")
    if interrupted:
        print("(interrupted: partial results)")
    if args.json:
        payload = {"machine": info, "settings": {"mode": "serving", "threads": threads, "quick": args.quick,
                                                 "min_time": args.min_time, "repeat": args.repeat},
                   "results": rows}
        write_json(args.json, payload)
    return 130 if interrupted else 0


def _run_roofline(args: argparse.Namespace, shapes: List[Shape], specs: List[str]) -> int:
    """``--roofline``: the machine's limits, then each decode step against them; the exit status."""
    threads = args.threads or default_threads()
    show = sys.stderr.isatty() if args.progress is None else args.progress
    progress = Progress(len(threads) * (1 + len(shapes)), enabled=show)
    info = machine_info()
    rows: List[Dict[str, Any]] = []
    limits: Dict[int, Dict[str, Any]] = {}
    interrupted = False
    try:
        limits = measure_limits(threads, bandwidth_mib=args.bandwidth_mib, repeat=args.repeat, progress=progress)
        for row in iter_roofline(shapes, threads, specs, min_time=args.min_time, repeat=args.repeat,
                                 error_rows=args.error_rows, seed=args.seed, progress=progress, limits=limits):
            rows.append(row)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        progress.close()
    _print_header(info, f"roofline: float32 query, {', '.join(specs)} caches")
    for line in limits_text(limits):
        print(line)
    print()
    print(format_roofline_table(rows))
    print("  GFLOP, GIOP: the float and the integer operations of a step (2 a multiply-add of Q K^T and P V);"
          " MiB: the bytes it reads (scales included)")
    print("  roofline ms: max(MiB / read bandwidth, GFLOP / FMA peak + GIOP / dot peak), bound: the larger;"
          " of roofline: that over the measured ms")
    print("  +iqk: integer_qk=True, +ipv: integer_pv=True; vs: the first cache's time over this one's")
    if interrupted:
        print("(interrupted: partial results)")
    if args.json:
        payload = {
            "machine": info,
            "settings": {"mode": "roofline", "shapes": [asdict(s) for s in shapes], "threads": threads,
                         "cache_dtypes": specs, "min_time": args.min_time, "repeat": args.repeat,
                         "bandwidth_mib": args.bandwidth_mib, "seed": args.seed, "complete": not interrupted},
            "limits": {str(n): lim for n, lim in limits.items()},
            "roofline": rows,
        }
        write_json(args.json, payload)
    return 130 if interrupted else 0


def _run_cache(args: argparse.Namespace, shapes: List[Shape], specs: List[str]) -> int:
    """``--cache-dtypes``: the read-bandwidth reference, then the cache table; the exit status."""
    threads = args.threads or default_threads()
    show = sys.stderr.isatty() if args.progress is None else args.progress
    steps = reference_steps(threads, 0, args.bandwidth_mib) + len(shapes) * len(threads)
    progress = Progress(steps, enabled=show)

    info = machine_info()
    rows: List[Dict[str, Any]] = []
    references: Dict[str, Any] = {}
    interrupted = False
    try:
        references = measure_references(
            threads,
            "float32",
            gemm_n=0,  # the step reads; it multiplies too little for a gemm to say anything
            bandwidth_mib=args.bandwidth_mib,
            min_time=args.min_time,
            repeat=args.repeat,
            progress=progress,
        )
        for row in iter_cache(
            shapes,
            threads,
            specs,
            min_time=args.min_time,
            repeat=args.repeat,
            references=references,
            error_rows=args.error_rows,
            seed=args.seed,
            progress=progress,
        ):
            rows.append(row)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        progress.close()

    _print_header(info, f"float32 query, {', '.join(specs)} caches")
    ref_text = format_references(references)
    if ref_text:
        print(ref_text)
    print()
    print(format_cache_table(rows))
    for note in cache_notes(rows, args.error_rows):
        print(f"  {note}")
    if interrupted:
        print("(interrupted: partial results)")

    if args.json:
        payload = {
            "machine": info,
            "settings": {
                "mode": "cache",
                "shapes": [asdict(s) for s in shapes],
                "threads": threads,
                "cache_dtypes": specs,
                "dtype": "float32",
                "error_rows": args.error_rows,
                "min_time": args.min_time,
                "repeat": args.repeat,
                "seed": args.seed,
                "complete": not interrupted,
            },
            "references": references,
            "cache": rows,
        }
        write_json(args.json, payload)
    return 130 if interrupted else 0


def _run_latency(args: argparse.Namespace, shapes: List[Shape], impls: List[str]) -> int:
    """``--latency``: the latency table, then generate() of the tiny Llama; the exit status."""
    threads = args.threads or list(LATENCY_THREADS)
    show = sys.stderr.isatty() if args.progress is None else args.progress
    steps = len(shapes) * len(threads) * len(impls) + (len(threads) if args.generate else 0)
    progress = Progress(steps, enabled=show)

    info = machine_info()
    info["onnxruntime"] = package_version("onnxruntime")
    info["transformers"] = package_version("transformers")
    rows: List[Dict[str, Any]] = []
    generated: List[Dict[str, Any]] = []
    interrupted = False
    try:
        for row in iter_latency(
            shapes,
            threads,
            impls,
            args.dtype,
            min_time=args.min_time,
            repeat=args.repeat,
            seed=args.seed,
            progress=progress,
        ):
            rows.append(row)
        for n in threads if args.generate else []:
            progress.show(f"generate() of a tiny Llama, {threads_text(n)}")
            generated.append(measure_generate(n, min_time=args.min_time, repeat=args.repeat, seed=args.seed))
            progress.advance()
    except KeyboardInterrupt:
        interrupted = True
    finally:
        progress.close()

    _print_header(
        info,
        args.dtype,
        f", onnxruntime {info['onnxruntime'] or 'not installed'}"
        f", transformers {info['transformers'] or 'not installed'}",
    )
    print()
    print(format_latency_table(rows))
    print("  µs per call: median of timed loops of back-to-back calls; ratios of times (below 1.00x: faster)")
    for note in describe_latency_skips(rows):
        print(f"  {note}")
    for result in generated:
        print()
        print(format_generate(result))
    if interrupted:
        print("(interrupted: partial results)")

    if args.json:
        payload = {
            "machine": info,
            "settings": {
                "mode": "latency",
                "shapes": [asdict(s) for s in shapes],
                "threads": threads,
                "impls": impls,
                "dtype": args.dtype,
                "min_time": args.min_time,
                "repeat": args.repeat,
                "seed": args.seed,
                "generate": args.generate,
                "complete": not interrupted,
            },
            "latency": rows,
            "generate": generated,
        }
        write_json(args.json, payload)
    return 130 if interrupted else 0
