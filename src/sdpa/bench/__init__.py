"""Side-by-side attention benchmark: sdpa against NumPy, PyTorch, ONNX Runtime and
OpenVINO on this machine.

    python -m sdpa.bench                      # the whole suite, 1 and all threads
    python -m sdpa.bench --quick              # a few small shapes (CI smoke run)
    python -m sdpa.bench --shapes 1k,gqa-2k --threads 1,2 --json out.json --plot out.png
    python -m sdpa.bench --dtype bfloat16     # bfloat16 (or float16) q, k, v; torch in the same dtype
    python -m sdpa.bench --dtype float32 --kv-dtype bfloat16   # a float32 query, a bfloat16 cache
    python -m sdpa.bench --shapes mask-dense-bool,mask-padding --impls sdpa,torch,ort-mha
    python -m sdpa.bench --latency            # microseconds per call on small problems
    python -m sdpa.bench --cache-dtypes       # a decode step over float, int8, float8 and int4 caches

Every implementation runs in the same process on the same inputs (and the same mask,
on the masked shapes), and the results are reported as throughput next to ratios
measured in the same run: sdpa against PyTorch, and against the machine's own matmul
throughput (a NumPy gemm) and read bandwidth (a NumPy reduction over a large array).
Each output is compared with sdpa's once per shape (one that disagrees is reported,
not timed) and with a float64 reference on the same input values (a sample of query
rows on large problems): the ``err`` columns.  See benchmarks/README.md for what each
column means.

``--latency`` instead times small problems (decode steps, a short prefill) in
microseconds per call: sdpa on NumPy arrays, ``sdpa.torch`` on tensors, torch's
own function and ONNX Runtime's Attention operator, then the greedy ``generate()``
of a tiny random-weight Llama (transformers) with and without ``sdpa.torch.patch()``.

``--cache-dtypes`` times a decoding step of a float32 query over a :class:`sdpa.KVCache`
of each dtype (float32, bfloat16, float16, and the quantized int8, float8_e4m3fn,
float8_e5m2 and int4, the last two also with ``integer_qk``) holding the same keys and
values, in alternating rounds: milliseconds, GB/s of the bytes the cache holds (scales
included) and the speed against the float32 cache.

Only the standard library and NumPy are needed; PyTorch, ONNX Runtime, OpenVINO,
transformers, threadpoolctl and matplotlib are used when they are installed.

The modules, by concern: :mod:`~sdpa.bench.shapes` (the problems, their work
counts, dtypes and inputs), :mod:`~sdpa.bench.timing` (the timer and the progress
bar), :mod:`~sdpa.bench.threads` (thread counts and limits),
:mod:`~sdpa.bench.machine` (machine facts and reference measurements),
:mod:`~sdpa.bench.peers` (the implementations), :mod:`~sdpa.bench.errors` (the
float64 reference and the errors), :mod:`~sdpa.bench.onnxgraph` (the ONNX models ONNX
Runtime runs), :mod:`~sdpa.bench.suite` (the throughput suite),
:mod:`~sdpa.bench.latency` (the latency mode), :mod:`~sdpa.bench.cache` (the cache
mode), :mod:`~sdpa.bench.profile` (the phase profile of the tiled path), :mod:`~sdpa.bench.generate` (the
Llama ``generate()``), :mod:`~sdpa.bench.report` (tables and JSON),
:mod:`~sdpa.bench.plot` (the figure) and :mod:`~sdpa.bench.cli` (the command line).
"""

from __future__ import annotations

from .cache import CACHE_DTYPES, cache_bytes, iter_cache, parse_cache_dtypes, run_cache, split_spec
from .cli import main
from .errors import ERROR_ROWS, ReferenceSample, max_abs_error, reference_sample, sample_rows
from .generate import measure_generate
from .latency import LATENCY_THREADS, iter_latency, run_latency
from .machine import machine_info, measure_references
from .peers import (
    AGREEMENT_TOLERANCE,
    FLOAT32_PEERS,
    IMPLEMENTATIONS,
    KERNELS,
    LATENCY_IMPLEMENTATIONS,
    NUMPY_MAX_SCORE_BYTES,
    agreement,
    numpy_attention,
)
from .plot import plot_results
from .profile import PHASES, format_profile_table, iter_profile
from .report import (
    cache_notes,
    describe_kernels,
    format_cache_table,
    format_generate,
    format_latency_table,
    format_references,
    format_table,
    suite_notes,
)
from .roofline import ROOFLINE_DTYPES, format_roofline_table, iter_roofline, measure_limits, step_operations
from .shapes import (
    CACHE_SHAPES,
    DTYPES,
    HALF_DTYPES,
    LATENCY_SHAPES,
    MASK_DENSITY,
    MASKS,
    PADDING_MIN_FRACTION,
    QUICK_SHAPES,
    SHAPES,
    GiB,
    MiB,
    Shape,
    ShapeLike,
    attention_flops,
    bench_dtype,
    causal_pairs,
    kept_pairs,
    kv_bytes,
    make_inputs,
    make_mask,
    parse_shape,
    score_bytes,
)
from .suite import iter_suite, run_suite, suite_dtypes
from .threads import default_threads
from .timing import Progress, alternating_loop_times, loop_times, median_time, time_call

__all__ = [
    "PHASES",
    "format_profile_table",
    "iter_profile",
    "Shape",
    "SHAPES",
    "QUICK_SHAPES",
    "IMPLEMENTATIONS",
    "attention_flops",
    "causal_pairs",
    "kv_bytes",
    "numpy_attention",
    "machine_info",
    "measure_references",
    "run_suite",
    "format_table",
    "plot_results",
    "main",
    "GiB",
    "MiB",
    "NUMPY_MAX_SCORE_BYTES",
    "ShapeLike",
    "parse_shape",
    "score_bytes",
    "time_call",
    "median_time",
    "Progress",
    "iter_suite",
    "default_threads",
    "format_references",
    "LATENCY_SHAPES",
    "LATENCY_IMPLEMENTATIONS",
    "LATENCY_THREADS",
    "loop_times",
    "iter_latency",
    "run_latency",
    "format_latency_table",
    "measure_generate",
    "format_generate",
    "DTYPES",
    "HALF_DTYPES",
    "bench_dtype",
    "make_inputs",
    "suite_dtypes",
    "ERROR_ROWS",
    "ReferenceSample",
    "sample_rows",
    "reference_sample",
    "max_abs_error",
    "FLOAT32_PEERS",
    "KERNELS",
    "AGREEMENT_TOLERANCE",
    "agreement",
    "MASKS",
    "MASK_DENSITY",
    "PADDING_MIN_FRACTION",
    "make_mask",
    "kept_pairs",
    "describe_kernels",
    "suite_notes",
    "CACHE_DTYPES",
    "ROOFLINE_DTYPES",
    "format_roofline_table",
    "iter_roofline",
    "measure_limits",
    "step_operations",
    "split_spec",
    "CACHE_SHAPES",
    "parse_cache_dtypes",
    "cache_bytes",
    "iter_cache",
    "run_cache",
    "format_cache_table",
    "cache_notes",
    "alternating_loop_times",
]
