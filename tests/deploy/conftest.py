"""Deployment tests: compose files, Dockerfile, Kubernetes manifests, and (marked `docker`) the stack."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "docker: starts a Docker engine, builds images and runs containers (minutes)")
