"""Shared test settings: hypothesis profiles (CI runs the long one)."""
from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, settings

torch.set_num_threads(1)

settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "ci", deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.load_profile("ci" if os.environ.get("CI") else "dev")
