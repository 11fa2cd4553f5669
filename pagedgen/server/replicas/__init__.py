"""Replicas behind Ray Serve: N engines, one ingress serving the single server's protocol, cache affinity.

Ray is an optional extra (``pip install -e '.[ray]'``): nothing outside this package imports it, so a plain
``pagedgen serve`` never needs it. The design: docs/replicas.md.
"""
