"""ampdoctor.stats against a float64 reference, on tensors with zeros, subnormals, huge values, infs and NaNs."""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import sys
from unittest import mock
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from ampdoctor.float_formats import BFLOAT16, FLOAT16, FLOAT32, float_format
from ampdoctor.stats import ALGORITHMS, FULL_ALGORITHMS, HostStats, SlotLayouts, full_stats, light_stats, tensor_peaks
from ampdoctor.stats import full as full_module, light as light_module
from ampdoctor.stats.full_results import SLOT_STRIDE

MIN_EXP, BINS = -56, 64
# The full statistics' algorithms; triton's kernels run on CPU tensors under Triton's interpreter
# (tests/conftest.py sets TRITON_INTERPRET=1 where there is no GPU).
TRITON_ON_CPU = importlib.util.find_spec("triton") is not None and os.environ.get("TRITON_INTERPRET") == "1"
FULL = [pytest.param(a, marks=pytest.mark.skipif(a == "triton" and not TRITON_ON_CPU,
                                                 reason="Triton's interpreter is not available"))
        for a in FULL_ALGORITHMS]
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def reference(x: torch.Tensor, scale: float, amp_format) -> dict:
    """float64 statistics of the scaled tensor ``x``. The unscaled value of an element is the one
    torch's unscale_ produces (fp32 product with the fp32 reciprocal of the scale)."""
    scaled = x.double().abs().numpy().ravel()
    inv = np.float32(1.0 / scale)
    with np.errstate(over="ignore"):  # a scale below 1 can overflow a finite value, as in torch
        unscaled = (x.float().abs().numpy().ravel() * inv).astype(np.float64)
    # A finite value that a scale below 1 overflows on the unscale reaches the optimizer as inf.
    finite = np.isfinite(unscaled)
    nonzero = finite & (unscaled > 0)
    hist = np.zeros(BINS, dtype=np.int64)
    for v in unscaled[finite & (scaled > 0)]:  # nonzero as backward produced it
        binade = MIN_EXP if v == 0 else math.floor(math.log2(v))  # 0: flushed to zero by the unscale
        hist[min(max(binade - MIN_EXP, 0), BINS - 1)] += 1
    return {
        "amax": unscaled[finite].max(initial=0.0),
        "amin": unscaled[nonzero].min() if nonzero.any() else math.nan,
        "l2": math.sqrt(float(np.sum(unscaled[finite] ** 2))),
        "n_zero": int(np.sum(scaled == 0)),
        "n_subnormal": int(np.sum((scaled > 0) & (scaled < amp_format.smallest_normal))),
        "n_nan": int(np.sum(np.isnan(scaled))),
        "n_inf": int(np.sum(np.isinf(unscaled))),
        "hist": hist,
    }


def special_floats(dtype_name: str):
    fmt = float_format(dtype_name)
    return st.one_of(
        st.floats(allow_nan=False, allow_infinity=False, width=32),
        st.sampled_from([0.0, -0.0, math.inf, -math.inf, math.nan, fmt.max, -fmt.max,
                         fmt.smallest_subnormal, fmt.smallest_normal, fmt.smallest_normal / 3]),
        st.floats(min_value=fmt.smallest_subnormal, max_value=fmt.smallest_normal * 4),
    )


@st.composite
def scaled_tensors(draw):
    dtype_name = draw(st.sampled_from(sorted(DTYPES)))
    sizes = draw(st.lists(st.integers(1, 40), min_size=1, max_size=4))
    tensors = [torch.tensor(draw(st.lists(special_floats(dtype_name), min_size=n, max_size=n)),
                            dtype=torch.float64).to(DTYPES[dtype_name]) for n in sizes]
    scale = 2.0 ** draw(st.integers(-4, 24))
    amp = draw(st.sampled_from([FLOAT16, BFLOAT16, FLOAT32]))
    return tensors, scale, amp


@np.errstate(over="ignore")  # huge finite values overflow float32 on the way, as in training
def _check(got: HostStats, i: int, ref: dict) -> None:
    assert got.n_zero[i] == ref["n_zero"]
    assert got.n_subnormal[i] == ref["n_subnormal"]
    assert got.n_nan[i] == ref["n_nan"]
    assert got.n_inf[i] == ref["n_inf"]
    np.testing.assert_array_equal(got.hist[i], ref["hist"])
    assert got.amax[i] == np.float32(ref["amax"])  # max/min are exact
    if math.isnan(ref["amin"]):
        assert math.isnan(got.amin[i])
    else:
        assert got.amin[i] == np.float32(ref["amin"])
    if math.isinf(ref["l2"]):
        assert math.isinf(got.l2[i])
    else:
        # float32 partial sums (brought near 1 by a power of two): a few ulp over 40 elements
        assert got.l2[i] == pytest.approx(np.float32(ref["l2"]), rel=1e-5, abs=1e-45)


@pytest.mark.parametrize("algorithm", FULL)
@settings(max_examples=150, deadline=None)
@given(scaled_tensors())
def test_per_tensor_stats_match_float64_reference(algorithm, case):
    tensors, scale, amp = case
    inv = torch.tensor(scale, dtype=torch.float32).double().reciprocal().float()
    got = full_stats(tensors, inv_scale=inv, subnormal_below=amp.smallest_normal,
                     hist_min_exp=MIN_EXP, hist_bins=BINS, algorithm=algorithm).decode()
    for i, t in enumerate(tensors):
        _check(got, i, reference(t, scale, amp))


@pytest.mark.parametrize("algorithm", FULL)
@settings(max_examples=60, deadline=None)
@given(scaled_tensors())
def test_whole_model_stats_are_the_total_of_per_tensor_stats(algorithm, case):
    tensors, scale, amp = case
    inv = torch.tensor(1.0 / scale)
    kw = dict(inv_scale=inv, subnormal_below=amp.smallest_normal, hist_min_exp=MIN_EXP, hist_bins=BINS,
              algorithm=algorithm)
    per = full_stats(tensors, **kw).decode().total()
    whole = full_stats(tensors, per_tensor=False, **kw).decode()
    _check(whole, 0, reference(torch.cat([t.reshape(-1) for t in tensors]), scale, amp))
    for field in ("n_zero", "n_subnormal", "n_nan", "n_inf", "amax"):
        assert getattr(per, field)[0] == getattr(whole, field)[0]
    np.testing.assert_array_equal(per.hist, whole.hist)


@pytest.mark.parametrize("algorithm", FULL)
def test_chunking_splits_large_tensors_without_changing_results(monkeypatch, algorithm):
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(37, generator=gen) * 1e-3, torch.randn(5, 7, generator=gen), torch.zeros(0),
               torch.tensor([0.0, math.inf, math.nan, 1e-30])]
    kw = dict(inv_scale=torch.tensor(1.0 / 1024), subnormal_below=FLOAT16.smallest_normal, algorithm=algorithm)
    expected = full_stats(tensors, **kw).decode()
    # tensors span chunks, chunks mix slots
    if algorithm == "triton":  # blocks of 2 x 4 and tiles of about 8 elements: tensors span several, a slot's are added in steps
        from ampdoctor.stats import full_triton
        monkeypatch.setattr(full_triton, "RB", 2)
        monkeypatch.setattr(full_triton, "CB", 4)
        monkeypatch.setattr(full_triton, "MIN_TILE", 8)
        monkeypatch.setattr(full_triton, "_SLOT_ROWS", 2)
        monkeypatch.setattr(full_triton, "_plan", full_triton._Plan)  # uncached: plans of these tiles stay here
    else:
        monkeypatch.setattr(full_module, "CHUNK_ELEMENTS" if algorithm == "accelerator" else "CPU_CHUNK_ELEMENTS", 6)
    got = full_stats(tensors, layouts=SlotLayouts(), **kw).decode()
    for field in HostStats.__dataclass_fields__:
        np.testing.assert_array_equal(getattr(got, field), getattr(expected, field))


def test_non_power_of_two_scale():
    x = torch.tensor([3.0, -1000.0, 1e-3, 0.0], dtype=torch.float16)
    got = full_stats([x], inv_scale=torch.tensor(1 / 1000.0), subnormal_below=FLOAT16.smallest_normal).decode()
    ref = reference(x, 1000.0, FLOAT16)
    assert got.amax[0] == pytest.approx(ref["amax"], rel=1e-6)
    assert got.l2[0] == pytest.approx(ref["l2"], rel=1e-6)
    assert got.n_zero[0] == 1


def test_unscaled_statistics_without_a_scale():
    x = torch.tensor([2.0**-30, 4.0, -0.5])
    got = full_stats([x], inv_scale=None, subnormal_below=BFLOAT16.smallest_normal).decode()
    assert got.amax[0] == 4.0 and got.amin[0] == 2.0**-30
    assert got.hist[0, -30 - MIN_EXP] == 1 and got.hist[0, 2 - MIN_EXP] == 1 and got.hist[0, -1 - MIN_EXP] == 1
    assert got.n_subnormal[0] == 0


def test_empty_input_is_rejected():
    with pytest.raises(ValueError):
        full_stats([], inv_scale=None, subnormal_below=1.0)


# The host algorithm's paths: small tensors grouped (also over several groups), large ones alone.
LIGHT_VARIANTS = {"host": {}, "host-groups-of-16": {"HOST_GROUP_ELEMENTS": 16},
                  "host-all-large": {"HOST_SMALL_BELOW": 1}, "accelerator": {}}


@pytest.mark.parametrize("variant", sorted(LIGHT_VARIANTS))
@settings(max_examples=100, deadline=None)
@given(scaled_tensors())
def test_light_stats_are_the_peak_and_norm(variant, case):
    """Peak magnitude (NaN if a NaN is held, else inf if an inf) and L2 norm, unscaled."""
    tensors, scale, _ = case
    algorithm = variant.split("-")[0]
    inv = torch.tensor(scale, dtype=torch.float32).double().reciprocal().float()
    patch = LIGHT_VARIANTS[variant]
    with mock.patch.multiple(light_module, **patch) if patch else contextlib.nullcontext():
        got = light_stats(tensors, inv_scale=inv, algorithm=algorithm).decode()
    assert got.light and got.hist.shape == (len(tensors), 0)
    for i, t in enumerate(tensors):
        values = t.double().abs().numpy().ravel()
        if np.isnan(values).any():
            assert math.isnan(got.amax[i]) and math.isnan(got.l2[i])
            continue
        with np.errstate(over="ignore"):
            peak = np.float32(np.float32(values.max()) * np.float32(inv))
            norm = math.sqrt(float(np.sum(values ** 2))) * float(inv)
        assert got.amax[i] == peak
        if math.isinf(norm) or np.isinf(values).any():
            assert math.isinf(got.l2[i])
        elif norm / float(inv) > 3.4e38:  # the scaled norm is beyond float32 (it is unscaled after)
            assert math.isinf(got.l2[i]) or got.l2[i] == pytest.approx(norm, rel=1e-5)
        elif algorithm == "host":  # exact to float32 rounding, also where squares under- or overflow float32
            assert got.l2[i] == pytest.approx(norm, rel=1e-5, abs=1e-44)
        elif values.max() > 1.8e19:  # accelerator: float32 squares, as documented
            assert math.isinf(got.l2[i]) or got.l2[i] == pytest.approx(norm, rel=1e-5)
        else:  # squares below ~1e-45 vanish (documented); the rest counts
            low = math.sqrt(float(np.sum(values[values >= 1e-22] ** 2))) * float(inv)
            assert low * (1 - 1e-5) - 1e-44 <= got.l2[i] <= norm * (1 + 1e-5) + 1e-44


def test_light_total_keeps_a_lower_bound_of_the_norm():
    """A step row of light statistics: the peak is non-finite when a tensor was, and the norm is
    that of the finite tensors."""
    tensors = [torch.tensor([3.0, -4.0]), torch.tensor([1.0, math.inf]), torch.tensor([0.0, 12.0])]
    total = light_stats(tensors, inv_scale=None).decode().total()
    assert math.isinf(total.amax[0]) and total.l2[0] == pytest.approx(13.0)
    tensors[1] = torch.tensor([math.nan, 1.0])
    assert math.isnan(light_stats(tensors, inv_scale=None).decode().total().amax[0])


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_tensor_peaks_see_nan_and_inf(dtype, algorithm):
    large = torch.full((light_module.HOST_SMALL_BELOW,), -3.0, dtype=dtype)  # reduced on its own by "host"
    large[7] = math.nan
    tensors = [torch.tensor([1.0, -2.0, 0.5], dtype=dtype), torch.tensor([1.0, math.nan, -math.inf], dtype=dtype),
               torch.tensor([-math.inf, 7.0], dtype=dtype), torch.zeros(0, dtype=dtype), large, large.abs().nan_to_num()]
    got = tensor_peaks(tensors, algorithm=algorithm)
    assert got.dtype == torch.float32 and got[0] == 2.0 and torch.isnan(got[1]) and torch.isinf(got[2])
    assert got[3] == 0 and torch.isnan(got[4]) and got[5] == 3.0


@pytest.mark.parametrize("algorithm", FULL)
@pytest.mark.parametrize("magnitude", [1e-42, 1e-30, 1.0, 1e25, 1e36])
def test_full_norm_has_no_float32_overflow_or_underflow(magnitude, algorithm):
    """The full statistics' sum of squares is float32 partial sums rescaled by a power of two
    (host) or float64 sums (accelerator): neither squares beyond float32 (1e25**2) nor subnormal
    squares (1e-30**2) are lost."""
    values = torch.tensor([magnitude, -magnitude / 2, magnitude / 4, 0.0] * 3000, dtype=torch.float32)
    got = full_stats([values], inv_scale=None, subnormal_below=FLOAT16.smallest_normal,
                     algorithm=algorithm).decode()
    expected = np.linalg.norm(values.double().numpy())
    assert got.l2[0] == pytest.approx(np.float32(expected), rel=2e-5)  # float32 partial sums


@pytest.mark.parametrize("pairs", [500, 5000])  # 1000 elements: grouped; 10000: alone
@pytest.mark.parametrize("magnitude", [1e-42, 7.7e-31, 1e-20, 1e-16, 1.0, 1e16, 1e25])
def test_light_norm_of_tiny_and_huge_gradients(magnitude, pairs):
    """The CPU light norm is right where float32 squares underflow or overflow (torch's own norm,
    and a plain dot product, gave 0 for 7.7e-31: found by hypothesis in a fresh environment)."""
    values = torch.tensor([magnitude, -magnitude / 3] * pairs, dtype=torch.float32)
    got = light_stats([values, values[:1].clone()], inv_scale=None).decode()
    for i, t in enumerate([values, values[:1]]):
        expected = np.linalg.norm(t.double().numpy())
        assert got.l2[i] == pytest.approx(np.float32(expected), rel=1e-5)
        assert got.amax[i] == np.float32(magnitude)


# -- the accelerator algorithm on the CPU and on fake CUDA tensors ---------------------------------
sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
from host_cost import OpCounter  # noqa: E402
from test_device_paths import FORBIDDEN  # noqa: E402



def _small_tensors(n, gen, dtype=torch.float16):
    return [(torch.randn(3, 5, generator=gen) * 1e-3).to(dtype) for _ in range(n)]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_light_stats_dispatch_the_same_ops_for_10_or_200_tensors(algorithm):
    gen = torch.Generator().manual_seed(0)
    counts = []
    for n in (10, 200):
        tensors = _small_tensors(n, gen)
        with OpCounter() as counter:
            light_stats(tensors, inv_scale=torch.tensor(2.0**-10), algorithm=algorithm)
        counts.append(counter.total)
    assert counts[0] == counts[1] and counts[0] <= 24, counts


@pytest.mark.parametrize("per_tensor", [True, False])
def test_full_stats_accelerator_launches_grow_with_chunks_not_tensors(per_tensor):
    """1-D tensors: the zero lines of 2-D ones are a few launches per tensor (sampled steps only)."""
    gen = torch.Generator().manual_seed(0)
    totals = []
    for n in (10, 200):
        tensors = [t.reshape(-1) for t in _small_tensors(n, gen)]
        with OpCounter() as counter:
            full_stats(tensors, inv_scale=torch.tensor(2.0**-10), per_tensor=per_tensor,
                       subnormal_below=FLOAT16.smallest_normal, algorithm="accelerator")
        totals.append(counter.launches)
    assert totals[0] == totals[1] and totals[0] <= 64, totals  # (the sort, prefix sums and foreach reductions of one chunk)


@pytest.mark.parametrize("per_tensor", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_accelerator_algorithm_on_fake_cuda_never_syncs(dtype, per_tensor):
    """FakeTensorMode fakes CUDA tensors on a CPU-only build and raises on data-dependent host
    reads; the op audit also keeps out the ops that are nondeterministic on CUDA (float atomics)
    or that raise under ``torch.use_deterministic_algorithms(True)``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    layouts = SlotLayouts()
    with FakeTensorMode(), OpCounter() as counter:
        tensors = [torch.randn(n, device="cuda").to(dtype) for n in (7, 0, 300, 5)]
        inv = torch.full((), 2.0**-16, device="cuda")
        light = light_stats(tensors, inv_scale=inv)
        full = full_stats(tensors, inv_scale=inv, subnormal_below=FLOAT16.smallest_normal, per_tensor=per_tensor,
                          layouts=layouts)
        top = tensor_peaks(tensors)
    slots = len(tensors) if per_tensor else 1
    assert light.peaks.device.type == "cuda" and light.peaks.shape == (4,) and top.shape == (4,)
    assert full.counts.shape == (slots * SLOT_STRIDE,) and full.amax.shape == (slots,)
    assert full.amin_code.dtype == torch.int32 and full.sumsq.dtype == torch.float64
    assert not FORBIDDEN & set(counter.ops), FORBIDDEN & set(counter.ops)


def test_accelerator_algorithm_is_deterministic_and_allowed_in_deterministic_mode():
    gen = torch.Generator().manual_seed(3)
    tensors = _small_tensors(40, gen, torch.float32) + [torch.randn(1000, generator=gen)]
    kw = dict(inv_scale=torch.tensor(2.0**-10), subnormal_below=FLOAT16.smallest_normal, algorithm="accelerator")
    torch.use_deterministic_algorithms(True)
    try:
        runs = [full_stats(tensors, **kw).decode() for _ in range(2)]
    finally:
        torch.use_deterministic_algorithms(False)
    for field in HostStats.__dataclass_fields__:
        np.testing.assert_array_equal(getattr(runs[0], field), getattr(runs[1], field))


class LiveBytes(OpCounter):
    """The peak bytes of storages created by dispatched ops and still referenced (views of
    ``inputs`` are not new storage)."""

    def __init__(self, inputs=()) -> None:
        super().__init__()
        self.inputs = {t.untyped_storage().data_ptr() for t in inputs}
        self.live: dict[int, list] = {}  # storage pointer -> [bytes, live tensor objects]
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        for t in (out if isinstance(out, (list, tuple)) else [out]):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.inputs:
            return
        entry = self.live.get(ptr)
        if entry is None:
            entry = self.live[ptr] = [t.untyped_storage().nbytes(), 0]
            self.now += entry[0]
            self.peak = max(self.peak, self.now)
        entry[1] += 1
        weakref.finalize(t, self._release, ptr)

    def _release(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[ptr]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_accelerator_temporaries_stay_within_32_bytes_per_element(monkeypatch, dtype):
    """Issue 17: the old scatter algorithm held ~64 bytes per element at its peak (256 MiB per
    2**22-element chunk, during unscale_). Issue 26's sort holds int64 indices: chunks of 2**21
    elements keep the peak under 64 MiB."""
    assert full_module.CHUNK_ELEMENTS * 32 <= 64 << 20
    monkeypatch.setattr(full_module, "CHUNK_ELEMENTS", 1 << 16)
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(n, generator=gen).to(dtype) for n in [1000] * 40 + [30_000, 70_000]]
    with LiveBytes(tensors) as tracker:
        full_stats(tensors, inv_scale=torch.tensor(2.0**-10), subnormal_below=FLOAT16.smallest_normal,
                   algorithm="accelerator")
    per_element = tracker.peak / (1 << 16)
    assert 8 < per_element <= 32, per_element


def test_layouts_of_a_large_model_are_all_cached():
    """GPT-2-XL's gradients make 193 chunk layouts; the old cache held 64 and cleared itself when
    full, so every full-statistics step missed (each miss a synchronous copy)."""
    layouts = SlotLayouts()
    chunks = [tuple((slot, 10 * k, 10) for k, slot in enumerate(range(i, i + 3))) for i in range(193)]
    first = [layouts.get(torch.device("cpu"), c) for c in chunks]
    again = [layouts.get(torch.device("cpu"), c) for c in chunks]
    assert layouts.misses == 193 and all(a[0] is b[0] for a, b in zip(first, again))
    small = SlotLayouts(max_entries=2)
    for c in (chunks[0], chunks[1], chunks[0], chunks[2], chunks[0]):  # least recently used goes first
        small.get(torch.device("cpu"), c)
    assert small.misses == 3


def test_accelerator_algorithm_is_immune_to_the_zero_padded_foreach_max(monkeypatch):
    """CUDA's _foreach_max before torch 2.11 padded the partial maxima of a tensor with fewer
    chunks than the largest in the call with 0: right only for non-negative values. The
    accelerator algorithm feeds it only those (a negated minimum read no amin at all)."""
    real = torch._foreach_max
    monkeypatch.setattr(torch, "_foreach_max", lambda ts: [m.clamp(min=0) for m in real(ts)])
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(70_000, generator=gen), torch.randn(100, generator=gen) * 1e-3, torch.zeros(5)]
    kw = dict(inv_scale=torch.tensor(2.0**-10), subnormal_below=FLOAT16.smallest_normal)
    host = full_stats(tensors, algorithm="host", **kw).decode()
    accelerator = full_stats(tensors, algorithm="accelerator", **kw).decode()
    np.testing.assert_array_equal(accelerator.amin, host.amin)
    np.testing.assert_array_equal(accelerator.amax, host.amax)
    assert not np.isnan(host.amin[:2]).any() and np.isnan(host.amin[2])
