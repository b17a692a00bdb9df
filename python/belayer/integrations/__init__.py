"""Backends of agent harnesses built on Belayer sandboxes. Each lives in its own subpackage
and imports its harness only when imported itself; ``import belayer`` imports none of them."""
