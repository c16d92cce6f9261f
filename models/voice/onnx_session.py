"""onnxruntime sessions for voices: CPU, a fixed number of threads per run, quiet logs."""

from __future__ import annotations

from pathlib import Path


def cpu_session(path: Path, threads: int = 1):
    """An InferenceSession on the CPU. threads: intra-op threads of one run; the speech worker runs several runs at
    once (one per worker thread), so 1 each keeps N concurrent runs on N cores without oversubscription."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = threads
    options.log_severity_level = 3  # errors only: every load warned about unused initializers
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
