"""Image benchmark: time to first token of image questions, vision-encoder time per image size, and the decode
inter-token latency (ITL) of running text requests while images arrive, against the same text requests alone.

    python -m omnivox.benchmarks.images [--model VLM_FOLDER] [--sizes 224,336,448] [--out results.json]

Without --model it builds a randomly initialised Qwen2.5-VL-shaped checkpoint (speed does not depend on trained
weights): a 6-block ViT (hidden 256, 14 px patches merged 2x2) and an 8-layer decoder (hidden 512), with the embedded
SmolLM2 tokenizer, processor and chat template. The server runs as a child process (`omnivox serve`).

1. Encoder time: the checkpoint's VisionEncoder in this process, one image of each size, median of 5 (what the
   server's encoder worker spends per image, off the engine thread).
2. Text alone: --text-streams concurrent text requests of --text-tokens output tokens; ITL = gaps between their deltas.
3. Text + images: the same text requests, and meanwhile one fresh image request (a never-seen image, cycling through
   the sizes) every --image-interval seconds; ITL of the text requests again, and each image request's TTFT.
4. Text + matched text: the same, but each arriving request is text with as many prompt tokens as the image request
   it stands for. Its prefill costs the running decodes the same steps; only the encoder is missing.
The issue-9 target: ITL p99 with images within 1.2x of the image-free run. Both image-free runs are reported: text
alone (the ratio then includes the prefill of every arriving prompt) and matched text arrivals (the ratio is then what
encoding costs the decodes: the encoder worker's share of the cores and the GIL).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from omnivox.benchmarks.host import write_results

QUESTION = "What is in this picture? Describe it."
TEXT_PROMPT = "Tell me a long story about a lighthouse keeper and the sea."


def make_random_vlm(out: Path) -> Path:
    """A Qwen2.5-VL-shaped random checkpoint with processor and chat template (seconds to build, ~60 MB)."""
    import torch
    import transformers

    from omnivox.models.checkpoint import load_tokenizer
    from omnivox.models.vision.base import image_only_processor_class
    from omnivox.services.parts.defaults import ensure_default_model

    tok = load_tokenizer(ensure_default_model(progress=False))
    specials = ["<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>"]
    tok.add_special_tokens({"additional_special_tokens": specials})
    ids = {t: tok.convert_tokens_to_ids(t) for t in specials}
    template = (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
        "{% for part in message['content'] %}{% if part['type'] == 'image' %}"
        "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    vision = dict(
        depth=6, hidden_size=256, intermediate_size=1024, num_heads=4, patch_size=14, spatial_merge_size=2,
        temporal_patch_size=2, window_size=112, fullatt_block_indexes=[2, 5], out_hidden_size=512,
    )  # fmt: skip
    text = dict(
        vocab_size=len(tok), hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6, bos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [8, 12, 12]},
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
    )  # fmt: skip
    config = transformers.Qwen2_5_VLConfig(
        vision_config=vision, text_config=text, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False,
    )  # fmt: skip
    ip = transformers.Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=448 * 448, patch_size=14, merge_size=2)
    processor = image_only_processor_class(transformers.Qwen2_5_VLProcessor)(
        image_processor=ip, tokenizer=tok, chat_template=template
    )
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def image_png(size: int, seed: int) -> bytes:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def encoder_times(model: str, sizes: list[int]) -> dict[str, float]:
    """Median seconds of the vision encoder (preprocess + encode) for one image of each size."""
    import torch
    from PIL import Image

    from omnivox.models.vision import VisionEncoder

    enc = VisionEncoder.from_folder(model)
    with torch.inference_mode():  # warm-up: the first forward pays one-off allocations and kernel choices
        enc.encode(enc.preprocess([Image.open(io.BytesIO(image_png(112, seed=0))).convert("RGB")]))
    out = {}
    for size in sizes:
        im = Image.open(io.BytesIO(image_png(size, seed=size))).convert("RGB")
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            with torch.inference_mode():
                items = enc.preprocess([im])
                enc.encode(items)
            times.append(time.perf_counter() - t0)
        out[str(size)] = statistics.median(times)
        out[f"{size}_tokens"] = items[0].num_features
    return out


def stream(address: str, parts: list, max_tokens: int) -> tuple[float, list[float]]:
    """(TTFT, arrival times of every delta) of one greedy request, client side."""
    from omnivox.v1 import content_pb2, generation_pb2, generation_pb2_grpc, sampling_pb2

    request = generation_pb2.GenerateRequest(
        contents=[content_pb2.Content(role="user", parts=parts)],
        sampling=sampling_pb2.SamplingConfig(temperature=0.0),
        max_output_tokens=max_tokens,
        ignore_eos=True,
    )
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        start = time.monotonic()
        arrivals = [time.monotonic() for r in stub.Generate(request, timeout=600) if r.HasField("delta")]
    return arrivals[0] - start, arrivals


def text_itl(address: str, n: int, tokens: int, during=None) -> list[float]:
    """Gaps between deltas of n concurrent text requests (the first gap, the prefill, left out)."""
    from omnivox.v1 import content_pb2

    parts = [content_pb2.Part(text=TEXT_PROMPT)]
    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(stream, address, parts, tokens) for _ in range(n)]
        if during is not None:
            during(futures)
        results = [f.result() for f in futures]
    return [b - a for _, arr in results for a, b in zip(arr[1:], arr[2:], strict=False)]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(address: str, sizes: list[int], args: argparse.Namespace) -> dict:
    from omnivox.v1 import content_pb2

    stream(address, [content_pb2.Part(text="warm up")], 4)
    stream(
        address, [content_pb2.Part(image=content_pb2.ImagePart(data=image_png(64, 1))), content_pb2.Part(text="hi")], 4
    )
    alone = text_itl(address, args.text_streams, args.text_tokens)
    image_ttft: dict[str, list[float]] = {str(s): [] for s in sizes}
    text_ttft: dict[str, list[float]] = {str(s): [] for s in sizes}

    def arrivals(make_parts, ttft: dict[str, list[float]]):
        def send(futures) -> None:
            k = 0
            while not all(f.done() for f in futures):
                size = sizes[k % len(sizes)]
                parts = make_parts(size, k)
                threading.Thread(target=lambda p=parts, s=size: ttft[str(s)].append(stream(address, p, 8)[0])).start()
                k += 1
                time.sleep(args.image_interval)

        return send

    def image_parts(size: int, k: int) -> list:
        return [
            content_pb2.Part(image=content_pb2.ImagePart(data=image_png(size, seed=1000 + k))),
            content_pb2.Part(text=QUESTION),
        ]

    def matched_text_parts(size: int, k: int) -> list:
        # As many prompt tokens as the image request (its features), never seen before: the same prefill work,
        # no encoder. The difference between the two runs is what encoding images costs the running decodes.
        words = " ".join(f"w{(k * 7919 + i) % 9973}" for i in range(tokens[size] // 3))
        return [content_pb2.Part(text=f"{words}\n{QUESTION}")]

    tokens = {s: args.image_tokens.get(s, 64) for s in sizes}
    with_images = text_itl(address, args.text_streams, args.text_tokens, during=arrivals(image_parts, image_ttft))
    time.sleep(2.0)  # the last image requests finish
    with_text = text_itl(address, args.text_streams, args.text_tokens, during=arrivals(matched_text_parts, text_ttft))
    time.sleep(2.0)
    return {
        "itl_alone_ms": {"p50": pct(alone, 0.5) * 1e3, "p99": pct(alone, 0.99) * 1e3, "n": len(alone)},
        "itl_with_images_ms": {"p50": pct(with_images, 0.5) * 1e3, "p99": pct(with_images, 0.99) * 1e3},
        "itl_with_matched_text_ms": {"p50": pct(with_text, 0.5) * 1e3, "p99": pct(with_text, 0.99) * 1e3},
        "itl_p99_ratio": pct(with_images, 0.99) / pct(alone, 0.99),
        "itl_p99_ratio_vs_matched_text": pct(with_images, 0.99) / pct(with_text, 0.99),
        "image_ttft_ms": {s: [round(t * 1e3, 1) for t in v] for s, v in image_ttft.items()},
        "matched_text_ttft_ms": {s: [round(t * 1e3, 1) for t in v] for s, v in text_ttft.items()},
        "image_requests": sum(len(v) for v in image_ttft.values()),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m omnivox.benchmarks.images", description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a vision-language checkpoint folder (default: a random Qwen2.5-VL shape)")
    ap.add_argument("--sizes", default="224,336,448", help="image sides in pixels")
    ap.add_argument("--text-streams", type=int, default=2)
    ap.add_argument("--text-tokens", type=int, default=96)
    ap.add_argument("--image-interval", type=float, default=1.0, help="seconds between image requests")
    ap.add_argument("--server-arg", action="append", default=[], help="extra argument for `omnivox serve` (repeat)")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    from omnivox.benchmarks.main import git_commit
    from omnivox.benchmarks.systems.omnivox_grpc import ServerProcess

    meta = {
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": git_commit(),
        "load_average_at_start": list(os.getloadavg()),
        "command": " ".join(["python -m omnivox.benchmarks.images", *(argv if argv is not None else sys.argv[1:])]),
    }
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(make_random_vlm(Path(tmp) / "qwen2.5-vl-random"))
        enc = encoder_times(model, sizes)
        args.image_tokens = {s: enc[f"{s}_tokens"] for s in sizes}
        server = ServerProcess(model, args.server_arg, Path("bench-results") / "images-server.log")
        try:
            result = run(server.address, sizes, args)
        finally:
            server.close()
    result = {**meta, "encoder_s": enc, **result}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_results(args.out, result)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
