"""The embedded image model on easy-vqa 1.0's test split (PyPI `easy-vqa`, the `bench` extra): 64 px images of one
circle, rectangle or triangle in 8 colours, with colour, shape and yes/no questions (issue 35's outside check).

    python -m omnivox.benchmarks.easy_vqa_score --questions 600 --out benchmarks/results/easy-vqa-cpu.json

Scored as the held-out scenes are (benchmarks/train_image_model.py `evaluate`): the greedy first answer token, with the
projector and LoRA of services/parts/data/shapes-vlm/projector.safetensors, on a seeded sample of the test questions.
Trained since run 5 on 1500 images of its train split beside the rendered scenes (benchmarks/easy_vqa_data.py);
the test split's 1000 images are never trained on.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch
from PIL import Image
from safetensors.torch import load_file

from omnivox.benchmarks import easy_vqa_data, image_lora
from omnivox.benchmarks import train_image_model as tim
from omnivox.benchmarks.host import write_results
from omnivox.benchmarks.image_scenes import Question
from omnivox.models.vision import llava_assembly as la


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=600, help="a seeded sample of the 9673 test questions")
    parser.add_argument(
        "--weights",
        type=Path,
        default=Path(tim.__file__).parents[1] / "services/parts/data/shapes-vlm/projector.safetensors",
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--note", default="2-core host shared with other jobs; greedy first answer token, as scored")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/easy-vqa-cpu.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import easy_vqa
    import transformers

    from omnivox.services.parts.defaults import ensure_default_model
    from omnivox.services.parts.vision_defaults import ensure_dinov2_folder

    texts, answers, image_ids = easy_vqa.get_test_questions()
    paths = easy_vqa.get_test_image_paths()
    picks = sorted(random.Random(35).sample(range(len(texts)), min(args.questions, len(texts))))
    ids = sorted({image_ids[i] for i in picks})
    row = {image_id: n for n, image_id in enumerate(ids)}
    t0 = time.time()
    dinov2 = transformers.Dinov2Model.from_pretrained(ensure_dinov2_folder(la.IMAGE_SIZE)).eval()
    feats = tim.encode_images(dinov2, [Image.open(paths[i]).convert("RGB") for i in ids])
    gguf = ensure_default_model(progress=False)
    lm = la.load_text_model(gguf).eval()
    weights = load_file(args.weights)
    rank = next((v.shape[0] for k, v in weights.items() if k.endswith(".lora_A")), 0)
    loras = image_lora.add_lora(lm.model, rank) if rank else {}
    image_lora.load_adapter(loras, weights)
    projector = tim.Projector(torch.zeros(feats.shape[-1]), torch.ones(feats.shape[-1]), lm.config.hidden_size)
    projector.load_folded(weights)
    prompts = tim.Prompts(la.tokenizer_with_image_token(gguf), rows=feats.shape[1])
    questions = [
        (row[image_ids[i]], Question(easy_vqa_data.answer_type(answers[i]), texts[i], answers[i])) for i in picks
    ]
    scores = tim.evaluate(lm, projector, prompts, feats, questions)
    right = sum(s["accuracy"] * s["n"] for s in scores.values())
    result = {
        "weights": str(args.weights),
        "questions": len(questions),
        "images": len(ids),
        "accuracy": round(right / len(questions), 4),
        "by_answer_type": {
            k: {"accuracy": v["accuracy"], "n": v["n"], "majority_answer_share": v["majority_answer_share"]}
            for k, v in scores.items()
        },
        "seconds": round(time.time() - t0),
        "threads": args.threads,
        "note": args.note,
    }
    write_results(args.out, result, indent=1)
    print(result)


if __name__ == "__main__":
    main()
