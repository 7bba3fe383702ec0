"""``Family``: everything the runtime needs of a model family, one record in each ``families/<family>/family.py``."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from paradit.planner.facts import ModelFacts, read_facts
from paradit.spec import ModelSpec

if TYPE_CHECKING:
    from torch import nn

    from paradit.options import ExecutionOptions
    from paradit.parallel.config import ParallelConfig
    from paradit.parallel.tensor_plan import TensorPlan
    from paradit.request import GenerationRequest, ResolvedRequest
    from paradit.text_encoder import PromptEncoder


PIXELS_PER_IMAGE_TOKEN = 16 * 16  # every image family's latent patch: 1/16 of the pixels per side
MEMORY_FILE = "memory.json"  # in a family's folder: working memory measured by benchmarks/memory_estimates.py
FACTS_FILE = "model_facts.json"  # in a family's folder: FLOPs and shapes counted by benchmarks/model_facts.py


TEXT_TOKENS = 512  # the prompt a memory estimate sizes for: the longest most prompt encoders read


def image_tokens(spec: ModelSpec) -> int:
    """An image family's latent patches and a text of ``TEXT_TOKENS``."""
    return spec.height * spec.width // PIXELS_PER_IMAGE_TOKEN + TEXT_TOKENS


@dataclass(frozen=True)
class Measured:
    """What was measured of a family's presets, by preset name: working memory and the planner's model facts."""

    folder: Path | None = None
    activations: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    vae_decode: dict[str, float] = field(default_factory=dict)
    model_facts: dict[str, ModelFacts] = field(default_factory=dict)

    @classmethod
    def read(cls, folder: Path) -> Measured:
        memory = json.loads((folder / MEMORY_FILE).read_text()) if (folder / MEMORY_FILE).is_file() else {}
        return cls(
            folder,
            memory.get("activations", {}).get("models", {}),
            memory.get("vae_decode", {}).get("models", {}),
            read_facts(folder / FACTS_FILE) if (folder / FACTS_FILE).is_file() else {},
        )


class SettledRun(Protocol):
    """What a family's ``check_run`` reads of ``settings.RunSettings``, which sits above every family."""

    @property
    def spec(self) -> ModelSpec: ...

    @property
    def parallel(self) -> ParallelConfig: ...

    @property
    def options(self) -> ExecutionOptions: ...


def imported(module: str, name: str) -> Callable[[ModelSpec], type]:
    """A record's class that the spec does not choose, for ``Family.pipeline`` or ``prompt_encoder``: imported when a
    run builds it, since a family's pipeline module imports diffusers and transformers, which settling goes without."""

    def named_class(spec: ModelSpec) -> type:
        return getattr(import_module(module), name)

    return named_class


@dataclass(frozen=True)
class Family:
    name: str
    pipeline: Callable[[ModelSpec], type]  # its DiffusionPipeline class for a spec (imported when called)
    diffusers_pipelines: tuple[str, ...]  # the diffusers pipeline classes whose checkpoints it serves
    read_checkpoint: Callable[[Path, dict[str, Any]], ModelSpec]  # (folder, its model_index.json) -> its spec
    resolve_request: Callable[[ModelSpec, GenerationRequest], ResolvedRequest]
    uses_cfg: Callable[[ModelSpec, ResolvedRequest], bool]  # two guidance branches a step, by diffusers' rule
    build_transformer: Callable[[ModelSpec], nn.Module]  # the plain transformer (the loader builds it on meta)
    prompt_encoder: Callable[[ModelSpec], type[PromptEncoder]]
    vae: str  # the diffusers autoencoder class of the ``vae/`` component, by name: ``vae_class`` imports it
    tensor_plan: TensorPlan | None
    keep_high_precision: tuple[str, ...]  # name fragments of the linears FP8 leaves in the model dtype
    lora_loader: str  # the diffusers LoRA loader mixin whose ``lora_state_dict`` converts this family's adapters
    video: bool = False  # whether it makes videos (batch, frames, 3, H, W) rather than images
    sequence_tokens: Callable[[ModelSpec], int] = image_tokens  # tokens a sample's blocks see (memory estimate)
    after_dummy_init: Callable[[nn.Module], None] | None = None  # fills a model's fixed buffers after random init
    check_run: Callable[[SettledRun, ResolvedRequest], None] | None = None  # refuses what a plan cannot give a request
    measured: Measured = Measured()  # what was measured of its presets: ``Measured.read`` of its folder

    @property
    def vae_class(self) -> type:
        import diffusers  # here, where a VAE is built: settling a run stays light

        return getattr(diffusers, self.vae)
