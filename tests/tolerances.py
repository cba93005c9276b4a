"""Tolerances defined once (dynamax style)."""

# Monte Carlo checks: |estimate - truth| < MC_SIGMAS * sd / sqrt(n).
MC_SIGMAS = 5.0
# Deterministic float64 identities.
EXACT_RTOL = 1e-8
EXACT_ATOL = 1e-10
