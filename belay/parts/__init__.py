"""The worker's parts, shared by the Python worker (``belay.runner``) and the
HTTP worker sessions (``belay.http.workers``): one implementation of each
protocol both speak.

- :mod:`belay.parts.maintenance`: reclaim of expired leases (§6).
"""
