"""Heads in the layouts the serving engines load, and EAGLE-3 heads from them.

* EAGLE-3 -> vLLM (`LlamaForCausalLMEagle3`, also `Eagle3LlamaForCausalLM` there) and SGLang
  (`LlamaForCausalLMEagle3`): `config.json` (a Llama config with one hidden layer, `draft_vocab_size`,
  `eagle_aux_hidden_state_layer_ids`) and `model.safetensors` with `fc.weight` [H, 3H],
  `midlayer.*` (q/k/v_proj take 2H inputs), `norm.weight`, `lm_head.weight` [draft_vocab, H],
  `d2t` [draft_vocab] (target id - draft id) and `t2d` [vocab] (bool: the token is drafted).
  Token embeddings are left out: both engines take the target's.
* Medusa -> vLLM (`MedusaModel`): `blocks.{h}.layers.0.{weight,bias}`, `lm_heads.{h}.weight`
  [truncated_vocab, H] and `token_map` (the reduced vocabulary's target ids).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import Tensor

from .errors import SpecdecError
from .files import writable_dir
from .models.decoder import Transformer
from .models.eagle import check_vocab_ids
from .models.eagle3 import Eagle3Config, Eagle3Head
from .models.medusa import MedusaHeads

FORMATS = ("vllm", "sglang")
EAGLE3_ARCH = "LlamaForCausalLMEagle3"
MEDUSA_ARCH = "MedusaModel"


FILES = ("config.json", "model.safetensors")


def check_out(out: Path, overwrite: bool) -> None:
    """`out` can take an export: a writable directory (created if needed), holding no export unless `overwrite`
    and no other weights (vLLM and SGLang read every *.safetensors of the folder)."""
    writable_dir(out, "the output directory")        # a file in the way, no permission, a read-only mount...
    for name in FILES:
        if (out / name).exists() and not overwrite:
            raise SpecdecError(f"{out / name} exists; pass --overwrite to replace it")
    others = sorted(f.name for f in out.glob("*.safetensors") if f.name != "model.safetensors")
    if others:
        raise SpecdecError(f"{out} holds other weights ({', '.join(others[:3])}): vLLM and SGLang would load them "
                           "with the export; export into a folder of its own")


def _write(out: Path, config: dict, tensors: dict[str, Tensor], overwrite: bool) -> Path:
    """Both files into a temporary folder inside `out`, then moved in: an interrupted or failed export (Ctrl-C,
    a full disk) leaves `out` as it was, never weights without their config."""
    from safetensors.torch import save

    check_out(out, overwrite)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=".export-", suffix=".tmp", dir=out))
    except OSError as e:
        raise SpecdecError(f"cannot write the export into {out}: {e.strerror or e}") from None
    try:
        _write_file(tmp / "model.safetensors", save({k: v.contiguous() for k, v in tensors.items()},
                                                    metadata={"format": "pt"}))
        _write_file(tmp / "config.json", (json.dumps(config, indent=2) + "\n").encode())
        for name in FILES:
            os.replace(tmp / name, out / name)
    except OSError as e:
        raise SpecdecError(f"cannot write the export into {out}: {e.strerror or e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_file(path: Path, data: bytes) -> None:
    """`data` to a new file `path`, in the umask's usual mode (0644 typically; only mkdtemp's folder is 0700)."""
    path.write_bytes(data)


def eagle3_config(head: Eagle3Head, fmt: str, dtype: str = "bfloat16") -> dict:
    """The Llama config vLLM / SGLang read for an EAGLE-3 head. The aux layers are named twice, each as its engine
    counts: vLLM reads the top-level ids as the layers whose input is taken (ours), SGLang the `eagle_config` ones
    as the layers whose output is taken (one less)."""
    c = head.cfg
    if fmt not in FORMATS:
        raise SpecdecError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if c.extra_layers:
        raise SpecdecError(f"this EAGLE-3 head has {1 + c.extra_layers} decoder layers; {fmt} loads one-layer "
                           "heads only")
    return {"architectures": [EAGLE3_ARCH], "model_type": "llama", "hidden_size": c.dim,
            "intermediate_size": c.hidden_dim, "num_attention_heads": c.n_heads,
            "num_key_value_heads": c.n_kv_heads, "head_dim": c.head_dim, "num_hidden_layers": 1,
            "rms_norm_eps": c.norm_eps, "rope_theta": c.rope_base, "max_position_embeddings": c.max_seq_len,
            "hidden_act": "silu", "vocab_size": c.target_vocab, "draft_vocab_size": c.draft_vocab,
            "tie_word_embeddings": False, "attention_bias": False, "torch_dtype": dtype,
            "target_hidden_size": c.dim, "eagle_aux_hidden_state_layer_ids": list(c.aux_layers),
            "eagle_config": {"use_aux_hidden_state": True,
                             "eagle_aux_hidden_state_layer_ids": [i - 1 for i in c.aux_layers]}}


def eagle3_tensors(head: Eagle3Head) -> dict[str, Tensor]:
    sd = {k: v.detach().to(torch.bfloat16) for k, v in head.state_dict().items() if k != "vocab_ids"}
    ids = head.vocab_ids.long().cpu()
    sd["d2t"] = ids - torch.arange(len(ids))
    t2d = torch.zeros(head.cfg.target_vocab, dtype=torch.bool)
    t2d[ids] = True
    sd["t2d"] = t2d
    return sd


def export_eagle3(head: Eagle3Head, fmt: str, out: Path, overwrite: bool = False) -> Path:
    return _write(out, eagle3_config(head, fmt), eagle3_tensors(head), overwrite)


def export_medusa(heads: MedusaHeads, fmt: str, out: Path, overwrite: bool = False) -> Path:
    if fmt != "vllm":
        raise SpecdecError(f"Medusa heads export to vllm only, not {fmt!r}")
    t = heads.target[0]
    K, H = heads.n_heads, t.config.dim
    lm = heads.lm_weight().detach().to(torch.bfloat16)
    sd: dict[str, Tensor] = {"token_map": heads.vocab_ids.long().cpu()}
    for k in range(K):
        sd[f"blocks.{k}.layers.0.weight"] = heads.w[k].detach().to(torch.bfloat16)
        sd[f"blocks.{k}.layers.0.bias"] = heads.b[k].detach().to(torch.bfloat16)
        sd[f"lm_heads.{k}.weight"] = lm.clone()
    config = {"architectures": [MEDUSA_ARCH], "model_type": "medusa", "hidden_size": H,
              "vocab_size": t.config.vocab_size, "truncated_vocab_size": len(heads.vocab_ids), "num_heads": K,
              "num_hidden_layers": 1, "medusa_fc_bias": True, "max_paths": 64, "topk": 10}
    return _write(out, config, sd, overwrite)


def aux_layers_of(raw: dict, n_layers: int, cfg_file: Path) -> list[int]:
    """The aux layers a config names, as vLLM counts them (the layers whose input is taken): its top-level
    `eagle_aux_hidden_state_layer_ids`, else `eagle_config`'s, counted as SGLang does (outputs: one more), else
    both engines' default."""
    nested = raw.get("eagle_config") or {}
    if not isinstance(nested, dict):
        raise SpecdecError(f"{cfg_file}: eagle_config must be an object, got {json.dumps(nested)[:40]}")
    ids, shift = raw.get("eagle_aux_hidden_state_layer_ids"), 0
    if not ids:
        ids, shift = nested.get("eagle_aux_hidden_state_layer_ids"), 1
    if not ids:
        return [2, n_layers // 2, n_layers - 3]
    if not isinstance(ids, list) or not all(type(i) is int for i in ids):
        raise SpecdecError(f"{cfg_file}: eagle_aux_hidden_state_layer_ids must be a list of integers, got "
                           f"{json.dumps(ids)[:60]}")
    return [i + shift for i in ids]


def import_eagle3(path: Path, target: Transformer) -> Eagle3Head:
    """An EAGLE-3 head in vLLM / SGLang layout (a directory with config.json and *.safetensors) on
    `target`, checked against the target's shapes."""
    from safetensors.torch import load_file

    p = Path(path)
    cfg_file = p / "config.json"
    files = [p / "model.safetensors"] if (p / "model.safetensors").is_file() else sorted(p.glob("*.safetensors"))
    if not cfg_file.is_file() or not files:
        raise SpecdecError(f"{p} is not an EAGLE-3 export (needs config.json and *.safetensors)")
    try:
        raw = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SpecdecError(f"{cfg_file} is not JSON ({e}): not an EAGLE-3 export") from None
    if not isinstance(raw, dict):
        raise SpecdecError(f"{cfg_file} is not a JSON object: not an EAGLE-3 export")
    tc = target.config
    L = tc.n_layers
    aux = aux_layers_of(raw, L, cfg_file)
    want = {"hidden_size": tc.dim, "vocab_size": tc.vocab_size, "num_attention_heads": tc.n_heads,
            "num_key_value_heads": tc.n_kv_heads}
    bad = {k: (raw.get(k), v) for k, v in want.items() if raw.get(k) != v}
    if bad:
        raise SpecdecError(f"{p} was made for another target: " +
                           ", ".join(f"{k} {a} (target: {b})" for k, (a, b) in bad.items()))
    if raw.get("num_hidden_layers", 1) != 1 or len(aux) != 3 or not all(1 <= i < L for i in aux):
        raise SpecdecError(f"{p}: only one-layer heads over three aux layers in 1..{L - 1} load here")
    sd: dict[str, Tensor] = {}
    for f in files:
        try:
            sd.update(load_file(str(f)))
        except Exception as e:                              # safetensors' own error types: a damaged file
            raise SpecdecError(f"corrupt weights file {f}: {type(e).__name__}: {e}") from None
    if "intermediate_size" not in raw:
        raise SpecdecError(f"{cfg_file} names no intermediate_size: not an EAGLE-3 export")
    try:
        draft_vocab = int(raw.get("draft_vocab_size") or tc.vocab_size)
        cfg = Eagle3Config(tc.dim, tc.n_heads, tc.n_kv_heads, int(raw.get("head_dim", tc.head_dim)),
                           int(raw["intermediate_size"]), float(raw.get("rms_norm_eps", tc.norm_eps)),
                           float(raw.get("rope_theta", tc.rope_base)), tc.max_seq_len, tc.vocab_size, draft_vocab,
                           tuple(int(i) for i in aux))
    except (TypeError, ValueError) as e:
        raise SpecdecError(f"{cfg_file}: a field of the wrong type ({e})") from None
    d2t = sd.pop("d2t", torch.zeros(draft_vocab, dtype=torch.long)).long()
    sd.pop("t2d", None)
    sd.pop("embed_tokens.weight", None)
    sd = {k.removeprefix("model."): v for k, v in sd.items()}
    if d2t.shape != (draft_vocab,):
        raise SpecdecError(f"{p}: d2t holds {tuple(d2t.shape)} offsets for a draft vocabulary of {draft_vocab} "
                           "(draft_vocab_size in config.json)")
    sd["vocab_ids"] = d2t + torch.arange(draft_vocab)
    check_vocab_ids(sd["vocab_ids"], tc.vocab_size, f"{p}: the target ids its d2t gives")
    return Eagle3Head.from_state(target, cfg, sd, str(p))
