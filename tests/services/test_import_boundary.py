"""`omnivox serve` of a text-only model imports no vision or audio family, nor what they bring (transformers'
processing and masking utilities, torch._dynamo): seconds of every start.

One fresh interpreter goes through the serve path (the CLI's serve module, the server, ModelSpecs resolved and loaded
as `omnivox serve --model PATH` does: a safetensors folder and a GGUF whose metadata cache is warm, as on every start
after the first), then reports which of the heavy modules it holds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from support.checkpoints import make_checkpoint
from support.gguf_writer import write_gguf

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
    # a GGUF's parameter names (cached: models/gguf_checkpoint.py), init fills under meta (models/meta.py)
    "transformers.models.llama.modeling_llama",
    "torch._dynamo",
)

_SCRIPT = """
import json, sys
import omnivox.services.cli.serve
import omnivox.services.grpc_api.server
from omnivox.services.parts.loading import EngineOptions, ModelSpec, load, resolve
from omnivox.models.config import served_families

ready = []
for path in sys.argv[2:]:
    model = resolve(ModelSpec(path=path), is_default=not ready, max_queue=4)
    load(model, EngineOptions(max_model_len=256, max_num_seqs=2))
    ready.append(model.bundle is not None)
heavy = [m for m in json.loads(sys.argv[1]) if m in sys.modules]
print(json.dumps({"ready": ready, "heavy": heavy, "families": served_families()}))
"""


def test_text_only_serve_imports_no_family_module(tmp_path: Path, monkeypatch) -> None:
    from omnivox.models.gguf_checkpoint import gguf_name_map, gguf_tensor_table, load_gguf_config

    folder = make_checkpoint(tmp_path / "llama")
    gguf_file = write_gguf(folder, tmp_path / "gguf" / "tiny.gguf", {})
    monkeypatch.setenv("OMNIVOX_CACHE", str(tmp_path / "cache"))
    gguf_name_map(gguf_tensor_table(gguf_file)[0], load_gguf_config(gguf_file))  # an earlier start's metadata
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, json.dumps(FAMILY_MODULES), str(folder), str(gguf_file)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["ready"] == [True, True]
    assert report["heavy"] == [], f"a text-only serve imported {report['heavy']}"
    # The registries still name every family without importing one.
    assert "'qwen2_audio', 'qwen3_asr', 'voxtral'" in report["families"]
    assert "'gemma3', 'idefics3', 'llava', 'llava_next', 'qwen2_5_vl', 'qwen2_vl', 'smolvlm'" in report["families"]
