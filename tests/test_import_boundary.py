"""`omnivox serve` of a text-only model imports no vision or audio family: those modules bring transformers'
processing / modeling utilities (and torch._dynamo through its masking code), seconds of every start.

One fresh interpreter goes through the serve path (the CLI's serve module, the server, a ModelSpec resolved and
loaded as `omnivox serve --model PATH` does), then reports which of the heavy modules it holds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from checkpoints import make_checkpoint

# Imported only when a model of theirs is loaded (models/audio/__init__.py, models/vision/__init__.py FAMILIES).
FAMILY_MODULES = (
    "omnivox.models.audio.qwen2_audio",
    "omnivox.models.audio.qwen3_asr",
    "omnivox.models.audio.voxtral",
    "omnivox.models.vision.base",
    "omnivox.models.vision.llava",
    "omnivox.models.vision.idefics3",
    "omnivox.models.vision.qwen_vl",
    "omnivox.models.vision.gemma3",
    # what those bring: processing and masking utilities (masking_utils imports torch._dynamo), Qwen3-ASR's table
    "transformers.processing_utils",
    "transformers.masking_utils",
    "transformers.models.qwen3_asr.processing_qwen3_asr",
)

_SCRIPT = """
import json, sys
import omnivox.services.cli.serve
import omnivox.services.server
from omnivox.services.loading import EngineOptions, ModelSpec, load, resolve
from omnivox.models.config import served_families

model = resolve(ModelSpec(path=sys.argv[1]), is_default=True, max_queue=4)
load(model, EngineOptions(max_model_len=256, max_num_seqs=2))
heavy = [m for m in json.loads(sys.argv[2]) if m in sys.modules]
print(json.dumps({"ready": model.bundle is not None, "heavy": heavy, "families": served_families()}))
"""


def test_text_only_serve_imports_no_family_module(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path / "llama")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(path), json.dumps(FAMILY_MODULES)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["ready"]
    assert report["heavy"] == [], f"a text-only serve imported {report['heavy']}"
    # The registries still name every family without importing one.
    assert "'qwen2_audio', 'qwen3_asr', 'voxtral'" in report["families"]
    assert "'gemma3', 'idefics3', 'llava', 'llava_next', 'qwen2_5_vl', 'qwen2_vl', 'smolvlm'" in report["families"]
