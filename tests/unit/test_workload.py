"""Tests for resihp_ext.workload: spec parsing, length sampling, packing, features."""

import numpy as np
import pytest

from resihp_ext.workload import (
    LengthDistribution,
    microbatch_features,
    pack_documents,
    sample_document_lengths,
    sample_packed_workload,
)


@pytest.mark.parametrize(
    "spec",
    [
        "lognormal:median=48,sigma=1.0,min=8,max=1024",
        "fixed:length=32",
        "uniform:min=8,max=64",
        "pareto:alpha=1.5,min=16,max=2048",
        "lognormal:median=100,sigma=0.5",
    ],
)
def test_parse_round_trips(spec):
    dist = LengthDistribution.parse(spec)
    assert LengthDistribution.parse(str(dist)) == dist


def test_parse_fields():
    dist = LengthDistribution.parse(" LogNormal: sigma=1.0, median=48, max=1024, min=8 ")
    assert dist.kind == "lognormal"
    assert dist.param("median") == 48.0 and dist.param("sigma") == 1.0
    assert (dist.min_length, dist.max_length) == (8, 1024)


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("gamma:k=2", "unknown distribution"),
        ("lognormal:median=48", "sigma"),
        ("lognormal:median=48,sigma=1,foo=2", "bad item"),
        ("lognormal:median=abc,sigma=1", "not a number"),
        ("uniform:min=10,max=5", "max (5) must be >= min (10)"),
        ("uniform:min=0,max=5", "min must be >= 1"),
        ("fixed:length=2.5", "integer"),
        ("pareto:alpha=0,min=4", "alpha > 0"),
        ("lognormal:median=48,sigma=1,sigma=2", "twice"),
    ],
)
def test_parse_errors_name_flag(spec, fragment):
    with pytest.raises(ValueError) as err:
        LengthDistribution.parse(spec)
    assert "--mock-doc-lengths" in str(err.value)
    assert fragment in str(err.value)


def test_lognormal_sample_is_heavy_tailed_and_clipped():
    dist = LengthDistribution.parse("lognormal:median=48,sigma=1.0,min=8,max=1024")
    lengths = sample_document_lengths(np.random.default_rng(0), dist, 50_000)
    assert lengths.dtype == np.int64 and lengths.shape == (50_000,)
    assert lengths.min() >= 8 and lengths.max() <= 1024
    assert abs(np.median(lengths) - 48) <= 2
    # Heavy tail: the mean sits well above the median and a few documents hit the clip.
    assert lengths.mean() > 1.4 * np.median(lengths)
    assert (lengths == 1024).any()


def test_sampling_is_reproducible_from_the_seed():
    dist = LengthDistribution.parse("pareto:alpha=1.2,min=4,max=4096")
    a = sample_document_lengths(np.random.default_rng(7), dist, 100)
    b = sample_document_lengths(np.random.default_rng(7), dist, 100)
    c = sample_document_lengths(np.random.default_rng(8), dist, 100)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_fixed_and_uniform_ranges():
    rng = np.random.default_rng(1)
    assert set(sample_document_lengths(rng, LengthDistribution.parse("fixed:length=5"), 10)) == {5}
    u = sample_document_lengths(rng, LengthDistribution.parse("uniform:min=3,max=4"), 1000)
    assert set(u) == {3, 4}


def test_pack_splits_documents_across_boundaries():

    samples = pack_documents([3, 5, 2, 7, 1], 4)
    # 18 tokens -> 4 full samples of 4; the last 2 tokens are dropped.
    assert samples == [[3, 1], [4], [2, 2], [4]]
    assert all(sum(s) == 4 for s in samples)


def test_pack_preserves_tokens_up_to_the_last_full_sample():
    lengths = np.random.default_rng(3).integers(1, 100, size=500)
    samples = pack_documents(lengths, 64)
    assert len(samples) == int(lengths.sum()) // 64
    flat = [piece for s in samples for piece in s]
    assert sum(flat) == len(samples) * 64


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="--seq-length"):
        pack_documents([4], 0)
    with pytest.raises(ValueError, match=">= 1"):
        pack_documents([4, 0], 4)


def test_sample_packed_workload_returns_exactly_n_samples():
    dist = LengthDistribution.parse("lognormal:median=48,sigma=1.5,min=8,max=4096")
    samples = sample_packed_workload(np.random.default_rng(0), dist, 37, 512)
    assert len(samples) == 37
    assert all(sum(s) == 512 for s in samples)


def test_microbatch_features():
    assert microbatch_features([[3, 1], [4]]) == (8, 9 + 1 + 16, 3)
    assert microbatch_features([]) == (0, 0, 0)
    # One long document costs more attention than many short ones with the same tokens.
    assert microbatch_features([[64]])[1] > microbatch_features([[8] * 8])[1]
