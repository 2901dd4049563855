"""collage-compile: a torch.compile backend for bf16/fp16 training without fp32 master weights.

    import collage_compile
    step = torch.compile(train_step, backend=collage_compile.backend)
    # or: torch.compile(train_step, backend="collage", options={"arithmetic": "storage"})

Importing registers nothing and compiles nothing: the ``"collage"`` name reaches Dynamo
through the ``torch_dynamo_backends`` entry point, loaded the first time it is asked for.
"""

from __future__ import annotations

from typing import Any

from collage_compile.checkpoint import attach, convert, set_value
from collage_compile.compiler import inductor_options, make_backend
from collage_compile.config import CollageConfig
from collage_compile.diagnostics import CollageWarning
from collage_compile.metrics import last_metrics, measuring, metered, reset_metrics
from collage_compile.names import name_tensors
from collage_compile.optim import GradScaler, compile_optimizer
from collage_compile.report import Explanation, explain
from collage_compile.state import components, value

__all__ = [
    "CollageConfig",
    "CollageWarning",
    "Explanation",
    "GradScaler",
    "attach",
    "backend",
    "compile_optimizer",
    "components",
    "convert",
    "explain",
    "inductor_options",
    "last_metrics",
    "make_backend",
    "measuring",
    "metered",
    "name_tensors",
    "reset_metrics",
    "set_value",
    "value",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # ``collage_compile.backend`` is resolved on first use, so that the once-only set-up
    # (a warning hook for fused optimizers, which never reach a backend) runs when the
    # backend is asked for, never on import.
    if name == "backend":
        from collage_compile import compiler, watch

        watch.install()
        return compiler.backend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
