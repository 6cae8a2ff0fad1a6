"""LoRA on the learner: the model wrapped by peft, only the adapter trainable, and the adapter's tensors by the names
PEFT saves them under (what the weight sync sends and the replicas load).

    model = wrap(model, settings)                     # a PeftModel: base weights frozen, the adapter trainable
    info = adapter_info(settings)                     # AdapterInfo (services/adapters.py): rank, alpha, base
    for wire_name, position, param in adapter_params(engine.module): ...

The adapter starts as peft initialises it (lora_B = 0: version 0 is the base model exactly; lora_A random, drawn from
--seed, so that every rank, a replay and a run started again draw the same). DeepSpeed sees only
the adapter's parameters in the optimizer (fp32 master weights and AdamW state for them alone, bf16 or not); the
frozen base is cast to the compute dtype with the rest of the module. LoRA dropout acts in training passes only: the
no-grad log-prob pass (pi_prox) switches the dropout modules off (learner/trainer.py), as the replicas sample
without dropout.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from learner.settings import LearnerSettings
from services.adapters import PREFIX, AdapterInfo, fingerprint


def alpha(s: LearnerSettings) -> float:
    assert s.lora_rank is not None
    return s.lora_alpha if s.lora_alpha is not None else 2.0 * s.lora_rank


def adapter_info(s: LearnerSettings) -> AdapterInfo:
    assert s.lora_rank is not None
    return AdapterInfo(fingerprint(s.model_dir), s.lora_rank, alpha(s), tuple(s.lora_target_list))


def linear_names(model: torch.nn.Module) -> set[str]:
    """The last name part of every linear layer of the model: what --lora-targets can name."""
    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def check_targets(model: torch.nn.Module, targets: list[str]) -> None:
    """Every target names a linear layer of this model (peft would refuse later, less clearly)."""
    have = linear_names(model)
    if missing := [t for t in targets if t.rsplit(".", 1)[-1] not in have]:
        raise ValueError(
            f"--lora-targets {','.join(missing)}: this model has no such linear layer; it has {', '.join(sorted(have))}"
        )


def wrap(model: torch.nn.Module, s: LearnerSettings) -> Any:
    """The model as a PeftModel with a fresh adapter: base weights frozen, the adapter trainable."""
    from peft import LoraConfig, get_peft_model

    assert s.lora_rank is not None
    check_targets(model, s.lora_target_list)
    config = LoraConfig(
        r=s.lora_rank,
        lora_alpha=alpha(s),  # type: ignore[arg-type]  # typed int by peft; used as alpha / r, a float works
        lora_dropout=s.lora_dropout,
        target_modules=s.lora_target_list,
        bias="none",
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng():  # A's random init from --seed: every rank, a resumed run and a replay agree
        torch.manual_seed(s.seed)
        return get_peft_model(model, config)


def is_peft(module: torch.nn.Module) -> bool:
    return hasattr(module, "peft_config")


def wire_name(name: str) -> str:
    """A parameter's name in the module -> its name in PEFT's saved adapter (the adapter name dropped)."""
    for part in (".lora_A.", ".lora_B."):
        if part in name:
            head, tail = name.split(part, 1)
            return head + part + tail.split(".", 1)[1]
    raise ValueError(f"{name!r} is not a LoRA parameter")


def adapter_params(module: torch.nn.Module) -> Iterator[tuple[str, int, torch.nn.Parameter]]:
    """(name in PEFT's adapter file, position in module.parameters(), parameter) of each adapter tensor."""
    for position, (name, p) in enumerate(module.named_parameters()):
        if p.requires_grad:
            wired = wire_name(name)
            if not wired.startswith(PREFIX):
                raise ValueError(f"{name!r}: a PeftModel's parameter names start with {PREFIX!r}")
            yield wired, position, p
