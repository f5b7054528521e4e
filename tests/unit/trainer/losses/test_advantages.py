"""Group-normalised advantages against values worked out by hand."""

import numpy as np
import pytest

from trainer.losses import group_advantages


def test_grpo_and_dr_grpo_advantages():
    rewards = np.array([[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0], [3.0, 0.0, 0.0, 1.0]])
    # group 0: mean 0.5, population std 0.5 -> +-0.5 / (0.5 + 1e-6)
    # group 1: mean 1, std 0 -> exactly 0
    # group 2: mean 1, deviations [2, -1, -1, 0], std sqrt(6 / 4) = 1.2247449
    out = group_advantages(rewards)
    a = 0.5 / (0.5 + 1e-6)
    s = np.sqrt(1.5)
    expected = [[a, -a, a, -a], [0, 0, 0, 0], [2 / (s + 1e-6), -1 / (s + 1e-6), -1 / (s + 1e-6), 0]]
    np.testing.assert_allclose(out.advantages, expected, rtol=1e-6)
    np.testing.assert_allclose(out.mean[:, 0], [0.5, 1.0, 1.0])
    np.testing.assert_allclose(out.std[:, 3], [0.5, 0.0, 1.2247449], rtol=1e-6)
    assert out.advantages.dtype == np.float32 and out.mean.shape == (3, 4)
    dr = group_advantages(rewards, normalize_std=False)
    np.testing.assert_allclose(dr.advantages[2], [2.0, -1.0, -1.0, 0.0])


def test_bad_rewards_raise():
    with pytest.raises(ValueError, match=r"\[P, G\]"):
        group_advantages(np.zeros(4))
    with pytest.raises(ValueError, match="finite"):
        group_advantages(np.array([[1.0, np.nan]]))
