"""Where the kernel sources live: `csrc/` beside the package, in the repository and installed.

executor/ is zllm/executor/ once installed (pyproject's package-dir), and csrc/ is zllm/csrc/,
so one expression finds both. ZLLM_CSRC_DIR points elsewhere (a kernel under development).
"""

import os
from pathlib import Path

CSRC_DIR = Path(os.environ.get("ZLLM_CSRC_DIR") or Path(__file__).resolve().parents[2] / "csrc")
