"""Belayer sandboxes as a Harbor environment (``pip install 'belayer[harbor]'``, Python >= 3.12).

Select it by import path::

    harbor run -p TASK_DIR -a oracle --env belayer.integrations.harbor:BelayerEnvironment \\
        --ek image=python --ek socket=/run/belayer/belayer.sock

See :class:`BelayerEnvironment` for the image mapping and the recovery semantics.
"""

from .dockerfile import UnsupportedDockerfileError
from .environment import BelayerEnvironment, BelayerOptions

__all__ = ["BelayerEnvironment", "BelayerOptions", "UnsupportedDockerfileError"]
