"""Whisper-base word error rate and encoder time at shorter encoder windows (issue 31), side by side in one run.

The encoder reads a 30 s window (3000 mel frames -> 1500 positions) whatever the clip's length; a realtime turn is
2-8 s. Here each clip (sentences spoken by hibari's default voice and by espeak-ng, 16 kHz) is encoded by our
WhisperEncoder (models/audio/whisper.py) at windows of 10, 15, 20 and 30 s (the first N mel frames of the padded 30 s
features, the first N / 2 positions), optionally with int8 weights (the served Q8_0 encoder, models/audio/whisper_int8.py, and torch's dynamic linears), and
decoded greedily (transformers' WhisperForConditionalGeneration decoder over our encoder states: `<|en|>
<|transcribe|> <|notimestamps|>`, the checkpoint's suppress tokens), so the only difference between columns is the
window. WER: word edit distance over reference words, lowercased, punctuation dropped.

    nice -n 10 python -m omnivox.benchmarks.whisper_window --threads 1 --out benchmarks/results/whisper_window.json
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

from omnivox.benchmarks.host import write_results

SENTENCES = (  # 2-4 s each, then 5-8 s each (hibari and espeak-ng speak at about the same pace)
    "Please turn off the lights in the kitchen.",
    "What is the weather like tomorrow morning?",
    "Remind me to call my sister after lunch.",
    "The train leaves from platform four at noon.",
    "Can you play some quiet music for me?",
    "Set a timer for ten minutes, please.",
    "Where did I leave my keys this morning?",
    "Good night, see you tomorrow.",
    "Please send the report to the whole team before Friday, and ask them to read the second part carefully.",
    "The children played in the garden until it got dark, and then they came inside for a warm dinner.",
    "Read me the latest news about the city council and the new bridge they want to build across the river.",
    "Add bread, eggs, butter and two bottles of milk to my shopping list for the weekend.",
    "If it rains tomorrow afternoon, we will move the picnic indoors and watch a film instead.",
    "My brother is flying to the capital next week to meet some old friends from school.",
    "Could you find a quiet restaurant near the station that is still open after ten in the evening?",
    "The library closes early on Sundays, so return the books on Saturday if you can.",
)
WINDOWS_S = (10, 15, 20, 30)
RATE = 16000


def words(text: str) -> list[str]:
    return re.sub(
        r"[^a-z0-9' ]+", " ", text.lower().replace("favorite", "favourite").replace("color", "colour")
    ).split()


def edit_distance(ref: list[str], hyp: list[str]) -> int:
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return row[-1]


def resample(audio: np.ndarray, rate: int) -> np.ndarray:  # (T,) at `rate` -> (T',) at 16 kHz, linear
    if rate == RATE:
        return audio.astype(np.float32)
    n = int(round(len(audio) * RATE / rate))
    return np.interp(np.linspace(0, len(audio) - 1, n), np.arange(len(audio)), audio).astype(np.float32)


def espeak_clips(sentences) -> list[np.ndarray]:
    import io
    import wave

    exe = shutil.which("espeak-ng")
    if exe is None:
        return []
    out = []
    for text in sentences:
        raw = subprocess.run([exe, "--stdout", text], capture_output=True, check=True, timeout=60).stdout
        with wave.open(io.BytesIO(raw)) as w:
            pcm = np.frombuffer(w.readframes(w.getnframes()), np.int16).astype(np.float32) / 32768
            out.append(resample(pcm, w.getframerate()))
    return out


def hibari_clips(sentences) -> list[np.ndarray]:
    from omnivox.models.voice.loading import load_voice
    from omnivox.models.voice.voice_model import VoiceSettings
    from omnivox.services.parts.defaults import ensure_default_voice

    voice = load_voice(ensure_default_voice())
    out = []
    for text in sentences:
        parts = [voice.render(u, VoiceSettings(voice.default_voice, seed=0), np.random.default_rng(0))
                 for u in voice.utterances(text)]  # fmt: skip
        out.append(resample(np.concatenate(parts), voice.sample_rate))
    return out


def torch_ao_int8_encoder(encoder: torch.nn.Module) -> torch.nn.Module:
    """A copy with torch's int8 dynamic weights for the plain linears (fc1, fc2, out_proj; the packed qkv stays float):
    fbgemm's per-channel weights, activations with one scale per call (the first measurement; not served)."""
    import copy

    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    from omnivox.models.layers import Linear

    encoder = copy.deepcopy(encoder)
    for module in encoder.modules():
        if type(module) is Linear:  # its forward is nn.Linear's math; from_float takes only nn.Linear itself
            module.__class__ = torch.nn.Linear
    return torch.ao.quantization.quantize_dynamic(
        encoder, {torch.nn.Linear}, dtype=torch.qint8, mapping={torch.nn.Linear: DynamicLinear}
    )


def greedy(hf_model, states: torch.Tensor, prompt: list[int], suppress: torch.Tensor, eos: int, limit: int = 96):
    ids = torch.tensor([prompt])
    past, out = None, []
    with torch.inference_mode():
        for _ in range(limit):
            dec = hf_model.model.decoder(input_ids=ids, encoder_hidden_states=states, past_key_values=past,
                                         use_cache=True)  # fmt: skip
            past = dec.past_key_values
            logits = hf_model.proj_out(dec.last_hidden_state[0, -1])
            logits[suppress] = -float("inf")
            token = int(logits.argmax())
            if token == eos:
                break
            out.append(token)
            ids = torch.tensor([[token]])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--int8",
        action="store_true",
        help="also the served int8 encoder (models/audio/whisper_int8.py, "
        "Q8_0 blocks) and torch's int8 dynamic linears, at the shortest and the full window",
    )
    ap.add_argument("--windows", type=int, nargs="+", default=list(WINDOWS_S), help="float32 windows (seconds)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--limit", type=int, default=len(SENTENCES), help="sentences per voice (a smoke run: 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import datetime
    import os

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    run_facts = {"started": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M"),
                 "commit": commit.stdout.strip(), "load_average_at_start": [round(x, 1) for x in os.getloadavg()]}  # fmt: skip
    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration, WhisperTokenizerFast

    from omnivox.codecs.mel import LogMelExtractor, MelSettings
    from omnivox.models.audio.whisper import load_whisper
    from omnivox.services.parts.defaults import ensure_default_whisper

    folder = ensure_default_whisper(progress=False)
    ours = load_whisper(str(folder))
    hf = WhisperForConditionalGeneration.from_pretrained(folder).eval()
    tok = WhisperTokenizerFast.from_pretrained(folder)
    mel = LogMelExtractor(
        MelSettings.from_feature_extractor(WhisperFeatureExtractor.from_pretrained(folder), "max_length")
    )
    gen = hf.generation_config
    prompt = [
        gen.decoder_start_token_id,
        gen.lang_to_id["<|en|>"],
        gen.task_to_id["transcribe"],
        gen.no_timestamps_token_id,
    ]
    suppress = torch.tensor(sorted(set(gen.suppress_tokens or [])), dtype=torch.long)
    encoders = {"float32": ours.encoder}
    if args.int8:
        from omnivox.models.audio.whisper_int8 import int8_encoder

        encoders["int8"] = int8_encoder(ours.encoder)
        encoders["int8-torch-ao"] = torch_ao_int8_encoder(ours.encoder)
    sentences = SENTENCES[: args.limit]
    clips = [("hibari", c) for c in hibari_clips(sentences)] + [("espeak", c) for c in espeak_clips(sentences)]
    refs = [words(s) for s in sentences] * 2
    # int8 only at the shortest window (ours also at the full one): the machine is shared, a run must stay near 10 min.
    windows = sorted(set(args.windows) | {30})  # the 30 s column is every ratio's reference
    columns = [("float32", w) for w in windows]
    if args.int8:
        columns += [("int8", windows[0]), ("int8", 30), ("int8-torch-ao", windows[0])]
    rows = []
    errors = {f"{n}@{w}s": 0 for n, w in columns}
    seconds = {f"{n}@{w}s": 0.0 for n, w in columns}
    for (voice, clip), ref in zip(clips, refs, strict=False):
        feats = mel.extract([torch.from_numpy(clip)]).features  # [1, n_mels, 3000]
        row = {"voice": voice, "seconds": round(len(clip) / RATE, 2), "reference": " ".join(ref), "hyp": {}}
        for name, window in columns:
            key = f"{name}@{window}s"
            with torch.inference_mode():
                t0 = time.perf_counter()
                states = encoders[name](feats[..., : window * 100])  # [1, window * 50, d]
                seconds[key] += time.perf_counter() - t0
            text = tok.decode(greedy(hf, states, prompt, suppress, gen.eos_token_id), skip_special_tokens=True)
            errors[key] += edit_distance(ref, words(text))
            row["hyp"][key] = text.strip()
        rows.append(row)
        print(json.dumps(row), flush=True)
    total = sum(len(r) for r in refs[: len(clips)])
    summary = {key: {"wer": round(errors[key] / total, 4), "encoder_s_mean": round(seconds[key] / len(clips), 3),
                     "encoder_time_vs_float32_30s": round(seconds[key] / seconds["float32@30s"], 3)}
               for key in errors}  # fmt: skip
    for voice in ("hibari", "espeak"):
        idx = [i for i, r in enumerate(rows) if r["voice"] == voice]
        n = sum(len(rows[i]["reference"].split()) for i in idx)
        for key in errors:
            e = sum(edit_distance(rows[i]["reference"].split(), words(rows[i]["hyp"][key])) for i in idx)
            summary[key][f"wer_{voice}"] = round(e / max(n, 1), 4)
    result = {"benchmark": "whisper_window", "model": "whisper-base", "threads": args.threads,
              "clips": len(clips), "reference_words": total, "summary": summary, "rows": rows, **run_facts,
              "note": "CPU, the machine shared with other jobs; times are ratios in one run"}  # fmt: skip
    print(json.dumps(summary, indent=1))
    if args.out:
        write_results(args.out, result, indent=1)


if __name__ == "__main__":
    main()
