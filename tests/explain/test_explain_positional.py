"""`aiayn explain positional`, reduced: geometric wavelengths from 2π; PE(t+k) = M_k PE(t) with M_k
the rotation R_k, fitted on spread positions and exact on unseen ones; PE(t)·PE(t+k) a function of
|k| alone."""

from __future__ import annotations

import math

import pytest
import torch

from aiayn.explain import run_topic
from aiayn.explain.positional import rotation
from aiayn.nn.positional import sinusoidal_encoding


@pytest.fixture(scope="module")
def claims(tmp_path_factory):
    return run_topic("positional", tmp_path_factory.mktemp("positional"), quick=True).claims


def test_wavelengths(claims):
    d = claims["d_model"]
    assert claims["wavelength_min"] == pytest.approx(2 * math.pi)
    assert claims["ratio"] == pytest.approx(10000 ** (2 / d))
    assert claims["wavelength_max"] == pytest.approx(2 * math.pi * 10000 ** ((d - 2) / d))


def test_the_shift_is_a_fixed_linear_map(claims):
    for fit in claims["fits"]:
        assert fit["fit_residual"] < 1e-6 and fit["held_out_residual"] < 1e-6, fit  # float32 table
        assert fit["rotation_residual"] < 1e-6 and fit["distance_to_rotation"] < 1e-6, fit
    for fit in claims["window_fits"]:  # fitted on the first positions only: right there, wrong elsewhere
        assert fit["fit_residual"] < 1e-6 and fit["held_out_residual"] > 0.1 and fit["condition"] > 1e6, fit


def test_dot_product_depends_on_the_offset_alone(claims):
    assert claims["dot_spread"] < 1e-5 and claims["mirror"] < 1e-5


def test_rotation_is_the_addition_formula():
    t = torch.arange(50)
    pe, shifted = sinusoidal_encoding(t, 16).double(), sinusoidal_encoding(t + 7, 16).double()
    torch.testing.assert_close(pe @ rotation(16, 7).T, shifted, atol=1e-6, rtol=0)
