"""The checks on checkpoint and adapter files: config.json values, tensor names and shapes, adapter .json keys.
Each refusal is a ValueError (or FileNotFoundError) that names the file, the key or tensor, and the fix.

model.py and lookaheadkv.py call these in one line where they read a file, so that the reading path shows
what is read and this file shows what is refused. It imports nothing of the project: it is handed the
config, the raw JSON dict or the tensors it checks.
"""

import json
import math
import re
from pathlib import Path

import torch

# -----------------------------------------------------------------------------
# --- model checkpoints

# -----------------------------------------------------------------------------
# --- adapter files
