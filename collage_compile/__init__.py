"""collage-compile: a torch.compile backend for bf16/fp16 training without fp32 master weights.

    import collage_compile
    step = torch.compile(train_step, backend=collage_compile.backend)
    # or: torch.compile(train_step, backend="collage", options={"arithmetic": "storage"})

Importing registers nothing and compiles nothing: the ``"collage"`` name reaches Dynamo
through the ``torch_dynamo_backends`` entry point, loaded the first time it is asked for.
"""

from __future__ import annotations

from collage_compile.compiler import backend, make_backend
from collage_compile.config import CollageConfig
from collage_compile.report import CollageWarning
from collage_compile.state import components, value

__all__ = [
    "CollageConfig",
    "CollageWarning",
    "backend",
    "components",
    "make_backend",
    "value",
]

__version__ = "0.1.0"
