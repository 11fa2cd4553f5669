"""Test-session settings shared by every layer."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

settings.register_profile(
    "pagedgen", deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.load_profile("pagedgen")
