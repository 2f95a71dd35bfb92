"""The detector's measures: ring-buffer baselines give each id the median of its recent values."""

import numpy as np

from resihp_ext.op_signals import Baselines


def test_baseline_medians_are_over_each_ids_last_values_once_it_has_enough():
    baselines, history = Baselines(size=5), {}
    rng = np.random.default_rng(0)
    for _ in range(40):
        for key in range(20):  # more ids than the first allocation holds, filling at different rates
            if rng.random() < 0.5:
                value = float(rng.random())
                baselines.add(key, value)
                history.setdefault(key, []).append(value)
        expected = {k: float(np.median(v[-5:])) for k, v in history.items() if len(v) >= 3}
        got = baselines.medians(min_count=3)
        assert got.keys() == expected.keys()
        assert all(abs(got[k] - expected[k]) < 1e-12 for k in got)
    assert Baselines(size=4).medians(min_count=1) == {}
