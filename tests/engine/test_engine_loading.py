"""Engine.from_pretrained streams weights: peak resident memory while loading stays under 1.5x the weights."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support.checkpoints import make_checkpoint

_PROBE = textwrap.dedent(
    """
    import sys, torch
    import omnivox.engine
    # A first load of a tiny checkpoint does every lazy import (and .pyc compile of a fresh clone): not loading.
    omnivox.engine.Engine.from_pretrained(sys.argv[2], device="cpu", kv_cache_gib=0.01)
    def peak_mib():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = peak_mib()
    engine = omnivox.engine.Engine.from_pretrained(sys.argv[1], device="cpu", kv_cache_gib=0.01)
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters()) / 2**20
    print(weights, peak_mib() - before)
    """
)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="peak-RSS reset needs Linux /proc")
def test_engine_loading_peak_memory_under_1_5x_weights(tmp_path):
    path = make_checkpoint(
        tmp_path / "mid",
        "llama",
        vocab_size=16000,
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        with_tokenizer=False,
    )
    tiny = make_checkpoint(tmp_path / "tiny", "llama", with_tokenizer=False)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, str(path), str(tiny)], capture_output=True, text=True, check=True, env=env
    )
    weights, growth = map(float, out.stdout.split())
    assert weights > 150
    assert growth < 1.5 * weights, f"loading grew {growth:.0f} MiB for {weights:.0f} MiB of weights"
