"""ampdoctor: debugging and diagnostics for PyTorch automatic mixed precision."""

__version__ = "0.1.0"

from .errors import AmpdoctorError, RecorderError, RunError  # noqa: E402
from .reports.origins import find_origins  # noqa: E402
from .reports.postmortem import postmortem  # noqa: E402
from .run import Run, load, read_run  # noqa: E402
from .scaler import GradScaler, unwrap, wrap  # noqa: E402

__all__ = ["GradScaler", "wrap", "unwrap", "load", "read_run", "Run", "find_origins", "postmortem",
           "AmpdoctorError", "RecorderError", "RunError", "__version__"]
