"""The short hash fa4lab files compiled kernels and audit results under (a leaf: no imports of
fa4lab, so the kernel cache and the plan layer can both read it)."""

from __future__ import annotations

import hashlib


def digest(text: str) -> str:
    """24 hex digits of the SHA-256 of `text`."""
    return hashlib.sha256(text.encode()).hexdigest()[:24]
