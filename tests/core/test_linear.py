"""pagedkv._core.Linear against numpy: every weight dtype on every kernel this CPU runs, odd
shapes, any input layout, typed errors.

The reference is float64 over the weight rounded to the storage dtype the way the kernel rounds
it (to nearest even), so a stored dtype adds no error of its own to the comparison; what is left
is float32 summation over ``K`` terms, bounded by ``K · 2⁻²⁴ · Σ|xᵢ wᵢ|`` per output."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pagedkv import InvalidArgumentError, ShapeError
from pagedkv._core import Linear, available_linear_kernels
from pagedkv.loaders.checkpoint import _encode, _widen

DTYPES = ["float32", "float16", "bfloat16"]
KERNELS = available_linear_kernels()
SHAPES = [
    (1, 1, 1),
    (1, 13, 17),
    (2, 7, 33),
    (5, 19, 31),
    (6, 64, 16),
    (7, 100, 129),
    (16, 576, 47),
    (33, 3, 15),
    (1, 37, 200),
    (2, 50, 100),
]


def stored(weight: np.ndarray, dtype: str) -> np.ndarray:
    """``weight`` as ``dtype`` stores it (the checkpoint writer's rounding), back in float64."""
    disk = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}[dtype]
    return _widen(_encode(weight, dtype), disk).astype(np.float64)


def check(got: np.ndarray, x: np.ndarray, weight: np.ndarray, dtype: str) -> None:
    w = stored(weight, dtype)
    want = x.astype(np.float64) @ w
    bound = x.shape[1] * 2.0**-24 * (np.abs(x.astype(np.float64)) @ np.abs(w)) + 1e-30
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) / bound)


def test_the_machine_runs_the_portable_kernel_and_avx2_where_it_exists() -> None:
    assert KERNELS[-1] == "portable" and set(KERNELS) <= {"avx512", "avx2", "portable"}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_numpy_on_odd_shapes(kernel: str, dtype: str) -> None:
    rng = np.random.default_rng(1)
    for m, k, n in SHAPES:
        x = rng.standard_normal((m, k), dtype=np.float32)
        weight = rng.standard_normal((k, n), dtype=np.float32)
        linear = Linear(weight, dtype)
        assert (linear.in_features, linear.out_features, linear.dtype) == (k, n, dtype)
        assert linear.nbytes == k * -(-n // 16) * 16 * np.dtype(np.float32 if dtype == "float32" else np.float16).itemsize
        check(linear(x, kernel=kernel), x, weight, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_kernel_of_a_weight_matches_numpy_and_the_default_is_one_of_them(dtype: str) -> None:
    """A weight's own list: bf16 weights add ``avx512bf16`` where the CPU has it, whose prompts
    (16 rows or more) multiply bf16-rounded activations; fewer rows run the f32 tiles."""
    rng = np.random.default_rng(2)
    weight = rng.standard_normal((300, 70), dtype=np.float32)
    linear = Linear(weight, dtype)
    assert linear.kernels[-1] == "portable" and set(linear.kernels) - {"avx512bf16"} == set(KERNELS)
    assert "avx512bf16" not in linear.kernels or dtype == "bfloat16"
    for m in (5, 20):
        x = rng.standard_normal((m, 300), dtype=np.float32)
        for kernel in linear.kernels:
            paired = kernel == "avx512bf16" and m >= 16
            check(linear(x, kernel=kernel), stored(x, "bfloat16").astype(np.float32) if paired else x, weight, dtype)
        assert any(np.array_equal(linear(x), linear(x, kernel=kernel)) for kernel in linear.kernels)


def test_any_layout_is_read_in_c_order() -> None:
    rng = np.random.default_rng(3)
    weight = rng.standard_normal((40, 35), dtype=np.float32)
    x = rng.standard_normal((9, 40), dtype=np.float32)
    want = Linear(weight)(x)
    # A Fortran-ordered weight (the .T of an [out, in] matrix) and x; strided views of both.
    assert not np.asfortranarray(x).flags.c_contiguous
    for w in (np.asfortranarray(weight), np.ascontiguousarray(weight.T).T):
        np.testing.assert_array_equal(Linear(w)(x), want)
        np.testing.assert_array_equal(Linear(w)(np.asfortranarray(x)), want)
    wide = rng.standard_normal((80, 70), dtype=np.float32)
    wide[::2, ::2] = weight
    xs = np.zeros((18, 80), dtype=np.float32)
    xs[::2, ::2] = x
    np.testing.assert_array_equal(Linear(wide[::2, ::2])(xs[::2, ::2]), want)


def test_no_rows_give_an_empty_result() -> None:
    linear = Linear(np.ones((4, 3), dtype=np.float32), "bfloat16")
    assert linear(np.zeros((0, 4), dtype=np.float32)).shape == (0, 3)


@pytest.mark.parametrize(
    ("weight", "dtype", "error"),
    [
        (np.ones((4, 3)), "float32", ShapeError),  # float64
        (np.ones(4, dtype=np.float32), "float32", ShapeError),
        (np.ones((2, 2, 2), dtype=np.float32), "float32", ShapeError),
        (np.ones((0, 3), dtype=np.float32), "float32", ShapeError),
        (np.ones((4, 3), dtype=np.float32), "int8", InvalidArgumentError),
        ([[1.0, 2.0]], "float32", ShapeError),
    ],
)
def test_bad_weights_are_typed(weight: object, dtype: str, error: type[Exception]) -> None:
    with pytest.raises(error):
        Linear(weight, dtype)  # type: ignore[arg-type]


def test_bad_inputs_and_kernels_are_typed() -> None:
    linear = Linear(np.ones((4, 3), dtype=np.float32))
    for x in (np.ones((2, 5), dtype=np.float32), np.ones(4, dtype=np.float32), np.ones((2, 4)), "x"):
        with pytest.raises(ShapeError):
            linear(x)  # type: ignore[arg-type]
    x = np.ones((2, 4), dtype=np.float32)
    with pytest.raises(InvalidArgumentError, match="unknown instruction set"):
        linear(x, kernel="sse")
    for kernel in {"avx512", "avx2"} - set(KERNELS):
        with pytest.raises(InvalidArgumentError, match="needs CPU features this machine lacks"):
            linear(x, kernel=kernel)
    np.testing.assert_array_equal(linear(x), np.full((2, 3), 4.0, dtype=np.float32))


def test_bench_reports_fractions_of_the_limits_measured_in_the_same_run(capsys: pytest.CaptureFixture[str]) -> None:
    from lab.__main__ import main

    argv = ["bench", "linear", "--json", "--rows", "1,7", "--dtypes", "bfloat16", "--samples", "1"]
    assert main([*argv, "--projections", "o,down", "--weight-mib", "1", "--probe-mib", "8", "--no-step"]) == 0
    report = json.loads(capsys.readouterr().out)
    cases = report["cases"]
    assert {(c["projection"], c["m"]) for c in cases} == {(p, m) for p in ("o", "down") for m in (1, 7)}
    for case in cases:
        assert case["dtype"] == "bfloat16" and case["fma_peak_gflops"] > 0 and case["bandwidth_gbps"] > 0
        assert case["fraction_of_fma_peak"] == pytest.approx(case["gflops"] / case["fma_peak_gflops"])
        assert case["fraction_of_bandwidth"] == pytest.approx(case["weight_gbps"] / case["bandwidth_gbps"])
        assert case["speedup_vs_numpy"] == pytest.approx(case["numpy_seconds_median"] / case["seconds_median"])
    assert len(report["load_average_before"]) == 3


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--rows", "0"),
        ("--rows", "1,,2"),
        ("--dtypes", "int8"),
        ("--samples", "0"),
        ("--weight-mib", "-1"),
        ("--projections", "qk"),
    ],
)
def test_bench_flags_are_usage_errors(flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    from lab.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "linear", flag, value])
    assert exit_info.value.code == 2 and flag in capsys.readouterr().err
