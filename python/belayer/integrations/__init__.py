"""Backends of agent harnesses over Belayer sandboxes, one subpackage per harness.

Each subpackage imports its harness, an optional dependency installed with the extra of the
same name (``pip install 'belayer[minisweagent]'``, ``'belayer[harbor]'``); ``import belayer``
imports none of them.
"""
